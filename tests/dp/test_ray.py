"""Data parallel on Ray (--data-parallel-backend ray), on a two-node Ray cluster made here.

The cluster (ray.cluster_utils.Cluster) has a head node and a second node of one CPU each, told
apart by the custom resources "head" and "node2"; the server connects to it through RAY_ADDRESS.
A server started on the head node with --data-parallel-size-local 1 must put rank 0 there and
rank 1 on the second node. Checked through Ray's state API (ray.util.state), as an operator would:
- DP=2 on the real default model gives the single engine's greedy text, both ranks serve, waves
  end and restart; then a rank's actor killed: /health 503 within 5 s, streams end, and a
  SIGTERM to the server's whole process group (which must leave the cluster's own processes
  running) stops it: none of its actors is alive and none of its placement groups is left
  (one server for both: a DP=2 start on Ray is the costliest thing the suite does);
- without RAY_ADDRESS, the local Ray instance it starts is stopped with it: a SIGTERM to its whole
  process group (`kill -- -PGID`), a SIGINT to it (a terminal's Ctrl+C) and a SIGTERM to the
  server alone each end it within 10 s, leaving none of its processes behind; so does a SIGTERM
  to every process it started too (systemd's stop), within 30 s;
- expert parallelism and the balance gate across the two nodes (in process, through AsyncLLM):
  a tiny MoE model's greedy tokens equal one engine's, the ranks' forwards meeting in every MoE
  layer (dummy ones included), and the wave ends;
- a cluster too small is refused at once, naming what each rank needs and what the nodes have;
  one whose resources are taken, after a bounded wait, naming the rank and what is free.
"""

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import ray
from dp_helpers import (
    assert_all_engines_idle,
    dp_client,
    free_port_pair,
    one_engine_tokens,
    token_prompts,
    wait_idle,
)
from ray.cluster_utils import Cluster
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.state import list_actors, list_nodes, list_placement_groups
from server_helpers import ServerProcess, free_port, run_python

# The mp backend's end-to-end test's prompts, helpers and single-engine reference (a fixture).
from test_dp_server import PROMPTS, SMALL, _complete, _metrics, _successes, reference  # noqa: F401

from minicore.config import create_engine_config
from minicore.sampling_params import SamplingParams

FAIL_FAST_S = 5
# A signal's promise: the server is gone this soon, and whatever it started soon after.
SIGNAL_EXIT_S = 10
# systemd's stop (KillMode=control-group) signals every process of the service at once, Ray's
# own included, which then stop on their own, slower; it waits 90 s (TimeoutStopSec) by default.
SYSTEMD_EXIT_S = 30
# Which signal goes to whom (the server, its process group, or every process it started too),
# and how soon the server must be gone.
SIGNALS = {"SIGTERM to the process group": (signal.SIGTERM, "group", SIGNAL_EXIT_S),
           "SIGINT to the process group": (signal.SIGINT, "group", SIGNAL_EXIT_S),
           "SIGTERM to the server alone": (signal.SIGTERM, "server", SIGNAL_EXIT_S),
           "SIGTERM to every process, as systemd": (signal.SIGTERM, "all", SYSTEMD_EXIT_S)}


@pytest.fixture(scope="module", autouse=True)
def no_idle_ray_workers():
    """Ray prestarts an idle worker per CPU on every node it starts, which nothing here uses (an
    engine actor starts a worker of its own): without them a local instance is ready some 5 s
    sooner on two cores (24 s to /health, 19 s without), and the suite has several."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_enable_worker_prestart", "0")
        yield


@pytest.fixture(scope="module")
def cluster():
    """Two Ray nodes of one CPU each on this machine, the head with the dashboard (the state
    API's server)."""
    # The dashboard on a free port, not Ray's default one, which another program may hold.
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {"head": 1}, "include_dashboard": True,
        "dashboard_port": free_port()})
    cluster.add_node(num_cpus=1, resources={"node2": 1})
    cluster.wait_for_nodes()
    yield cluster
    cluster.shutdown()


class RayServer(ServerProcess):
    """`serve --data-parallel-backend ray` against the test cluster."""

    def __init__(self, cluster):
        super().__init__("--data-parallel-size", "2", "--data-parallel-backend", "ray",
                         "--data-parallel-size-local", "1",
                         "--data-parallel-rpc-port", str(free_port_pair()), *SMALL)
        self.cluster = cluster

    def __enter__(self):
        os.environ["RAY_ADDRESS"] = self.cluster.address
        try:
            return super().__enter__()
        finally:
            del os.environ["RAY_ADDRESS"]


def signal_exit(server: ServerProcess, sig: int, whom: str = "group",
                timeout: float = SIGNAL_EXIT_S) -> int:
    """Send sig to the server, to its whole process group (which ServerProcess makes its own),
    or to all its processes; its exit status, which must come within timeout."""
    if whom == "group":
        os.killpg(server.proc.pid, sig)
    elif whom == "server":
        server.proc.send_signal(sig)
    else:
        for process in [psutil.Process(server.proc.pid), *server.children()]:
            with contextlib.suppress(psutil.NoSuchProcess):
                process.send_signal(sig)
    return server.proc.wait(timeout)


def assert_gone(processes: list[psutil.Process]) -> None:
    """None of processes left, not even defunct (Ray's dashboard leaves helpers that end, and are
    reaped, a few seconds after it), except one that has ended and waits for init alone to reap it:
    how soon is init's business (this sandbox's init once took 10 s)."""
    deadline = time.monotonic() + SIGNAL_EXIT_S
    while left := [p for p in processes if p.is_running() and not _waits_for_init(p)]:
        assert time.monotonic() < deadline, f"left: {[(p.pid, p.name(), p.status()) for p in left]}"
        time.sleep(0.25)


def _waits_for_init(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE and process.ppid() == 1
    except psutil.NoSuchProcess:
        return True


def _state(fn, cluster, **kwargs):
    return fn(address=cluster.address, raise_on_missing_output=False, **kwargs)


def engine_actors(cluster) -> dict[str, object]:
    """The live engine actors, by name (EngineCore_DP<rank>)."""
    return {a.name: a for a in _state(list_actors, cluster, filters=[("state", "=", "ALIVE")])
            if a.class_name == "DPEngineCoreActor"}


def node_with(cluster, resource: str) -> str:
    (node,) = [n.node_id for n in _state(list_nodes, cluster, detail=True)
               if resource in n.resources_total]
    return node


def assert_cluster_as_found(cluster) -> None:
    """None of the server's actors alive, none of its placement groups left."""
    deadline = time.monotonic() + 10
    while True:
        actors = engine_actors(cluster)
        groups = [g for g in _state(list_placement_groups, cluster) if g.state != "REMOVED"]
        if not actors and not groups:
            return
        assert time.monotonic() < deadline, f"left on the cluster: {actors} {groups}"
        time.sleep(0.25)


@pytest.mark.model
async def test_ray_dp2_matches_one_engine_fails_fast_on_a_killed_rank_and_leaves_nothing(
        cluster, reference):  # noqa: F811 (the fixture imported above)
    with RayServer(cluster) as server:
        actors = engine_actors(cluster)
        assert sorted(actors) == ["EngineCore_DP0", "EngineCore_DP1"]
        assert actors["EngineCore_DP0"].node_id == node_with(cluster, "head")
        assert actors["EngineCore_DP1"].node_id == node_with(cluster, "node2")
        groups = _state(list_placement_groups, cluster, filters=[("state", "=", "CREATED")])
        assert sorted(g.name for g in groups) == ["dp_rank_0", "dp_rank_1"]

        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http, \
                asyncio.timeout(240):
            choices = await asyncio.gather(*(_complete(http, p) for p in PROMPTS))
            assert {p: (c["text"], c["finish_reason"]) for p, c in zip(PROMPTS, choices)} == \
                reference
            # Both ranks served (the least loaded takes each) and report their own metrics.
            before = await _metrics(http)
            assert _successes(before, "0") > 0 and _successes(before, "1") > 0
            # A rank asked for by header, after the wave ended: both ranks wake again.
            await asyncio.sleep(1)
            choice = await _complete(http, PROMPTS[0], **{"X-data-parallel-rank": "1"})
            assert (choice["text"], choice["finish_reason"]) == reference[PROMPTS[0]]
            assert _successes(await _metrics(http), "1") == _successes(before, "1") + 1
            await _kill_rank1_mid_stream(cluster, http)
        # `kill -- -PGID`: the whole process group, which holds none of the cluster's processes.
        assert signal_exit(server, signal.SIGTERM) == 0
        assert "Traceback" not in server.log()[-2000:], server.log()
    assert cluster.remaining_processes_alive()
    assert_cluster_as_found(cluster)


async def _kill_rank1_mid_stream(cluster, http: httpx.AsyncClient) -> None:
    """Rank 1's actor killed (SIGKILL to its worker process, on the second node) while it
    streams: /health is 503 within FAIL_FAST_S, the stream ends with an error as fast, and new
    requests are 503."""
    rank1 = engine_actors(cluster)["EngineCore_DP1"]
    stream = asyncio.create_task(http.post("/v1/completions", json={
        "prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "temperature": 0},
        headers={"X-data-parallel-rank": "1"}))
    await asyncio.sleep(1.0)
    os.kill(rank1.pid, signal.SIGKILL)
    killed = time.monotonic()
    while (await http.get("/health")).status_code != 503:
        assert time.monotonic() - killed < FAIL_FAST_S, "/health still 200"
        await asyncio.sleep(0.1)
    response = await asyncio.wait_for(stream, FAIL_FAST_S)
    assert response.status_code >= 500, response.text
    assert (await http.post("/v1/completions", json={
        "prompt": "hi", "max_tokens": 2})).status_code == 503


@pytest.mark.parametrize("how", SIGNALS)
def test_ray_local_instance_stops_with_the_server_on_a_signal(how):
    """No RAY_ADDRESS: the server's own Ray instance (GCS, raylet, the actors' workers; no
    dashboard) goes with it, and with its GCS every actor and placement group."""
    assert "RAY_ADDRESS" not in os.environ
    with ServerProcess("--runner", "simulated", "--data-parallel-size", "2",
                       "--data-parallel-backend", "ray",
                       "--data-parallel-rpc-port", str(free_port_pair())) as server:
        started = server.children()
        names = " ".join(p.name() for p in started)
        assert "gcs_server" in names and "raylet" in names, names
        assert "ray-dashboard" not in names, names
        assert names.count("DPEngineCoreActor") == 2, names
        assert signal_exit(server, *SIGNALS[how]) == 0
        assert_gone(started)
        assert "Traceback" not in server.log(), server.log()


async def test_ray_expert_parallel_with_the_balance_gate_gives_one_engines_tokens(
        cluster, moe_model_dir, monkeypatch):
    model_dir = moe_model_dir("qwen3_moe")
    engine_args = dict(max_model_len=256, kv_cache_memory=16 << 20)
    # Rank 0 gets three requests of different lengths (full at max_num_seqs 3: the gate closes on
    # both ranks), rank 1 one, shorter: it runs dummy forwards before and after it.
    plan = [(0, 23, 24), (0, 5, 32), (0, 11, 16), (1, 9, 8)]
    prompts = token_prompts(model_dir, [length for _, length, _ in plan])
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for *_, n in plan]
    expected = one_engine_tokens(model_dir, prompts, params, **engine_args)

    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    config = create_engine_config(
        model=model_dir, data_parallel_size=2, data_parallel_backend="ray",
        data_parallel_size_local=1, data_parallel_rpc_port=free_port_pair(),
        enable_expert_parallel=True, balance_scheduling=True, max_num_seqs=3, **engine_args)

    async def run(client, i):
        outputs = [o async for o in client.generate(prompts[i], params[i], f"req-{i}",
                                                    data_parallel_rank=plan[i][0])]
        return outputs[-1].outputs[0].token_ids

    async with dp_client(config) as client:
        assert sorted(engine_actors(cluster)) == ["EngineCore_DP0", "EngineCore_DP1"]
        got = await asyncio.wait_for(
            asyncio.gather(*(run(client, i) for i in range(len(plan)))), 120)
        await wait_idle(client)
        await assert_all_engines_idle(client)
    assert got == expected
    assert_cluster_as_found(cluster)


def test_ray_cluster_too_small_is_refused_at_once(cluster):
    """Three ranks of one CPU each on a cluster of two CPUs: an error naming both, not a wait."""
    env = {**os.environ, "RAY_ADDRESS": cluster.address}
    started = time.monotonic()
    result = run_python(
        [sys.executable, "-m", "minicore", "serve", "--port", str(free_port()),
         "--runner", "simulated", "--data-parallel-size", "3", "--data-parallel-backend", "ray",
         "--data-parallel-size-local", "1", "--data-parallel-rpc-port", str(free_port_pair())],
        env)
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - started < 60
    assert "cannot hold 3 DP ranks, each needing {'CPU': 1.0}" in result.stderr, result.stderr
    assert "{'CPU': 1.0}" in result.stderr.split("its nodes have")[1]
    assert_cluster_as_found(cluster)


def test_ray_ranks_waiting_for_taken_resources_fail_after_the_bound(cluster):
    """The second node's CPU held by another job: rank 1 fits the cluster but not now, so the
    server waits MINICORE_RAY_PLACEMENT_TIMEOUT_S, then fails naming the rank and what is free."""
    ray.init(address=cluster.address)
    try:
        holder = placement_group([{"CPU": 1.0, "node2": 1.0}], strategy="STRICT_PACK")
        ray.get(holder.ready(), timeout=30)
        env = {**os.environ, "RAY_ADDRESS": cluster.address,
               "MINICORE_RAY_PLACEMENT_TIMEOUT_S": "3"}
        result = run_python(
            [sys.executable, "-m", "minicore", "serve", "--port", str(free_port()),
             "--runner", "simulated", "--data-parallel-size", "2", "--data-parallel-backend", "ray",
             "--data-parallel-size-local", "1", "--data-parallel-rpc-port",
             str(free_port_pair())], env)
        remove_placement_group(holder)
    finally:
        ray.shutdown()
    assert result.returncode == 1, result.stderr[-3000:]
    assert "Ray could not place DP rank(s) [1] within 3 s" in result.stderr, result.stderr
    assert "available now in the cluster: {'CPU': 0.0}" in result.stderr, result.stderr
    assert_cluster_as_found(cluster)


@pytest.mark.parametrize("args, message", [
    (["--data-parallel-backend", "ray"], "needs --data-parallel-size >= 2"),
    (["--data-parallel-size", "2", "--data-parallel-backend", "ray",
      "--data-parallel-size-local", "0"], "at least rank 0"),
    (["--headless", "--data-parallel-size", "2", "--data-parallel-backend", "ray"],
     "ray start --address"),
])
def test_ray_backend_refuses_what_it_cannot_run(args, message):
    result = subprocess.run([sys.executable, "-m", "minicore", "serve", "--runner", "simulated",
                             *args], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr[-2000:]


def test_ray_backend_without_ray_installed_says_how_to_get_it():
    hide_ray = ("import sys; sys.modules['ray'] = None; from minicore.__main__ import main; "
                "main(['serve', '--runner', 'simulated', '--data-parallel-size', '2', "
                "'--data-parallel-backend', 'ray'])")
    result = subprocess.run([sys.executable, "-c", hide_ray], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 1
    assert "needs Ray: pip install 'minicore[ray]'" in result.stderr, result.stderr[-2000:]
