"""Greedy parity with transformers: minicore's tokens equal model.generate(do_sample=False), token
for token, in four configurations (one batch; chunked prefill; prefix-cache hits; preemption),
each of which is asserted to have really happened."""

import pytest
import torch

from minicore.llm import LLM
from minicore.model.attention import attn_implementation
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

MAX_NEW = 48
TEXTS = [
    "Hi",
    "The capital of France is",
    "Write a short poem about the sea and the wind.",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "In 1969, the Apollo 11 mission landed two astronauts on the Moon. Describe what they did "
    "there",
    "List three reasons why the sky looks blue during the day, and explain each one in a sentence.",
    "Once upon a time, in a village at the edge of a great forest, there lived an old clockmaker "
    "who had never left his workshop. One winter morning, a stranger knocked at his door and",
    "Translate to French: The weather is lovely today, and I would like to walk along the river "
    "with my friends before we have lunch together at the small cafe near the old bridge.",
]
SHARED_PREFIX = (
    "You are a helpful assistant. Answer clearly and briefly, give one example when it helps, and "
    "never invent facts. If you do not know something, say so plainly and suggest where to look. "
)



def _reference(model, tokenizer, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding), stopping at EOS."""
    outputs = []
    with attn_implementation(model, "sdpa"), torch.inference_mode():
        for ids in prompts:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                 eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def model_tok(hf_model_and_tokenizer):
    return hf_model_and_tokenizer


@pytest.fixture(scope="module")
def texts_reference(model_tok):
    """TEXTS encoded, and transformers' greedy tokens for them: three of the tests share both."""
    model, tok = model_tok
    prompts = _encode(tok, TEXTS)
    return prompts, _reference(model, tok, prompts)


def _encode(tokenizer, texts):
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def _run(model, tokenizer, prompts, **engine_args):
    llm = LLM(model, tokenizer=tokenizer, **engine_args)
    scheduled = []
    schedule = llm.llm_engine.scheduler.schedule

    def recording_schedule():
        out = schedule()
        scheduled.append(dict(out.num_scheduled_tokens))
        return out

    llm.llm_engine.scheduler.schedule = recording_schedule
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0), use_tqdm=False)
    return llm, outs, scheduled


def _assert_parity(outs, reference):
    for i, (out, ref) in enumerate(zip(outs, reference)):
        assert out.outputs[0].token_ids == ref, f"prompt {i} diverges from transformers"


def test_one_batch(model_tok, texts_reference):
    model, tok = model_tok
    prompts, reference = texts_reference
    llm, outs, scheduled = _run(model, tok, prompts, max_model_len=512)
    assert set(scheduled[0]) == {o.request_id for o in outs}, "all prompts ran in the first step"
    _assert_parity(outs, reference)
    assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0


def test_chunked_prefill(model_tok, texts_reference):
    model, tok = model_tok
    prompts, reference = texts_reference
    llm, outs, scheduled = _run(model, tok, prompts, max_model_len=512, max_num_batched_tokens=24)
    chunks = {}
    for step in scheduled:
        for req_id, n in step.items():
            if n > 1:
                chunks[req_id] = chunks.get(req_id, 0) + 1
    assert max(len(p) for p in prompts) > 24 and max(chunks.values()) >= 2, "no prompt was chunked"
    _assert_parity(outs, reference)


def test_prefix_cache_hits(model_tok):
    model, tok = model_tok
    # Four prompts are enough for three hits on the shared prefix (its reference is the test's
    # costliest part: transformers' generate, one prompt at a time).
    prompts = _encode(tok, [SHARED_PREFIX + t for t in TEXTS[:4]])
    reference = _reference(model, tok, prompts)
    llm, outs, _ = _run(model, tok, prompts, max_model_len=512, block_size=16)
    assert all(o.num_cached_tokens >= 32 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    _assert_parity(outs, reference)


def test_preemption_and_recompute(model_tok, texts_reference):
    model, tok = model_tok
    prompts, reference = texts_reference
    # 160 tokens of KV: enough for the longest request alone, far too little for all at once.
    llm, outs, _ = _run(model, tok, prompts, max_model_len=160, block_size=16, num_blocks=11)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_parity(outs, reference)
