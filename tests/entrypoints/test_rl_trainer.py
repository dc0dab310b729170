"""What an RL trainer does to a served DP=2 engine (VLLM_SERVER_DEV_MODE=1), with vLLM 0.32's
request shapes, each reply read as vLLM's: get_world_size; init_weight_transfer_engine, then three
weight updates broadcast from this process over the gloo group (minicore/dp/weight_transfer.py):
both ranks' greedy answers change with the weights and come back with the first weights, as the
weight checker's checksums do;
update_weight_version; abort_requests by response id; a level-1 sleep with a request in flight
and a wake by tags; pause with mode keep and resume; the operations' duration metrics. Default
model, float32."""

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch
from server_helpers import ServerProcess

from minicore.dp.weight_transfer import trainer_init
from minicore.ports import free_port, free_port_pair

pytestmark = pytest.mark.model

NAME = "model.norm.weight"
PROMPT = "The capital of France is"


def answers(http: httpx.Client) -> list[str]:
    """Each DP rank's greedy answer (vLLM's X-data-parallel-rank header picks the rank)."""
    return [http.post("/v1/completions", headers={"X-data-parallel-rank": str(rank)}, json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0}).json()["choices"][0]["text"]
        for rank in range(2)]


def perturbed(weight: torch.Tensor, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return weight * (1 + 0.5 * torch.randn(weight.shape, generator=generator))


def test_an_rl_trainer_drives_a_dp2_server(monkeypatch, hf_model_and_tokenizer):
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    original = dict(hf_model_and_tokenizer[0].named_parameters())[NAME].detach().clone()
    with ServerProcess("--dtype", "float32", "--data-parallel-size", "2", "--max-model-len",
                       "512", "--data-parallel-rpc-port", str(free_port_pair()),
                       "--kv-cache-memory", str(64 << 20)) as server, \
            httpx.Client(base_url=server.url, timeout=120) as http, ThreadPoolExecutor(2) as pool:
        assert http.get("/get_world_size").json() == {"world_size": 2}
        assert http.get("/get_world_size", params={"include_dp": "false"}).json() == {
            "world_size": 1}
        first = answers(http)
        assert first[0] == first[1]
        baseline = http.post("/weight_checker", json={"action": "checksum"}).json()["checksums"]
        assert len(baseline) == 2 * len(dict(hf_model_and_tokenizer[0].named_parameters()))

        init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                     "rank_offset": 1, "world_size": 3}
        assert http.post("/init_weight_transfer_engine", json={"init_info": init_info}).json(
            ) == {"message": "Weight transfer initialized"}
        # The engines join on threads of their own: they serve (their DP ranks stepping together)
        # while the trainer has not joined yet.
        assert answers(http) == first
        group = trainer_init(init_info)

        def update(tensor: torch.Tensor, version: str) -> list[str]:
            named = [(NAME, tensor)]
            for path in ("/pause", "/start_weight_update"):
                http.post(path, params={"mode": "keep"}).raise_for_status()
            posted = pool.submit(http.post, "/update_weights",
                                 json={"update_info": group.update_info(named)})
            group.send(named)
            assert posted.result().json() == {"message": "Weights updated"}
            http.post("/finish_weight_update", json={"weight_version": version})
            http.post("/reset_prefix_cache").raise_for_status()
            assert http.post("/resume").json() == {"status": "resumed"}
            assert http.get("/weight_info").json() == {"weight_version": version}
            return answers(http)

        second = update(perturbed(original, 1), "step-1")
        # vLLM's weight checker: the update changed that tensor on both ranks, and nothing else.
        assert http.post("/weight_checker", json={"action": "compare", "baseline": baseline}
                         ).json() == {"match": False, "mismatches": [
                             f"dp{rank}:pp0:pcp0:tp0:{NAME}" for rank in range(2)]}
        third = update(perturbed(original, 2), "step-2")
        assert second[0] == second[1] != first[0]
        assert third[0] == third[1] not in (first[0], second[0])
        assert update(original, "step-3") == first
        assert http.post("/weight_checker", json={"action": "compare", "baseline": baseline}
                         ).json() == {"match": True, "mismatches": []}
        assert http.post("/update_weight_version", json={"new_version": "v4"}).json() == {
            "success": True, "new_version": "v4"}
        assert http.get("/weight_info").json() == {"weight_version": "v4"}
        assert http.post("/shutdown_weight_transfer_engine").json() == {
            "message": "Weight transfer shut down"}

        # abort_requests, by the id of the response being streamed.
        stream_id, finish = streamed_until_aborted(http, pool)
        assert http.post("/abort_requests", json={"request_ids": [stream_id]}).json() == {
            "status": "aborted", "aborted": 1}
        assert finish.result(timeout=60) == "abort"

        # A level-1 sleep with a request in flight (mode abort ends it), woken tag by tag.
        _, finish = streamed_until_aborted(http, pool)
        assert http.post("/sleep", params={"level": 1}).json() == {"status": "sleeping",
                                                                   "level": 1}
        assert finish.result(timeout=60) == "abort"
        for tags, status in ((["weights"], "sleeping"), (["kv_cache"], "awake")):
            assert http.post("/wake_up", params={"tags": tags}).json() == {"status": status,
                                                                         "tags": tags}
        assert http.get("/is_sleeping").json() == {"is_sleeping": False}
        # Pause keep freezes a request in flight; resume lets it finish.
        stream_id, finish = streamed_until_aborted(http, pool)
        assert http.post("/pause", params={"mode": "keep"}).json() == {"status": "paused"}
        assert http.get("/is_sleeping").json() == {"is_sleeping": True}
        assert http.post("/resume").json() == {"status": "resumed"}
        assert finish.result(timeout=60) == "length"
        assert answers(http) == first
        # vLLM's operation metrics: three updates, one sleep, two wakes.
        metrics = http.get("/metrics").text
        for name, operation, count in (("rl_weight_update", "update", 3),
                                       ("rl_weight_update", "init", 1),
                                       ("sleep_mode", "sleep", 1), ("sleep_mode", "wake", 2)):
            sample = (f'vllm:{name}_operation_duration_seconds_count{{operation="{operation}"}} '
                      f"{count:.1f}")
            assert sample in metrics, sample


def streamed_until_aborted(http: httpx.Client, pool: ThreadPoolExecutor):
    """Start a long streamed completion; (its response id, a future of its finish_reason) once
    its first token is out."""
    started, state = threading.Event(), {}

    def stream() -> str:
        finish = None
        with http.stream("POST", "/v1/completions", json={
                "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[6:])
                    state.setdefault("id", chunk["id"])
                    started.set()
                    finish = chunk["choices"][0].get("finish_reason") or finish
        return finish

    finish = pool.submit(stream)
    assert started.wait(60)
    return state["id"], finish
