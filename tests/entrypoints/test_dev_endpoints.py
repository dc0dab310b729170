"""vLLM's development and RL endpoints (VLLM_SERVER_DEV_MODE=1) on a real server: each answers
as vLLM's, moves the engines' state (and the engine_sleep_state gauge) as it says, refuses bad
arguments and caller mistakes (a runner method the engine owns through collective_rpc, a weight
update not started) with a 400 OpenAI error body and changes nothing then; with --api-key each
needs the key; without the switch none is mounted. The RL weight sync example runs against a
DP=2 server on the real model."""

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from server_helpers import ServerProcess, run_python

from minicore.ports import free_port_pair

ROOT = Path(__file__).resolve().parents[2]


def gauge(http: httpx.Client) -> dict[str, float]:
    """engine_sleep_state of engine 0, by state."""
    values = {}
    for line in http.get("/metrics").text.splitlines():
        if line.startswith("vllm:engine_sleep_state{") and 'engine="0"' in line:
            state = line.split('sleep_state="')[1].split('"')[0]
            values[state] = float(line.rsplit(" ", 1)[1])
    return values


def complete(http: httpx.Client) -> httpx.Response:
    model = http.get("/v1/models").json()["data"][0]["id"]
    return http.post("/v1/completions", json={"model": model, "prompt": [5, 6, 7],
                                              "max_tokens": 4})


DEV_ROUTES = [("post", "/sleep"), ("post", "/wake_up"), ("get", "/is_sleeping"),
              ("post", "/pause"), ("post", "/resume"), ("get", "/is_paused"),
              ("post", "/collective_rpc"), ("post", "/start_weight_update"),
              ("post", "/update_weights"), ("post", "/finish_weight_update"),
              ("get", "/weight_info"), ("post", "/init_weight_transfer_engine"),
              ("post", "/shutdown_weight_transfer_engine"), ("post", "/update_weight_version"),
              ("get", "/get_world_size"), ("post", "/abort_requests"), ("post", "/weight_checker"),
              ("get", "/server_info"), ("post", "/release_kv_cache_memory"),
              ("post", "/start_draft_weight_update")]
API_KEY = "dev-secret"


def test_the_dev_endpoints_drive_the_engine(monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with ServerProcess("--runner", "simulated", "--api-key", API_KEY,
                       "--simulated-cost", '{"step_s": 0.01}') as server, \
            httpx.Client(base_url=server.url, timeout=60,
                         headers={"Authorization": f"Bearer {API_KEY}"}) as http:
        # --api-key guards every dev route (vLLM leaves them open): no key or a wrong one is a
        # 401 that reaches no engine.
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            for method, path in DEV_ROUTES:
                response = httpx.request(method.upper(), server.url + path, headers=headers,
                                         json={"method": "sleep", "args": [1]})
                assert response.status_code == 401, (path, response.text)
                assert response.json()["error"]["code"] == 401
        assert httpx.get(server.url + "/health").status_code == 200  # open, as vLLM's

        assert gauge(http) == {"awake": 1, "weights_offloaded": 0, "discard_all": 0}
        # vLLM 0.32's answers, which an RL client's .json() reads.
        assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping",
                                                                   "level": 1}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert gauge(http) == {"awake": 0, "weights_offloaded": 1, "discard_all": 0}
        # Asleep already at that level: idempotent, as vLLM's; another level is a 400.
        assert http.post("/sleep", params={"level": 1}).status_code == 200
        assert http.post("/sleep", params={"level": 2}).status_code == 400
        assert http.post("/resume").status_code == 400  # asleep: wake_up resumes
        # vLLM's answer says whether all is awake now: not until the KV cache is back too.
        assert http.post("/wake_up", params={"tags": "weights"}).json() == {
            "status": "sleeping", "tags": ["weights"]}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {
            "status": "awake", "tags": ["kv_cache"]}
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert gauge(http)["awake"] == 1
        # Level 0 only pauses scheduling; the "scheduling" tag resumes it, as does any wake_up
        # with all the memory resident (vLLM's rule).
        for tag in ("scheduling", "weights"):
            assert http.post("/sleep", params={"level": 0}).json() == {"status": "sleeping",
                                                                       "level": 0}
            assert http.get("/is_sleeping").json() == {"is_sleeping": True}
            assert gauge(http)["awake"] == 1  # no memory released
            assert http.post("/wake_up", params={"tags": tag}).json() == {
                "status": "awake", "tags": [tag]}
            assert http.get("/is_sleeping").json() == {"is_sleeping": False}
            assert complete(http).status_code == 200
        # The KV cache's memory freed once a pause has completed with no request kept (vLLM
        # 0.32), and brought back by waking the kv_cache tag.
        assert http.post("/release_kv_cache_memory").status_code == 400  # not paused
        with ThreadPoolExecutor(1) as pool:
            stream = pool.submit(http.post, "/v1/completions", json={
                "model": http.get("/v1/models").json()["data"][0]["id"], "prompt": [5, 6],
                "max_tokens": 100, "ignore_eos": True})
            time.sleep(0.3)
            assert http.post("/pause", params={"mode": "keep"}).status_code == 200
            kept = http.post("/release_kv_cache_memory")
            assert kept.status_code == 400 and "no request kept" in kept.json()["error"]["message"]
            assert http.post("/resume").status_code == 200
            assert stream.result().json()["choices"][0]["finish_reason"] == "length"
        assert http.post("/sleep", params={"level": 0}).status_code == 200
        assert http.post("/release_kv_cache_memory").json() == {"status": "kv_cache_released"}
        assert http.post("/resume").status_code == 400  # its memory is gone: wake_up resumes
        assert http.post("/wake_up", params={"tags": "weights"}).json() == {
            "status": "sleeping", "tags": ["weights"]}
        assert http.post("/wake_up", params={"tags": "kv_cache"}).json() == {
            "status": "awake", "tags": ["kv_cache"]}
        assert complete(http).status_code == 200
        assert 'operation="release_kv_cache_memory"' in http.get("/metrics").text

        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.get("/is_paused").json() == {"is_paused": True}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}  # vLLM 0.32 counts it
        assert http.post("/resume").json() == {"status": "resumed"}
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.post("/reset_prefix_cache", params={
            "reset_running_requests": "true", "reset_external": "true"}).json() == {
            "success": True}

        rpc = http.post("/collective_rpc", json={"method": "check_can_sleep", "args": [1]})
        assert rpc.json() == {"results": [None]}
        # vLLM's /server_info: the config as text or JSON, the environment's switches.
        info = http.get("/server_info").json()
        assert "EngineConfig(" in info["vllm_config"] and info["vllm_env"][
            "VLLM_SERVER_DEV_MODE"] == "1" and info["system_env"]["minicore"]
        as_json = http.get("/server_info", params={"config_format": "json"}).json()
        assert as_json["vllm_config"]["model_config"]["runner"] == "simulated"
        assert http.post("/start_weight_update").json() == {"message": "Weight update started"}
        assert http.post("/finish_weight_update", json={"weight_version": "step-3"}).json() == {
            "message": "Weight update finished"}
        assert http.get("/weight_info").json() == {"weight_version": "step-3"}
        draft = http.post("/start_draft_weight_update")  # vLLM's message; ngram has no weights
        assert draft.status_code == 400 and "no draft model is configured" in draft.text

        for method, path, kwargs in (
                ("post", "/sleep", {"params": {"level": 3}}),
                ("post", "/sleep", {"params": {"mode": "later"}}),
                ("post", "/wake_up", {"params": {"tags": "optimizer"}}),
                ("post", "/pause", {"params": {"mode": "later"}}),
                ("post", "/collective_rpc", {"json": {"args": [1]}}),
                ("post", "/update_weights", {"json": {"update_info": {"path": "/no/such/file"}}}),
                ("post", "/update_weights", {"json": {}})):
            response = getattr(http, method)(path, **kwargs)
            assert response.status_code == 400, (path, kwargs, response.text)
            assert response.json()["error"]["code"] == 400
        for method in ("_update_states", "no_such_method"):
            rpc = http.post("/collective_rpc", json={"method": method})
            assert rpc.status_code == 400 and "no public method" in rpc.json()["error"]["message"]
        # The runner methods whose effects the engine keeps track of are refused by name, so
        # that no RPC frees the KV cache or weights under a running batch.
        for method, args in (("sleep", [1]), ("wake_up", [["weights"], 1]),
                             ("init_kv_cache", []), ("load_weights", [str(tmp_path)]),
                             ("execute_dummy_batch", [])):
            rpc = http.post("/collective_rpc", json={"method": method, "args": args})
            assert rpc.status_code == 400, (method, rpc.text)
            assert f"{method!r} changes state the engine keeps" in rpc.json()["error"]["message"]
        # A wake_up sent while a sleep (mode "wait") still waits for a request calls the sleep
        # off: the later call wins, and the engine serves on.
        with ThreadPoolExecutor(2) as pool:
            stream = pool.submit(http.post, "/v1/completions", json={
                "model": http.get("/v1/models").json()["data"][0]["id"], "prompt": [5, 6],
                "max_tokens": 150, "ignore_eos": True})
            time.sleep(0.3)
            sleeping = pool.submit(http.post, "/sleep", params={"level": 1, "mode": "wait"})
            time.sleep(0.3)
            assert not sleeping.done()
            assert http.post("/wake_up").status_code == 200
            assert sleeping.result().status_code == 200
            assert stream.result().json()["choices"][0]["finish_reason"] == "length"
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert complete(http).status_code == 200
        # A weight update's steps out of order are the caller's mistake.
        weights = tmp_path / "model.safetensors"
        weights.write_bytes(b"")
        response = http.post("/update_weights", json={"update_info": {"path": str(weights)}})
        assert response.status_code == 400, response.text
        assert "start_weight_update first" in response.json()["error"]["message"]
        # Nothing above left the engine paused or asleep.
        assert http.get("/is_paused").json() == {"is_paused": False}
        assert complete(http).status_code == 200


def test_without_dev_mode_no_dev_endpoint_is_mounted(monkeypatch):
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    with ServerProcess("--runner", "simulated") as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        for method, path in DEV_ROUTES:
            assert http.request(method.upper(), path).status_code == 404, path


def run_example(*args: str) -> str:
    result = run_python([sys.executable, ROOT / "examples" / "rl_weight_sync.py", *args],
                        timeout=600)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "weight sync: OK" in result.stdout
    return result.stdout


@pytest.mark.model
def test_rl_weight_sync_example_offline():
    assert run_example().count("equals transformers with the new weights") == 3


@pytest.mark.model
def test_rl_weight_sync_example_against_a_dp2_server(monkeypatch):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    with ServerProcess("--data-parallel-size", "2", "--max-model-len", "512",
                       "--data-parallel-rpc-port", str(free_port_pair()),
                       "--kv-cache-memory", str(64 << 20)) as server:
        out = run_example("--base-url", server.url)
    assert out.count("equals transformers with the new weights") == 3
    # Through the weight-update calls, which every rank runs (collective_rpc may not load).
    assert '/update_weights {"message":"Weights updated"}' in out
