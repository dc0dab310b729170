"""Greedy parity with transformers in float32: every token minicore picks is transformers' argmax
for the sequence before it, at every position of every output, in four configurations (one batch;
chunked prefill; prefix-cache hits; preemption), each of which is asserted to have really happened.
The check is teacher forcing: one transformers forward over each prompt and output gives the
logits that model.generate(do_sample=False) picks its tokens from, position by position, so the
tokens pass only if they are generate's (an output cut short is caught too: it must end at EOS,
which must be the argmax there, or at max_tokens). One forward per sequence, where generate takes
one per token (the four tests: 84 s -> 56 s, docs/BENCHMARKS.md)."""

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



def _assert_parity(model, tokenizer, outs) -> None:
    """Each output's tokens are transformers' argmax at each position, and it ends at EOS or at
    MAX_NEW tokens."""
    with attn_implementation(model, "sdpa"), torch.inference_mode():
        for i, out in enumerate(outs):
            tokens = list(out.outputs[0].token_ids)
            prompt = out.prompt_token_ids
            logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
            argmax = logits.argmax(dim=-1).tolist()
            diverged = next((k for k, (a, b) in enumerate(zip(argmax, tokens)) if a != b), None)
            assert diverged is None, f"prompt {i} diverges from transformers at token {diverged}"
            assert len(tokens) == MAX_NEW or tokens[-1] == tokenizer.eos_token_id, \
                f"prompt {i} ended early, after {len(tokens)} tokens"


@pytest.fixture(scope="module")
def model_tok(hf_model_and_tokenizer):
    return hf_model_and_tokenizer


@pytest.fixture(scope="module")
def prompts(model_tok):
    return _encode(model_tok[1], TEXTS)


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


def test_one_batch(model_tok, prompts):
    model, tok = model_tok
    llm, outs, scheduled = _run(model, tok, prompts, max_model_len=512)
    assert set(scheduled[0]) == {o.request_id for o in outs}, "all prompts ran in the first step"
    _assert_parity(model, tok, outs)
    assert llm.llm_engine.scheduler.kv_cache_manager.usage == 0


def test_chunked_prefill(model_tok, prompts):
    model, tok = model_tok
    llm, outs, scheduled = _run(model, tok, prompts, max_model_len=512, max_num_batched_tokens=24)
    chunks = {}
    for step in scheduled:
        for req_id, n in step.items():
            if n > 1:
                chunks[req_id] = chunks.get(req_id, 0) + 1
    assert max(len(p) for p in prompts) > 24 and max(chunks.values()) >= 2, "no prompt was chunked"
    _assert_parity(model, tok, outs)


def test_prefix_cache_hits(model_tok):
    model, tok = model_tok
    # Four prompts are enough for three hits on the shared prefix.
    prompts = _encode(tok, [SHARED_PREFIX + t for t in TEXTS[:4]])
    llm, outs, _ = _run(model, tok, prompts, max_model_len=512, block_size=16)
    assert all(o.num_cached_tokens >= 32 for o in outs[1:]), [o.num_cached_tokens for o in outs]
    assert llm.llm_engine.scheduler.kv_cache_manager.prefix_cache_stats.hits > 0
    _assert_parity(model, tok, outs)


def test_preemption_and_recompute(model_tok, prompts):
    model, tok = model_tok
    # 160 tokens of KV: enough for the longest request alone, far too little for all at once.
    llm, outs, _ = _run(model, tok, prompts, max_model_len=160, block_size=16, num_blocks=11)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    _assert_parity(model, tok, outs)
