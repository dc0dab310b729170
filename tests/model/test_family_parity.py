"""Greedy parity with transformers across model families: for each family a tiny random model
(float32, 2 layers, hidden 64, vocabulary 256) is saved as a directory with the default model's
tokenizer and served by minicore's LLM, whose greedy tokens must equal transformers' eager
generate(do_sample=False) token for token, with chunked prefill (a 16-token budget) and prefix-cache
hits asserted to have happened. Gemma2 / Gemma3 / Mistral / Qwen2-MoE get a sliding window of 8,
far shorter than the sequences, Gemma2 its attention and final logit soft-caps, Cohere and Granite
their logit scales (which greedy tokens cannot see, so compute_logits is also checked against
transformers' logits). DeepSeek-V3 (q_lora, YaRN) and V2 (no q_lora) run multi-head latent
attention (minicore/model/mla.py; more in test_mla.py)."""

import pytest
import torch

from minicore.llm import LLM
from minicore.model.attention import compute_logits
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 10
BUDGET = 16  # max_num_batched_tokens: every prompt below is chunked
WINDOW = 8
_COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
               # Wider than the default 0.02: logits far apart, so float summation order (paged
               # vs eager attention) cannot flip an argmax.
               initializer_range=0.2)
_MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32)
_MLA = dict(kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
            num_key_value_heads=4, n_routed_experts=4, n_shared_experts=1,
            first_k_dense_replace=1, **_MOE)
FAMILIES = {
    "llama": {},
    "qwen2": {},
    "qwen3": dict(head_dim=16),
    "mistral": dict(sliding_window=WINDOW),
    "phi3": {},
    "olmo2": {},
    "granite": dict(logits_scaling=4.0, attention_multiplier=0.2, embedding_multiplier=2.0,
                    residual_multiplier=0.5),
    "cohere": dict(logit_scale=0.5),
    "gemma2": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16,
                   attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "gemma3_text": dict(sliding_window=WINDOW, head_dim=16, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(num_experts=4, head_dim=16, **_MOE),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    # Its sliding layers carry the window on the attention module only (not as an argument).
    "qwen2_moe": dict(num_experts=4, shared_expert_intermediate_size=32, use_sliding_window=True,
                      sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"],
                      **_MOE),
    "gpt_neox": dict(num_key_value_heads=4),  # no GQA: the cache layout reads this field
    "phi": {},
    # Multi-head latent attention (mla.py): V3 with q_lora, YaRN scaling (its softmax scale's
    # mscale too) and interleaved rotary; V2-Lite's shape without q_lora, complex rotary.
    "deepseek_v3": dict(_MLA, q_lora_rank=32, n_group=2, topk_group=1,
                        rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=10000.0,
                                             original_max_position_embeddings=64,
                                             mscale=1.0, mscale_all_dim=1.0)),
    "deepseek_v2": dict(_MLA, q_lora_rank=None, n_group=1, topk_group=1),
}
# A shared 32-token prefix (two 16-token blocks) for cache hits, then distinct tails.
_PREFIX = list(range(3, 35))
PROMPTS = [_PREFIX + list(range(100, 109)), _PREFIX + list(range(200, 221)),
           list(range(40, 70))]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(), vocab_size=False)


def _build(family: str, path, tokenizer, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**_COMMON, **FAMILIES.get(family, {}), **overrides})
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _reference(path) -> list[list[int]]:
    """transformers' eager greedy generate (eager: the one attention with soft-caps), stopping at
    EOS as minicore does."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager")
    outputs = []
    with torch.inference_mode():
        for ids in PROMPTS:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 pad_token_id=0)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


def _recorded(llm: LLM) -> list[dict]:
    scheduled, schedule = [], llm.llm_engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    llm.llm_engine.scheduler.schedule = recording_schedule
    return scheduled


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_parity(family, tmp_path, tokenizer):
    path = _build(family, tmp_path / family, tokenizer)
    reference = _reference(path)
    llm = LLM(str(path), max_model_len=128, block_size=16, max_num_batched_tokens=BUDGET,
              num_blocks=32, dtype="float32", device="cpu")
    scheduled = _recorded(llm)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    # The first prompt alone, then all: the others' shared prefix is a cache hit.
    outs = llm.generate(PROMPTS[:1], params, use_tqdm=False)
    outs += llm.generate(PROMPTS[1:], params, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref, f"{family}: prompt {i} diverges from transformers"
    chunks = [sum(1 for step in scheduled if step.get(o.request_id, 0) > 1) for o in outs]
    assert min(chunks) >= 2, f"not every prompt was chunked: {chunks}"
    assert outs[1].num_cached_tokens >= len(_PREFIX), "the shared prefix was not a cache hit"
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    if FAMILIES[family].get("sliding_window"):
        assert min(len(p) for p in PROMPTS) > 2 * WINDOW, "the window is not exercised"


@pytest.mark.parametrize("family", ["gemma2", "cohere", "granite"])
def test_logits_finished_as_transformers_does(family):
    """Greedy tokens cannot see a logit scale or a final soft-cap (argmax is unchanged), sampling
    can: compute_logits on the LM head's output equals transformers' own logits."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **{**_COMMON, **FAMILIES[family]})
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[0]])
    with torch.inference_mode():
        head = model.get_output_embeddings()(model.base_model(input_ids=ids).last_hidden_state)
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(compute_logits(config, head), expected)
    assert not torch.allclose(head, expected, atol=1e-3), "the family's finishing was a no-op"
