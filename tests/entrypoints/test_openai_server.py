"""End to end: a real `python -m minicore serve` on the default model (one server for the module),
spoken to by the official openai SDK and by raw HTTP. Greedy answers equal the offline LLM's,
usage counts are right, stop strings cut the text, bad requests get OpenAI errors and leave the
server serving, a client that disconnects aborts its request (the KV cache empties, seen through
/metrics), and the metrics carry vLLM's names. The benchmark script runs against it once."""

import json
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import ServerProcess, run_python

from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

API_KEY = "test-key"
MODEL = "SmolLM2-135M-Instruct"
MAX_MODEL_LEN = 512
ENGINE_ARGS = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(64 << 20),
               "--max-num-seqs", "8"]
PROMPT = "The best way to learn a language is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--api-key", API_KEY, *ENGINE_ARGS) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    # No retries: a failure must show, not be hidden behind the SDK's backoff.
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"},
                      timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def offline(hf_model_and_tokenizer):
    model, tokenizer = hf_model_and_tokenizer
    return LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)


def _greedy(llm, prompt, max_tokens, **kwargs):
    params = SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)
    return llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]


def _metric(http, name: str, **labels) -> float:
    labels = {"model_name": MODEL, "engine": "0", **labels}
    want = sorted(f'{k}="{v}"' for k, v in labels.items())
    for line in http.get("/metrics").text.splitlines():
        if (line.startswith(name + "{")
                and sorted(line[len(name) + 1:line.index("}")].split(",")) == want):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _wait_until(predicate, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return predicate()


def test_models_and_version(http):
    models = http.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert models["data"][0]["max_model_len"] == MAX_MODEL_LEN
    assert http.get("/version").json()["version"]


def test_greedy_completion_equals_offline_llm(client, offline):
    expected = _greedy(offline, PROMPT, 24)
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == expected.finish_reason == "length"
    prompt_tokens = len(offline.get_tokenizer().encode(PROMPT, add_special_tokens=False))
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        prompt_tokens, 24, prompt_tokens + 24)


def test_streamed_completion_equals_offline_llm(client, offline):
    expected = _greedy(offline, PROMPT, 24)
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text_chunks = [c for c in chunks if c.choices]
    assert len(text_chunks) > 1  # streamed, not one lump
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].usage.completion_tokens == 24 and not chunks[-1].choices


def test_chat_equals_offline_llm_streamed_or_not(client, offline):
    expected = offline.chat(QUESTION, SamplingParams(max_tokens=32, temperature=0),
                            use_tqdm=False)[0]
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                         temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == expected.outputs[0].text
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"  # EOS
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)
    assert out.usage.completion_tokens == len(expected.outputs[0].token_ids)

    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_stop_string_cuts_the_text(client, offline):
    free = _greedy(offline, PROMPT, 40, ignore_eos=True).text
    stop = free.split()[6]  # a word well inside the text
    expected = free[:free.index(stop)]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                    stop=[stop])
    choice = out.choices[0]
    assert (choice.text, choice.finish_reason) == (expected, "stop")
    assert choice.model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                              temperature=0, stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_seeded_samples_are_reproducible(client):
    def sample():
        out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, n=2, seed=3,
                                        temperature=1.0, extra_body={"ignore_eos": True})
        assert [c.index for c in out.choices] == [0, 1]
        assert out.usage.completion_tokens == 24
        return [c.text for c in out.choices]

    assert sample() == sample()


BAD_REQUESTS = [
    # (id, endpoint, body (raw bytes: sent as is), status, error type, param, message part)
    ("bad-json", "/v1/completions", b'{"prompt": "hi",', 400, "BadRequestError", None,
     "invalid JSON"),
    ("max-tokens-0", "/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400,
     "BadRequestError", "max_tokens", "max_tokens must be >= 1"),
    ("max-tokens-negative", "/v1/completions", {"prompt": "hi", "max_tokens": -5}, 400,
     "BadRequestError", "max_tokens", "max_tokens must be >= 1"),
    ("temperature-negative", "/v1/chat/completions", {"messages": QUESTION, "temperature": -0.5},
     400, "BadRequestError", "temperature", "temperature must be >= 0"),
    ("top-p-zero", "/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "BadRequestError",
     "top_p", "top_p must be in (0, 1]"),
    ("top-p-above-one", "/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400,
     "BadRequestError", "top_p", "top_p must be in (0, 1]"),
    ("prompt-too-long", "/v1/completions", {"prompt": "hello " * 600, "max_tokens": 4}, 400,
     "BadRequestError", "prompt", f"maximum context length is {MAX_MODEL_LEN} tokens"),
    ("max-tokens-over-the-context", "/v1/completions",
     {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, 400, "BadRequestError", "max_tokens",
     f"max_tokens is too large: {MAX_MODEL_LEN + 1}"),
    ("max-completion-tokens-over-the-context", "/v1/chat/completions",
     {"messages": QUESTION, "max_completion_tokens": MAX_MODEL_LEN + 1}, 400,
     "BadRequestError", "max_completion_tokens", "max_completion_tokens is too large"),
    ("unknown-model", "/v1/completions", {"prompt": "hi", "model": "gpt-17"}, 404,
     "NotFoundError", "model", "The model `gpt-17` does not exist."),
    ("wrong-type", "/v1/completions", {"prompt": "hi", "max_tokens": "ten"}, 400,
     "BadRequestError", "max_tokens", "Input should be a valid integer"),
    ("wrong-type-messages", "/v1/chat/completions", {"messages": "hi"}, 400, "BadRequestError",
     "messages", "messages"),
    ("empty-prompt", "/v1/completions", {"prompt": ""}, 400, "BadRequestError", "prompt",
     "the prompt is empty"),
    ("empty-messages", "/v1/chat/completions", {"messages": []}, 400, "BadRequestError",
     "messages", "messages must not be empty"),
]


@pytest.mark.parametrize("endpoint, body, status, err_type, param, message",
                         [case[1:] for case in BAD_REQUESTS], ids=[c[0] for c in BAD_REQUESTS])
def test_bad_request_gets_an_openai_error_and_the_server_still_serves(
        http, endpoint, body, status, err_type, param, message):
    if isinstance(body, bytes):
        r = http.post(endpoint, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(endpoint, json=body)
    assert r.status_code == status
    error = r.json()["error"]
    assert set(r.json()) == {"error"}
    assert (error["type"], error["param"], error["code"]) == (err_type, param, status)
    assert message in error["message"]
    good = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert good.status_code == 200 and good.json()["usage"]["completion_tokens"] == 2


def test_max_tokens_past_the_context_is_clamped_to_what_the_prompt_leaves(http):
    """vLLM's get_max_tokens: a prompt of about 480 tokens and max_tokens 400 in a context of
    512 runs to the context's end (length), not a 400."""
    r = http.post("/v1/completions", json={"prompt": "hello " * 480, "max_tokens": 400,
                                           "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == MAX_MODEL_LEN
    assert r.json()["choices"][0]["finish_reason"] == "length"


def test_wrong_or_missing_api_key_is_401(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi"}, headers=headers)
        assert r.status_code == 401
        assert r.json() == {"error": {"message": "Incorrect API key provided.",
                                      "type": "AuthenticationError", "param": None, "code": 401}}
    assert httpx.get(server.url + "/health").status_code == 200  # not behind the key


def test_tokenize_counts_what_a_completion_counts(http, offline):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == offline.get_tokenizer().encode(PROMPT, add_special_tokens=False)
    assert http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == PROMPT
    chat = http.post("/tokenize", json={"messages": QUESTION}).json()
    usage = http.post("/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 1}
                      ).json()["usage"]
    assert chat["count"] == usage["prompt_tokens"]


def test_disconnect_mid_stream_aborts_the_request(server, http):
    aborted = _metric(http, "vllm:request_success_total", finished_reason="abort")
    body = {"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server.url, headers=http.headers, timeout=60) as c, \
            c.stream("POST", "/v1/completions", json=body) as r:
        events = 0
        for line in r.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
        assert _metric(http, "vllm:num_requests_running") == 1
        assert _metric(http, "vllm:kv_cache_usage_perc") > 0
    # The connection is closed: the engine request must be aborted long before its 400 tokens.
    assert _wait_until(lambda: _metric(http, "vllm:request_success_total",
                                       finished_reason="abort") == aborted + 1)
    assert _wait_until(lambda: _metric(http, "vllm:num_requests_running") == 0)
    assert _metric(http, "vllm:kv_cache_usage_perc") == 0.0


def test_disconnect_while_waiting_for_a_whole_response_aborts_it(server, http):
    aborted = _metric(http, "vllm:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", headers=http.headers, timeout=1.0,
                   json={"prompt": PROMPT, "max_tokens": 400, "ignore_eos": True})
    assert _wait_until(lambda: _metric(http, "vllm:request_success_total",
                                       finished_reason="abort") == aborted + 1)
    assert _wait_until(lambda: _metric(http, "vllm:num_requests_running") == 0)
    assert _metric(http, "vllm:kv_cache_usage_perc") == 0.0


def test_metrics_have_vllm_names_and_count_the_requests(client, http):
    # Its own requests (the suite's processes may split this module's tests between them): two
    # that end by length, two by EOS, the same prompt each time (the prefix cache hits).
    for _ in range(2):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=32,
                                       temperature=0)
    text = http.get("/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prefix_cache_queries_total", "prefix_cache_hits_total", "num_preemptions_total",
                 "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_bucket",
                 "request_prefill_time_seconds_bucket", "request_decode_time_seconds_bucket",
                 "request_prompt_tokens_bucket", "request_generation_tokens_bucket",
                 "request_max_num_generation_tokens_bucket", "iteration_tokens_total_bucket"):
        assert f'vllm:{name}{{' in text, name
    assert "\nprocess_resident_memory_bytes " in text
    assert _metric(http, "vllm:request_success_total", finished_reason="length") >= 2
    assert _metric(http, "vllm:request_success_total", finished_reason="stop") >= 2
    assert _metric(http, "vllm:prompt_tokens_total") > 0
    assert _metric(http, "vllm:time_to_first_token_seconds_count") >= 4
    assert _metric(http, "vllm:prefix_cache_hits_total") > 0


def test_bench_serve_drives_the_server(server, tmp_path):
    result = run_python(
        [sys.executable, REPO / "benchmarks" / "bench_serve.py", "--base-url", server.url,
         "--api-key", API_KEY, "--num-prompts", "4", "--random-input-len", "16",
         "--random-output-len", "4", "--max-concurrency", "2", "--result-dir", tmp_path])
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Successful requests:                     4" in result.stdout
    assert "Median TTFT (ms):" in result.stdout and "P99 E2EL (ms):" in result.stdout
    saved = json.loads((tmp_path / "bench_serve.json").read_text())
    assert (saved["completed"], saved["total_output_tokens"]) == (4, 16)
    assert saved["total_input_tokens"] == 4 * 16
