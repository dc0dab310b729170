"""MTP drafts (speculative_config method "mtp" / "deepseek_mtp": minicore/model/eagle.py and
deepseek_mtp.py) on the tiny DeepSeek-V3 of test_family_parity with a random MTP layer appended to
its checkpoint (mtp_models.py). Random weights draft noise, so: greedy tokens with MTP drafts (k =
1, 2, 3; sync and async scheduling; chunked prefill and prefix hits) equal transformers' in float
32; the drafts are proposed and counted, the MTP layer has a KV cache of its own and the scheduler
the lookahead slots; every draft the runner proposes equals the one computed by hand over the
whole sequence without a cache (mtp_models.reference_drafts), also after steps whose drafts an
oracle made the target accept, all or some (the MTP KV of accepted positions is read then, that
of rejected ones rewritten first), and through preemptions; on CUDA the same (gpu-marked); a
model without MTP layers is refused with the reason."""

import json

import pytest
import torch
from mtp_models import add_mtp_layers, mtp_layers, reference_drafts
from test_family_parity import MAX_NEW, PROMPTS, _build, _reference

from minicore.llm import LLM
from minicore.model.loader import load_tokenizer, resolve_model_dir
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0)
ENGINE = dict(max_model_len=128, block_size=16, max_num_batched_tokens=16, num_blocks=48,
              dtype="float32", device="cpu")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model_dir(), vocab_size=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory, tokenizer):
    path = add_mtp_layers(_build("deepseek_v3", tmp_path_factory.mktemp("mtp") / "v3", tokenizer))
    return path, _reference(path)


def _llm(path, k: int, **kwargs) -> LLM:
    return LLM(str(path), speculative_config={"method": "deepseek_mtp",
                                              "num_speculative_tokens": k},
               **{**ENGINE, **kwargs})


def _generate(llm: LLM, together: bool = False) -> list[list[int]]:
    """The first prompt alone, then the two that share its 32-token prefix (a prefix hit); or
    all three together."""
    batches = [PROMPTS] if together else [PROMPTS[:1], PROMPTS[1:]]
    return [list(out.outputs[0].token_ids) for batch in batches
            for out in llm.generate(batch, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("k, async_scheduling", [(1, False), (3, False), (2, True)])
def test_greedy_with_mtp_drafts_equals_without(model, k, async_scheduling):
    path, reference = model
    llm = _llm(path, k, async_scheduling=async_scheduling)
    engine = llm.llm_engine
    assert engine.config.speculative_config.method == "mtp"
    assert _generate(llm) == reference
    stats = engine.scheduler.spec_decode.stats
    assert stats.num_drafts > 0 and stats.num_draft_tokens == k * stats.num_drafts
    runner = engine.model_runner
    assert runner.num_kv_layers == len(runner.kv_caches) == 3  # two layers and the MTP layer
    assert engine.scheduler.kv_cache_manager.num_lookahead_tokens == k
    assert engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0


# Too few blocks for the three requests at once (seven, with the null block; a request of
# max_model_len takes four): requests are preempted and recomputed, their MTP KV too.
PREEMPTED = dict(num_blocks=7, max_model_len=64)


@pytest.mark.parametrize("engine", [{}, {"async_scheduling": True}, PREEMPTED],
                         ids=["sync", "async", "preempted"])
def test_every_draft_is_the_full_sequence_reference(model, engine):
    """Every step the runner's drafts, and draft 0's logits, are recorded, then the drafts are
    replaced by an oracle's (the reference continuation, with its second draft wrong every other
    step; every third step they stand): the target accepts 2, 1 or about none, and what was
    recorded still equals reference_drafts over the tokens at that step (the logits within
    float32 rounding: a wrong KV row anywhere would move them)."""
    path, reference = model
    llm = _llm(path, 2, **engine)
    recorded = _record_drafts(llm, reference)
    assert _generate(llm, together=engine is PREEMPTED) == reference
    stats = llm.llm_engine.scheduler.spec_decode.stats
    assert stats.num_accepted_tokens_per_pos[1] > 0  # whole runs accepted
    assert (llm.llm_engine.scheduler.num_preemptions > 0) == (engine is PREEMPTED)
    _check_drafts(path, recorded, "cpu")


def _record_drafts(llm: LLM, reference: list[list[int]]) -> list:
    """(tokens, drafts, draft 0's logits) of every request at every step, the drafts then
    replaced by the oracle's."""
    drafter = llm.llm_engine.model_runner.drafter
    proposer = getattr(drafter, "proposer", drafter)
    propose, compute_logits = proposer.propose, proposer.model.compute_logits
    recorded, logits = [], []
    full = {tuple(prompt): prompt + out for prompt, out in zip(PROMPTS, reference)}

    def recording_logits(hidden, spec_step_idx=0):
        logits.append(compute_logits(hidden, spec_step_idx))
        return logits[-1]

    def oracle(hidden, meta, states, output, drafting):
        logits.clear()
        drafts = propose(hidden, meta, states, output, drafting)
        for (req_id, proposed), row_logits in zip(drafts.items(), logits[:1] and logits[0]):
            tokens = list(states[output.req_id_to_index[req_id]].token_ids)
            recorded.append((tokens, proposed, row_logits))
            prompt = next(seq for seq in full if list(seq) == tokens[:len(seq)])
            truth = full[prompt][len(tokens):len(tokens) + 2]
            if len(recorded) % 3 == 1:
                drafts[req_id] = truth
            elif len(recorded) % 3 == 2:
                drafts[req_id] = truth[:1] + [(truth[1:] or [0])[0] ^ 1]
        return drafts

    proposer.propose, proposer.model.compute_logits = oracle, recording_logits
    return recorded


def _check_drafts(path, recorded: list, device: str) -> None:
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                  attn_implementation="sdpa").to(device)
    layer = mtp_layers(target.config)[0].to(device)
    assert len(recorded) > 10
    for tokens, proposed, row_logits in recorded:
        drafts, draft_logits = reference_drafts(target, layer, tokens, 2)
        assert proposed == drafts, tokens
        torch.testing.assert_close(row_logits, draft_logits, rtol=0, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_greedy_with_mtp_drafts_equals_without(tmp_path):
    """On CUDA (the paged gather, the absorbed products by batched matmuls): float32 tokens with
    MTP drafts equal transformers' on the same device, and every draft the reference's."""
    from test_mla import _word_tokenizer
    from transformers import AutoModelForCausalLM

    path = add_mtp_layers(_build("deepseek_v3", tmp_path, _word_tokenizer()))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 attn_implementation="eager").to("cuda")
    reference = [model.generate(torch.tensor([ids], device="cuda"), max_new_tokens=MAX_NEW,
                                do_sample=False, pad_token_id=0)[0, len(ids):].tolist()
                 for ids in PROMPTS]
    llm = _llm(path, 2, device="cuda")
    recorded = _record_drafts(llm, reference)
    assert _generate(llm) == reference
    assert llm.llm_engine.model_runner.kv_caches[-1].is_cuda
    _check_drafts(path, recorded, "cuda")


def test_a_model_without_mtp_layers_is_refused(tmp_path, tokenizer):
    llama = _build("llama", tmp_path / "llama", tokenizer)
    with pytest.raises(ValueError, match=r"DeepSeek-V2/V3; model 'llama' \(LlamaForCausalLM\) "
                                         r"has none"):
        _llm(llama, 2)
    # transformers' DeepSeek-V3 config claims one MTP layer; this checkpoint has no weights.
    plain = _build("deepseek_v3", tmp_path / "v3", tokenizer)
    with pytest.raises(ValueError, match=r"has no weights of layer 2 \(model\.layers\.2\.\*\)"):
        _llm(plain, 2)
    config = json.loads((plain / "config.json").read_text())
    (plain / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 0}))
    with pytest.raises(ValueError, match="num_nextn_predict_layers is 0"):
        _llm(plain, 2)
