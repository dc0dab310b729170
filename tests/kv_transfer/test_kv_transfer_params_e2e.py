"""Issue 24 end to end: a real `python -m minicore serve` with a NixlConnector (kv_both) takes 30
malformed kv_transfer_params in a row, each a 400 with an OpenAI error body naming the key (once,
one of them killed the engine and every later request got a 503); its engine process is the same
afterwards, it serves a normal request, and a well-formed decode request whose prefill instance
does not exist (its read fails at the handshake) is computed here instead; then nothing runs or
waits and the KV cache is empty; under kv_load_failure_policy "fail" that request is a 500
instead. Real model (NixlConnector needs a KV cache, which the simulated runner has not); every
wait bounded."""

import json
import random
import time

import httpx
import pytest
from server_helpers import (
    ServerProcess,
    check_openai_error,
    engine_state,
    free_port,
    post_json,
)
from test_kv_transfer_params_checks import BAD, VALID

pytestmark = pytest.mark.model

BLOCK_SIZE = 16
# 40 tokens: 3 blocks of 16, so that VALID's three remote blocks fit and four do not.
PROMPT = list(range(1000, 1040))
# Long enough for three blocks whatever the chat template adds.
CHAT = [{"role": "user", "content": "Count the apples: " + "apple " * 60}]
REQUEST_TIMEOUT_S = 60
SETTLE_S = 10
# 30 of the shapes, spread over every key; block-count cases only with the fixed-length prompt.
MALFORMED = random.Random(24).sample(BAD, 30)


def kv_transfer_config(**config) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both",
                       "kv_connector_extra_config": {"side_channel_port": free_port(),
                                                     "handshake_timeout": 1}, **config})


def serve(**config) -> ServerProcess:
    return ServerProcess("--max-model-len", "256", "--kv-cache-memory", str(32 << 20),
                         "--block-size", str(BLOCK_SIZE),
                         "--kv-transfer-config", kv_transfer_config(**config))


@pytest.fixture(scope="module")
def server():
    with serve() as server:
        yield server


def wait_until_idle(http: httpx.Client, model: str) -> None:
    deadline = time.monotonic() + SETTLE_S
    while (state := engine_state(http, model)) != {"vllm:num_requests_running": 0,
                                                   "vllm:num_requests_waiting": 0,
                                                   "vllm:kv_cache_usage_perc": 0}:
        assert time.monotonic() < deadline, state
        time.sleep(0.2)


def body_for(i: int, params: dict, key: str) -> tuple[str, dict]:
    if i % 3 == 0 and key != "remote_block_ids":
        return "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                        "kv_transfer_params": params}
    return "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "kv_transfer_params": params}


def test_malformed_params_are_refused_and_the_engine_serves_on(server):
    with httpx.Client(base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        engine_pid = server.engine_process().pid
        for i, (params, key) in enumerate(MALFORMED):
            path, body = body_for(i, params, key)
            error = check_openai_error(post_json(http, path, body), 400)
            assert error["param"] == "kv_transfer_params", error
            assert f"kv_transfer_params.{key}" in error["message"], (key, error)
        assert server.engine_process().pid == engine_pid
        assert http.get("/health").status_code == 200

        plain = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0}
        answer = http.post("/v1/completions", json=plain)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["finish_reason"] == "length"
        # Well formed, but no prefill instance listens there: the read fails, the prompt is
        # computed here, and the answer is the same.
        dead_peer = dict(VALID, remote_port=free_port())
        decoded = http.post("/v1/completions", json={**plain, "kv_transfer_params": dead_peer})
        assert decoded.status_code == 200, decoded.text
        assert decoded.json()["choices"][0]["text"] == answer.json()["choices"][0]["text"]
        assert "no handshake answer" in server.log()

        wait_until_idle(http, model)
        assert server.engine_process().pid == engine_pid


def test_with_the_fail_policy_a_failed_read_is_a_server_error_and_the_engine_serves_on():
    """kv_load_failure_policy "fail": the same dead peer's request ends with a 500 (streamed: an
    error event, then [DONE]) instead of being computed here; nothing is left behind."""
    dead_peer = dict(VALID, remote_port=free_port())
    body = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0, "kv_transfer_params": dead_peer}
    with serve(kv_load_failure_policy="fail") as server, httpx.Client(
            base_url=server.url, timeout=REQUEST_TIMEOUT_S) as http:
        model = http.get("/v1/models").json()["data"][0]["id"]
        error = check_openai_error(post_json(http, "/v1/completions", body), 500)
        assert "kv_load_failure_policy is 'fail'" in error["message"], error
        streamed = http.post("/v1/completions", json={**body, "stream": True}).text
        assert "kv_load_failure_policy is 'fail'" in streamed and '"code":500' in streamed
        assert streamed.rstrip().endswith("data: [DONE]"), streamed
        plain = http.post("/v1/completions", json={**body, "kv_transfer_params": None})
        assert plain.status_code == 200, plain.text
        assert http.get("/health").status_code == 200
        wait_until_idle(http, model)
