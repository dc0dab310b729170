"""The compiled-grammar cache and the compile threads (minicore/structured_output/manager.py):
the engine's memory plateaus over many distinct grammars within VLLM_XGRAMMAR_CACHE_MB, a repeated
constraint is compiled once, and a small grammar never waits behind a large one."""

import json
import random
import threading
import time

import psutil
import pytest

from minicore.llm import LLM
from minicore.request import Request
from minicore.sampling_params import SamplingParams, StructuredOutputsParams
from minicore.structured_output.manager import (
    SMALL_GRAMMAR_CHARS,
    StructuredOutputManager,
    _make_compiler,
    cache_limit_mb,
)

pytestmark = pytest.mark.model


def enum_schema(rng: random.Random, n: int) -> dict:
    return {"enum": ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
                     for _ in range(n)]}


def compile_json(manager: StructuredOutputManager, schema: dict):
    params = StructuredOutputsParams(json=schema)
    return manager._compile(params, params.key())


@pytest.fixture(scope="module")
def tokenizer_and_vocab(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    return tokenizer, model.config.vocab_size


def test_memory_plateaus_over_100_distinct_grammars_within_the_cache_bound(tokenizer_and_vocab):
    """Each grammar compiles to some 500 KiB; the cache keeps at most 4 MiB of them. xgrammar's
    own cache at vLLM's 512 MiB (before) grew the process by 134 MiB over the last 80."""
    limit = 4 << 20
    manager = StructuredOutputManager(*tokenizer_and_vocab, cache_limit_bytes=limit)
    manager.compiler = _make_compiler(*tokenizer_and_vocab)
    rng, process = random.Random(0), psutil.Process()
    for i in range(100):
        compile_json(manager, enum_schema(rng, 300))
        assert manager.cache.size_bytes <= limit
        if i == 19:
            after_20 = process.memory_info().rss
    growth = process.memory_info().rss - after_20
    assert growth < 32 << 20, f"grew {growth >> 20} MiB over the last 80 grammars"


def test_a_repeated_constraint_is_compiled_once_and_a_huge_one_not_kept(tokenizer_and_vocab):
    manager = StructuredOutputManager(*tokenizer_and_vocab, cache_limit_bytes=1 << 20)
    manager.compiler = _make_compiler(*tokenizer_and_vocab)
    rng = random.Random(1)
    small, huge = enum_schema(rng, 50), enum_schema(rng, 2000)  # ~100 KiB and ~5 MiB compiled
    assert compile_json(manager, small) is compile_json(manager, dict(small))
    assert compile_json(manager, huge) is not compile_json(manager, huge)
    assert 0 < manager.cache.size_bytes <= 1 << 20


def test_the_cache_bound_is_read_as_vllm_reads_it(monkeypatch):
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "64")
    assert cache_limit_mb() == 64
    monkeypatch.setenv("VLLM_XGRAMMAR_CACHE_MB", "lots")
    with pytest.raises(ValueError, match="VLLM_XGRAMMAR_CACHE_MB must be a whole number of MiB"):
        cache_limit_mb()
    monkeypatch.delenv("VLLM_XGRAMMAR_CACHE_MB")
    assert cache_limit_mb() == 512


def test_a_small_grammar_does_not_wait_behind_a_large_one(hf_model_and_tokenizer):
    """The large grammars' thread held busy (as by a grammar that compiles for seconds): a small
    request behind a large one still compiles, runs and finishes; the large one then follows."""
    model, tokenizer = hf_model_and_tokenizer
    engine = LLM(model, tokenizer=tokenizer, max_model_len=256, max_num_seqs=4,
                 kv_cache_memory=16 << 20).llm_engine
    manager = engine.structured_output_manager
    large = enum_schema(random.Random(2), 400)
    assert len(json.dumps(large)) > SMALL_GRAMMAR_CHARS
    gate = threading.Event()
    manager.executor_large.submit(gate.wait, 30)
    for req_id, constraint in (("large", {"json": large}), ("small", {"choice": ["x", "y"]})):
        params = SamplingParams(max_tokens=3, temperature=0.0,
                                structured_outputs=StructuredOutputsParams(**constraint))
        engine.add_request(Request(req_id, [1, 2, 3], params, eos_token_id=0))
    finished = set()

    def step_until(done) -> None:
        deadline = time.monotonic() + 30
        while not done() and time.monotonic() < deadline:
            finished.update(o.request_id for o in engine.step_fn()[0] if o.finish_reason)

    step_until(lambda: "small" in finished)
    assert finished == {"small"}
    gate.set()
    step_until(lambda: not engine.scheduler.has_requests())
    assert finished == {"small", "large"}
