"""Speculative decoding end to end on the default model: with ngram drafts, greedy output equals
greedy output without them, token for token, offline (n > 1 and max_tokens too; with stop strings
the same text) and served (`serve --speculative-config`, whose /metrics counts the drafts, the
accepted tokens and the accepted tokens per position, and whose stats log prints the SpecDecoding
line)."""

import json
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import ServerProcess

from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 2}
MAX_MODEL_LEN, KV_CACHE_MEMORY = 512, 64 << 20
MAX_TOKENS = 32
# Prompts whose continuations repeat what came before, so that drafts are accepted often.
PROMPTS = [
    " ".join(f"Note {i}: the {w} costs {i * 7 % 50} coins."
             for i, w in enumerate(["apple", "lamp", "rope", "coat", "drum"] * 3)),
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\ndef",
    "Copy the text twice.\nText: The quick brown fox jumps over the lazy dog while the cat sleeps "
    "on the warm mat by the door.\nFirst copy: The quick brown fox jumps over the lazy dog while "
    "the cat sleeps on the warm mat by the door.\nSecond copy:",
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def make_llm(hf_model_and_tokenizer, **kwargs) -> LLM:
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN,
               kv_cache_memory=KV_CACHE_MEMORY, **kwargs)


@pytest.fixture(scope="module")
def plain(hf_model_and_tokenizer) -> LLM:
    return make_llm(hf_model_and_tokenizer)


@pytest.fixture(scope="module")
def drafted(hf_model_and_tokenizer) -> LLM:
    return make_llm(hf_model_and_tokenizer, speculative_config=SPEC)


def completions(llm: LLM, params, prompts=PROMPTS) -> list[list[tuple]]:
    """Per prompt, (token ids, text, finish reason, stop reason) of each of its completions."""
    return [[(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
            for o in llm.generate(prompts, params, use_tqdm=False)]


def test_offline_greedy_equals_greedy_without_drafts(plain, drafted):
    expected = completions(plain, GREEDY)
    assert all(len(c[0][0]) == MAX_TOKENS for c in expected)
    assert completions(drafted, GREEDY) == expected
    stats = drafted.llm_engine.scheduler.make_stats().spec_decoding_stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    assert sum(stats.num_accepted_tokens_per_pos) == stats.num_accepted_tokens


@pytest.mark.parametrize("params", [
    # Sampled with top_k 1 (greedy's n must be 1): drafts go through the random-sampling path,
    # where the target distribution is the argmax alone.
    SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=1, n=2, seed=0),
    # Drafts never carry a request past max_tokens (one per prompt).
    [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in (1, 5, 7)],
], ids=["n2", "max_tokens"])
def test_offline_n_and_max_tokens_as_without_drafts(plain, drafted, params):
    expected = completions(plain, params)
    assert completions(drafted, params) == expected
    if isinstance(params, list):
        assert [len(c[0][0]) for c in expected] == [1, 5, 7]


def test_offline_stop_strings_as_without_drafts(plain, drafted):
    # The notes' and the code's output stop part-way, where drafts are being accepted.
    params = [SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=["lamp"]),
              SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=["pow"],
                             include_stop_str_in_output=True),
              GREEDY]
    expected = completions(plain, params)
    assert [c[0][2:] for c in expected] == [("stop", "lamp"), ("stop", "pow"), ("length", None)]
    got = completions(drafted, params)
    assert [c[0][1:] for c in got] == [c[0][1:] for c in expected]
    # The text ends at the stop string; the token ids may go on with the tokens of the same step
    # after it, as vLLM's (its detokenizer checks stop strings once per step's tokens).
    for [(got_ids, *_)], [(expected_ids, *_)] in zip(got, expected):
        assert got_ids[:len(expected_ids)] == expected_ids


def spec_counters(metrics_text: str) -> dict[tuple[str, str | None], float]:
    return {(s.name, s.labels.get("position")): s.value
            for family in text_string_to_metric_families(metrics_text)
            for s in family.samples if "spec_decode" in s.name}


def test_served_greedy_equals_offline_without_drafts_and_metrics_count_the_drafts(plain):
    expected = [c[0][1] for c in completions(plain, GREEDY)]
    with ServerProcess("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory",
                       str(KV_CACHE_MEMORY), "--speculative-config", json.dumps(SPEC)) as server:
        with httpx.Client(base_url=server.url, timeout=120) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            response = http.post("/v1/completions", json={
                "model": model, "prompt": PROMPTS, "max_tokens": MAX_TOKENS, "temperature": 0})
            assert response.status_code == 200, response.text
            choices = sorted(response.json()["choices"], key=lambda c: c["index"])
            assert [c["text"] for c in choices] == expected
            counters = spec_counters(http.get("/metrics").text)
        drafts = counters["vllm:spec_decode_num_drafts_total", None]
        accepted = counters["vllm:spec_decode_num_accepted_tokens_total", None]
        assert drafts > 0 and accepted > 0
        assert accepted <= counters["vllm:spec_decode_num_draft_tokens_total", None] <= 3 * drafts
        per_pos = [counters["vllm:spec_decode_num_accepted_tokens_per_pos_total", str(p)]
                   for p in range(3)]
        assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
        # The stats line comes every 10 s.
        deadline = time.monotonic() + 12
        while "SpecDecoding metrics: Mean acceptance length" not in server.log():
            assert time.monotonic() < deadline, server.log()
            time.sleep(0.25)
