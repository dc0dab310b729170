"""Multi-head latent attention (minicore/model/mla.py) beyond the families' parity test (which runs
the tiny DeepSeek-V3 / V2 models with batch invariance, every token an absorbed decode query):
the cache holds one latent row a token; without batch invariance (prefill sequences expanded
through kv_b_proj, decodes absorbed, by the pools and by the gather) and through preemptions,
greedy tokens still equal transformers' in float32; in bfloat16 each token minicore picks is
transformers' argmax for the same sequence or within bfloat16 rounding of it (teacher forcing, as
test_bf16_parity does for the default model)."""

from types import SimpleNamespace

import pytest
import torch
from test_family_parity import MAX_NEW, PROMPTS, _build, _reference
from test_native import native_kernel

from minicore.llm import LLM
from minicore.model.attention import GatheredDecode
from minicore.model.decode_kv import DecodeKVBuffers
from minicore.model.kv_cache_interface import kv_cache_spec
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.model.mla import MLAAttention
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
ENGINE = dict(max_model_len=128, block_size=16, max_num_batched_tokens=16, dtype="float32",
              device="cpu")


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tokenizer = load_tokenizer(resolve_model_dir(), vocab_size=False)
    root = tmp_path_factory.mktemp("mla")
    paths = {family: _build(family, root / family, tokenizer)
             for family in ("deepseek_v3", "deepseek_v2")}
    return paths, {family: _reference(paths[family]) for family in ("deepseek_v3", "deepseek_v2")}


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)
    outs += llm.generate(PROMPTS[1:], GREEDY, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outs]


def test_the_cache_holds_one_latent_row_per_token(models):
    paths, _ = models
    llm = LLM(str(paths["deepseek_v3"]), num_blocks=32, **ENGINE)
    runner = llm.llm_engine.model_runner
    config = runner.model.config
    row = config.kv_lora_rank + config.qk_rope_head_dim
    assert [tuple(c.shape) for c in runner.kv_caches] == [(1, 32, 16, 1, row)] * 2
    assert sum(isinstance(m.forward, MLAAttention) for m in runner.model.modules()) == 2
    # Against multi-head attention of the same width (4 heads of 16 for K and V): 24 vs 128.
    mha = kv_cache_spec(SimpleNamespace(hidden_size=64, num_attention_heads=4,
                                        num_key_value_heads=4))
    assert (kv_cache_spec(config).bytes_per_token(4), mha.bytes_per_token(4)) == (24 * 4, 128 * 4)


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
@pytest.mark.parametrize("decode", ["kernel", "torch", "gather"])
def test_greedy_parity_with_prefill_expanded_and_decode_absorbed(models, family, decode):
    """batch_invariant=False: prefill chunks attend per sequence over expanded keys and values
    (a later chunk and a prefix-cache hit read the latents back from the cache), decodes are
    absorbed, read from the CPU pools by the native kernel or by torch, or by the paged gather
    (as on CUDA)."""
    paths, references = models
    if decode == "kernel":
        native_kernel()
    llm = LLM(str(paths[family]), num_blocks=32, batch_invariant=False, **ENGINE)
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.decode_attention, DecodeKVBuffers)
    if decode == "torch":
        runner.decode_attention = DecodeKVBuffers(runner.kv_caches)
    if decode == "gather":
        runner.decode_attention = GatheredDecode()
    assert _generate(llm) == references[family]


def test_preempted_requests_recompute_their_latents(models):
    """Too few blocks for all three at once: requests are preempted and recomputed, and every
    one still gets transformers' tokens."""
    paths, references = models
    llm = LLM(str(paths["deepseek_v3"]), num_blocks=6, **{**ENGINE, "max_model_len": 64})
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == references["deepseek_v3"]
    assert llm.llm_engine.scheduler.num_preemptions > 0


def test_bfloat16_tokens_are_transformers_argmax_within_rounding(models):
    from transformers import AutoModelForCausalLM

    paths, _ = models
    path = str(paths["deepseek_v3"])
    llm = LLM(path, num_blocks=64, **{**ENGINE, "dtype": "bfloat16"})
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16,
                                                     attn_implementation="eager")
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    gaps, steps = [], []
    with torch.inference_mode():
        for out in llm.generate(PROMPTS, params, use_tqdm=False):
            tokens = list(out.outputs[0].token_ids)
            ids = torch.tensor([out.prompt_token_ids + tokens])
            logits = reference(ids).logits[0, len(out.prompt_token_ids) - 1:-1].float()
            picked = logits.gather(1, torch.tensor(tokens)[:, None])[:, 0]
            top = logits.max(dim=1).values
            gaps += (top - picked).tolist()
            # Two bfloat16 steps at the top logit's magnitude: a near-tie rounded either way.
            steps += (2 * 2.0 ** (torch.floor(torch.log2(top.abs())) - 7)).tolist()
    assert all(gap <= step for gap, step in zip(gaps, steps)), max(gaps)
    assert sum(gap == 0 for gap in gaps) >= 0.9 * len(gaps)


def _word_tokenizer():
    """A 256-word tokenizer built here (a CUDA machine may lack the default model's package)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(256)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="t0")),
                                   pad_token="t0", bos_token="t1", eos_token="t2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v2"])
def test_on_cuda_greedy_parity_with_the_gathered_absorbed_decode(tmp_path, family):
    """On CUDA: the paged gather for decode, the absorbed products by batched matmuls; float32
    tokens equal transformers' on the same device, chunked and with a prefix-cache hit."""
    from transformers import AutoModelForCausalLM

    path = _build(family, tmp_path, _word_tokenizer())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").to("cuda")
    reference = [model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW,
                                do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                 for ids in PROMPTS]
    llm = LLM(str(path), num_blocks=32, **{**ENGINE, "device": "cuda"})
    runner = llm.llm_engine.model_runner
    assert isinstance(runner.decode_attention, GatheredDecode) and not runner.batch_invariant
    assert runner.kv_caches[0].shape[0] == 1  # one latent row a token
    assert _generate(llm) == reference
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0


def test_new_weights_reach_the_absorbed_products(tmp_path):
    """With batch invariance the per-head kernel takes W_UK's transpose, copied when the layers
    bind: a weight update binds them again, and the tokens are the new model's. (Dense layers
    only: test_load_weights_moe.py updates the MoE layers.)"""
    tokenizer = load_tokenizer(resolve_model_dir(), vocab_size=False)
    first, other = (_build("deepseek_v3", tmp_path / name, tokenizer, first_k_dense_replace=2,
                           initializer_range=scale)
                    for name, scale in (("first", 0.2), ("other", 0.25)))
    llm = LLM(str(first), num_blocks=32, **ENGINE)
    assert llm.llm_engine.model_runner.batch_invariant
    llm.start_weight_update()
    llm.update_weights({"path": str(other)})
    llm.finish_weight_update()
    assert _generate(llm) == _reference(other) != _reference(first)
