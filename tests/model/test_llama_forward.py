"""A Llama model's layers as plain calls on CPU (minicore/model/llama_forward.py): the default
model (SmolLM2, Llama's code) takes it, and gives transformers' forward's bits: the same tokens,
logprobs and prompt logprobs, in float32 and bfloat16, with batch invariance or not, over steps
that mix chunked prefills and decodes; a model whose code is not Llama's, or one with a hook,
keeps transformers' forward."""

import pytest
import torch
from moe_models import build_served_moe

from minicore.llm import LLM
from minicore.model import llama_forward
from minicore.model.loader import load_model
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

PROMPTS = ["The capital of France is", "def fibonacci(n):\n    if n < 2:",
           "Once upon a time, in a land far away, there lived a king who " * 3,
           "List three colours:"]
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)


def outputs(llm: LLM) -> list:
    llm.reset_prefix_cache()  # every prompt computed again, none read from the cache
    return [(o.prompt_logprobs, [(c.token_ids, c.logprobs) for c in o.outputs])
            for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def is_plain(llm: LLM) -> bool:
    return getattr(llm.llm_engine.model_runner.forward_hidden, "func", None) is (
        llama_forward._forward)


@pytest.mark.parametrize("dtype, batch_invariant", [
    ("float32", False), ("bfloat16", False), ("float32", True), ("bfloat16", True)])
def test_the_default_model_takes_it_with_transformers_bits(dtype, batch_invariant):
    # Chunks of 16 tokens: steps that mix a prompt's chunk with other requests' decodes.
    llm = LLM(dtype=dtype, batch_invariant=batch_invariant, max_model_len=256,
              kv_cache_memory=32 << 20, max_num_batched_tokens=16)
    assert is_plain(llm)
    plain = outputs(llm)
    runner = llm.llm_engine.model_runner
    runner.forward_hidden = runner._transformers_forward
    assert outputs(llm) == plain


def test_other_models_and_hooked_ones_keep_transformers_forward(tmp_path):
    moe = LLM(str(build_served_moe("mixtral", tmp_path / "mixtral")), max_model_len=128,
              kv_cache_memory=8 << 20)
    assert not is_plain(moe)
    model, tokenizer = load_model(dtype="float32", device="cpu")
    handle = model.model.layers[3].mlp.register_forward_hook(lambda *args: None)
    try:
        hooked = LLM(model, tokenizer=tokenizer, max_model_len=128, kv_cache_memory=8 << 20)
        assert not is_plain(hooked)
    finally:
        handle.remove()
    assert llama_forward.llama_forward(model.model, None) is not None
    assert llama_forward.llama_forward(torch.nn.Linear(2, 2), None) is None
