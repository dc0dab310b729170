"""Prefill/decode disaggregation end to end, on the real default model: a `python -m minicore
proxy` in front of one prefill and one decode `serve` process, NIXL between them.

- Greedy text through the proxy equals the offline LLM's (one instance) for a short prompt, a
  block-aligned one, a long one the prefill instance computes in chunks (64 tokens a step), and
  one whose prefix the decode instance has cached; completions and chat, streamed and not.
- After each request both instances' KV usage (/metrics) is back to zero, the prefill instance's
  well before its abort_request_timeout: the decode side's read notification freed its blocks.
- The prefill instance killed as the decode request arrives (the read fails at once, or mid-way)
  and killed after answering (restarted under the same engine id, it is handshaken afresh, and
  the handshake times out): the decode request recomputes, its text unchanged, and nothing hangs;
  the restarted instance, on the same ports, is used again.
- Every process exits 0 on SIGTERM.
The decode instance verifies ngram drafts (--speculative-config), as a vLLM deployment's decode
instances may: its greedy text must still be the one instance's, and it must have accepted some
(the prompts repeat themselves); the prefill instance, which samples one token, drafts nothing.
The same with async scheduling on both instances (the decode instance's drafts then proposed by
its runner), in a deployment of its own.
The tiny random DeepSeek-V3 (tests/model/moe_models.py), whose multi-head latent attention keeps
a one-entry cache (a latent row a token, one NIXL region a layer), in a deployment of its own:
the decode instance reads every prompt token but the last, its text is one instance's.
The three processes are shared by the module; only the kill tests restart the prefill instance.
Every wait is bounded.
"""

import json
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, engine_state, free_port

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "model"))
from moe_models import build_served_moe

from minicore.entrypoints.proxy import prefill_body
from minicore.llm import LLM
from minicore.sampling_params import SamplingParams

pytestmark = pytest.mark.model

MAX_MODEL_LEN = 1024
COMMON = ["--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory", str(256 << 20)]
MAX_TOKENS = 12
BLOCK_SIZE = 16
# Long enough that only the decode side's read notification can free the prefill side's blocks
# within FREED_WITHIN_S; the handshake timeout bounds the wait on a dead prefill instance.
ABORT_REQUEST_TIMEOUT_S = 60
HANDSHAKE_TIMEOUT_S = 2
FREED_WITHIN_S = 10
REQUEST_TIMEOUT_S = 90
SIGTERM_EXIT_S = 20
SPECULATIVE_CONFIG = json.dumps({"method": "ngram", "num_speculative_tokens": 3,
                                 "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def kv_transfer_config(role: str, side_channel_port: int, **fields) -> str:
    return json.dumps({"kv_connector": "NixlConnector", "kv_role": role, **fields,
                       "kv_connector_extra_config": {
                           "side_channel_port": side_channel_port,
                           "abort_request_timeout": ABORT_REQUEST_TIMEOUT_S,
                           "handshake_timeout": HANDSHAKE_TIMEOUT_S}})


class ProxyProcess(ServerProcess):
    def __init__(self, prefill_url: str, decode_url: str):
        super().__init__()
        self.args = [sys.executable, "-m", "minicore", "proxy", "--port", str(self.port),
                     "--prefill", prefill_url, "--decode", decode_url]


class Deployment:
    """The three processes; the prefill instance can be killed and restarted on its ports."""

    def __init__(self, *engine_args: str):
        self.engine_args = [*COMMON, *engine_args]
        self.prefill_port, self.prefill_side_port = free_port(), free_port()
        self.prefill = self._prefill_process()
        self.decode = ServerProcess(*self.engine_args, "--kv-transfer-config",
                                    kv_transfer_config("kv_consumer", free_port()),
                                    "--speculative-config", SPECULATIVE_CONFIG)
        with ThreadPoolExecutor(2) as pool:  # the two model loads overlap
            list(pool.map(ServerProcess.__enter__, (self.prefill, self.decode)))
        self.proxy = ProxyProcess(self.prefill.url, self.decode.url).__enter__()
        self.model = httpx.get(self.decode.url + "/v1/models").json()["data"][0]["id"]

    def _prefill_process(self) -> ServerProcess:
        # Chunked: the long prompt's prefill takes several steps. One engine id across restarts:
        # the decode side must forget a dead peer, or it would read from its stale agent.
        return ServerProcess(*self.engine_args, "--max-num-batched-tokens", "64",
                             "--kv-transfer-config",
                             kv_transfer_config("kv_producer", self.prefill_side_port,
                                                engine_id="e2e-prefill"),
                             port=self.prefill_port)

    def kill_prefill(self) -> None:
        os.killpg(self.prefill.proc.pid, signal.SIGKILL)
        self.prefill.__exit__(None, None, None)

    def restart_prefill(self) -> None:
        self.prefill = self._prefill_process().__enter__()

    def close(self) -> None:
        for server in (self.proxy, self.decode, self.prefill):
            server.__exit__(None, None, None)


@pytest.fixture(scope="module")
def deployment():
    d = Deployment()
    try:
        yield d
    finally:
        d.close()


@pytest.fixture(scope="module")
def prompts(hf_model_and_tokenizer):
    """Token-id prompts (exact lengths): short, block-aligned, long, and two sharing a prefix."""
    _, tokenizer = hf_model_and_tokenizer
    text = " ".join(f"Note {i}: the {w} costs {i * 7 % 50} coins and weighs {i * 13 % 90} grams."
                    for i, w in enumerate(["apple", "lamp", "rope", "coat", "drum"] * 40))
    ids = tokenizer(text).input_ids
    assert len(ids) > 2100
    prefix = ids[400:400 + 6 * BLOCK_SIZE]
    return {"short": tokenizer("The capital of France is").input_ids,
            "aligned": ids[:2 * BLOCK_SIZE],
            "long": ids[:300],
            "seed": prefix + ids[100:120],
            "shared": prefix + ids[200:230],
            # Unseen by either instance before the kill tests.
            "very_long": ids[1000:1800],
            "unseen": ids[2000:2048]}


CHAT = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def reference(hf_model_and_tokenizer, prompts):
    """One instance's greedy answers: the offline LLM's text by prompt name (and "chat")."""
    model, tokenizer = hf_model_and_tokenizer
    llm = LLM(model, tokenizer=tokenizer, max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    names = list(prompts)
    outputs = llm.generate([prompts[n] for n in names], params, use_tqdm=False)
    texts = {n: o.outputs[0].text for n, o in zip(names, outputs)}
    texts["chat"] = llm.chat(CHAT, params, use_tqdm=False)[0].outputs[0].text
    return texts


def complete(url: str, prompt: list[int], **extra) -> dict:
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, **extra}
    response = httpx.post(url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return response.json()


def stream_text(url: str, path: str, body: dict) -> str:
    """The text of a streamed answer, from its SSE chunks."""
    parts = []
    with httpx.stream("POST", url + path, json={**body, "stream": True},
                      timeout=REQUEST_TIMEOUT_S) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choice = json.loads(line[6:])["choices"][0]
                parts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(parts)


def metric(server: ServerProcess, model: str, name: str) -> float:
    for line in httpx.get(server.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{") and f'model_name="{model}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def assert_kv_freed(d: Deployment, *servers: ServerProcess) -> None:
    """Every KV block of these instances is free again within FREED_WITHIN_S."""
    deadline = time.monotonic() + FREED_WITHIN_S
    for server in servers or (d.prefill, d.decode):
        with httpx.Client(base_url=server.url, timeout=10) as http:
            while (usage := engine_state(http, d.model)["vllm:kv_cache_usage_perc"]) != 0:
                assert time.monotonic() < deadline, f"{server.url}: KV usage stays at {usage}"
                time.sleep(0.2)


@pytest.mark.parametrize("name", ["short", "aligned", "long"])
def test_completion_through_proxy_matches_one_instance(deployment, prompts, reference, name):
    body = complete(deployment.proxy.url, prompts[name])
    assert body["choices"][0]["text"] == reference[name]
    assert body["usage"]["prompt_tokens"] == len(prompts[name])
    assert_kv_freed(deployment)


def test_in_bfloat16_with_batch_invariance_it_matches_one_instance_too(prompts):
    """The float32 deployment above matches one instance because float32 rows barely depend on
    the batch; in bfloat16 they do (a prefill chunked at 64 and a decode verifying drafts compute
    another order), unless --batch-invariant fixes every order."""
    llm = LLM(dtype="bfloat16", batch_invariant=True, max_model_len=MAX_MODEL_LEN,
              kv_cache_memory=64 << 20)
    names = ["short", "aligned", "long"]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    offline = [(o.text, [lp[t].logprob for lp, t in zip(o.logprobs, o.token_ids)]) for o in (
        r.outputs[0] for r in llm.generate([prompts[n] for n in names], params, use_tqdm=False))]
    d = Deployment("--dtype", "bfloat16", "--batch-invariant")
    try:
        served = [complete(d.proxy.url, prompts[n], logprobs=1)["choices"][0] for n in names]
    finally:
        d.close()
    assert [(c["text"], c["logprobs"]["token_logprobs"]) for c in served] == offline


def test_the_decode_instance_accepts_drafts(deployment, prompts, reference):
    d = deployment
    accepted = metric(d.decode, d.model, "vllm:spec_decode_num_accepted_tokens_total")
    assert complete(d.proxy.url, prompts["long"])["choices"][0]["text"] == reference["long"]
    assert metric(d.decode, d.model, "vllm:spec_decode_num_accepted_tokens_total") > accepted


def test_streamed_completion_and_chat_through_proxy(deployment, prompts, reference):
    url = deployment.proxy.url
    assert stream_text(url, "/v1/completions", {
        "prompt": prompts["aligned"], "max_tokens": MAX_TOKENS, "temperature": 0}
    ) == reference["aligned"]
    chat = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
    response = httpx.post(url + "/v1/chat/completions", json=chat, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"] == reference["chat"]
    assert stream_text(url, "/v1/chat/completions", chat) == reference["chat"]
    assert_kv_freed(deployment)


def test_with_async_scheduling_on_both_instances(prompts, reference):
    """Both instances schedule each step while the one before runs (the decode instance's drafts
    then proposed by its runner): the prefill instance's held blocks are freed by the read's
    notification although its steps overlap, the decode instance's read lands while a step is in
    flight, and the text is the one instance's."""
    d = Deployment("--async-scheduling")
    try:
        for server in (d.prefill, d.decode):
            assert "async_scheduling=True" in server.log_path.read_text()
        for name in ("short", "aligned", "long"):
            assert complete(d.proxy.url, prompts[name])["choices"][0]["text"] == reference[name]
            assert_kv_freed(d)
        chat = {"messages": CHAT, "max_tokens": MAX_TOKENS, "temperature": 0}
        assert stream_text(d.proxy.url, "/v1/chat/completions", chat) == reference["chat"]
        assert metric(d.decode, d.model, "vllm:spec_decode_num_accepted_tokens_total") > 0
        assert_kv_freed(d)
    finally:
        d.close()


def test_decode_side_prefix_hit_reads_only_the_rest(deployment, prompts, reference):
    d = deployment
    assert complete(d.decode.url, prompts["seed"])["choices"][0]["text"] == reference["seed"]
    hits = metric(d.decode, d.model, "vllm:prefix_cache_hits_total")
    assert complete(d.proxy.url, prompts["shared"])["choices"][0]["text"] == reference["shared"]
    # The shared prefix's six blocks came from the decode instance's own cache.
    assert metric(d.decode, d.model, "vllm:prefix_cache_hits_total") - hits >= 6 * BLOCK_SIZE
    assert_kv_freed(d)


def _prefill_answer(d: Deployment, prompt: list[int]) -> dict:
    """What the proxy gets from the prefill instance: the kv_transfer_params to read with."""
    body = prefill_body({"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0})
    response = httpx.post(d.prefill.url + "/v1/completions", json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 200, response.text
    params = response.json()["kv_transfer_params"]
    assert params["do_remote_prefill"] and params["remote_port"] == d.prefill_side_port
    return params


def _read_failures(d: Deployment) -> list[str]:
    return [line for line in d.decode.log_path.read_text(errors="replace").splitlines()
            if "KV read for request" in line]


def test_prefill_killed_as_decode_reads(deployment, prompts, reference):
    """The decode instance has read from this prefill instance before: its READ from the dead
    peer fails (at once or mid-way: 50 blocks take tens of ms), the request recomputes, and the
    dead peer is forgotten (the next test depends on it)."""
    d = deployment
    params = _prefill_answer(d, prompts["very_long"])
    failures = len(_read_failures(d))
    with ThreadPoolExecutor(1) as pool:
        decoded = pool.submit(complete, d.decode.url, prompts["very_long"],
                              kv_transfer_params=params)
        d.kill_prefill()
        assert decoded.result(REQUEST_TIMEOUT_S)["choices"][0]["text"] == reference["very_long"]
    assert len(_read_failures(d)) == failures + 1, d.decode.log()
    assert_kv_freed(d, d.decode)
    d.restart_prefill()


def test_prefill_killed_after_answering_then_restarted(deployment, prompts, reference):
    """A prefill instance dies after answering, before the decode side reads: with the dead peer
    forgotten, the decode side handshakes again (the restarted instance has the same engine id),
    gets no answer within handshake_timeout, and recomputes; or, where the read comes before the
    transport has noticed the death (seen with faster steps under load), the transport fails that
    read at once and it recomputes all the same. Restarted once more, the prefill instance is
    used again: read (its blocks freed by the notification), with no failure."""
    d = deployment
    params = _prefill_answer(d, prompts["unseen"])
    failures = len(_read_failures(d))
    d.kill_prefill()
    body = complete(d.decode.url, prompts["unseen"], kv_transfer_params=params)
    assert body["choices"][0]["text"] == reference["unseen"]
    assert len(new := _read_failures(d)[failures:]) == 1, d.decode.log()
    assert "no handshake answer" in new[0] or "NIXL_ERR_REMOTE_DISCONNECT" in new[0], new
    assert_kv_freed(d, d.decode)
    d.restart_prefill()
    assert complete(d.proxy.url, prompts["short"])["choices"][0]["text"] == reference["short"]
    assert complete(d.proxy.url, prompts["long"])["choices"][0]["text"] == reference["long"]
    assert len(_read_failures(d)) == failures + 1, d.decode.log()
    assert_kv_freed(d)


def test_deepseek_latent_cache_travels_through_the_proxy(tmp_path, prompts):
    """The latent blocks travel: the decode instance, which has none of these prompts' blocks,
    reads every prompt token but the last (its cached tokens), no read fails (a failed one would
    recompute), and its greedy text is one instance's (a half-read block changes it); the read's
    notification frees the prefill side's blocks."""
    model_dir = str(build_served_moe("deepseek_v3", tmp_path / "deepseek_v3"))
    names = ["aligned", "long"]
    llm = LLM(model_dir, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory=64 << 20)
    reference = [o.outputs[0].text for o in llm.generate(
        [prompts[n] for n in names], SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
        use_tqdm=False)]
    d = Deployment("--model", model_dir, "--enable-prompt-tokens-details")
    try:
        for name, text in zip(names, reference):
            body = complete(d.proxy.url, prompts[name])
            assert body["choices"][0]["text"] == text
            assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == len(
                prompts[name]) - 1
            assert_kv_freed(d)
        assert _read_failures(d) == []
    finally:
        d.close()


def test_every_process_exits_0_on_sigterm(deployment):
    for server in (deployment.proxy, deployment.decode, deployment.prefill):
        server.proc.send_signal(signal.SIGTERM)
    for server in (deployment.proxy, deployment.decode, deployment.prefill):
        assert server.proc.wait(SIGTERM_EXIT_S) == 0, server.log()
