"""DP ranks as Ray actors (--data-parallel-backend ray), placed on the nodes of a Ray cluster.

Mirrors CoreEngineActorManager (vllm/v1/engine/utils.py) and DPEngineCoreActor
(vllm/v1/engine/core.py). Ray only places and starts: one placement group per rank (ranks
0..data_parallel_size_local-1 on the frontend's node, the rest wherever the cluster has room), one
actor in each; the frontend's addresses go to every actor when it is created, so there is no ZMQ
handshake, and readiness is the actor's wait_for_init. Requests and outputs then flow over the same
ZMQ sockets as with the mp backend, and the ranks meet in the same gloo group. The frontend
watches each actor's run() and turns dead when one ends. Left out: several engines per placement
group (tensor parallelism), vLLM's pack strategies, elastic scaling.
"""

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import time

import uvloop

try:
    import ray
except ImportError as e:  # the optional extra
    raise ImportError("--data-parallel-backend ray needs Ray: pip install 'minicore[ray]'") from e
from ray._private import services
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from minicore.config import EngineConfig
from minicore.dp.client import DPLBAsyncMPClient
from minicore.dp.engine import DPEngineCoreProc
from minicore.engine.components import build_components
from minicore.engine.launch import configure_engine_process, log_engine_config, resolve_model

logger = logging.getLogger(__name__)

# How long the ranks' placement groups may wait for resources the cluster has but are in use
# (resources it does not have at all are refused at once); read at each start.
PLACEMENT_TIMEOUT_ENV = "MINICORE_RAY_PLACEMENT_TIMEOUT_S"
DEFAULT_PLACEMENT_TIMEOUT_S = 60.0
# The engines' settings that travel to actors on other nodes, whose environment is the one their
# `ray start` had.
FORWARDED_ENV_PREFIXES = ("MINICORE_", "VLLM_", "HF_", "TRANSFORMERS_")


class RayDPEngineCoreProc(DPEngineCoreProc):
    """A DP rank whose frontend addresses were given at creation: nothing to handshake."""

    def __init__(self, config: EngineConfig, addresses: dict[str, list[str]], rank: int):
        self.addresses = addresses
        super().__init__(config, build_components, "", rank)

    @contextlib.contextmanager
    def _perform_handshakes(self, address: str, identity: bytes, timeout: float):
        yield self.addresses


class DPEngineCoreActor:
    """The Ray actor of one DP rank: __init__ builds the engine (joins the DP group, loads the
    model), wait_for_init returns once that is done (its KV blocks; vLLM's returns nothing),
    run serves until the actor is killed or the engine fails. Not a DPEngineCoreProc itself, as
    vLLM's is: Ray would make a class with coroutine methods an async actor, running them on its
    own event loop, where the engine runs on a uvloop of its own."""

    def __init__(self, config: EngineConfig, addresses: dict[str, list[str]], rank: int):
        configure_engine_process(config, rank)
        self.engine_core: RayDPEngineCoreProc | None = None
        self.startup_error: Exception | None = None
        try:
            # A GGUF's conversion is this node's own (another node may not have the frontend's).
            mc = config.model_config
            config = resolve_model(dataclasses.replace(
                config, model_config=dataclasses.replace(mc, model=mc.model_source)))
            self.engine_core = RayDPEngineCoreProc(config, addresses, rank)
            log_engine_config(self.engine_core.config, self.engine_core.model_runner)
        except Exception as e:  # raised to the frontend by wait_for_init, whole
            logger.error("EngineCore failed to start: %s", e,
                         exc_info=logger.isEnabledFor(logging.DEBUG))
            self.startup_error = e

    def wait_for_init(self) -> int:
        if self.startup_error is not None:
            raise self.startup_error
        return self.engine_core.config.cache_config.num_blocks

    def run(self) -> None:
        fatal = True
        try:
            uvloop.run(self.engine_core.run())
            fatal = False
            logger.info("EngineCore exiting.")
        finally:
            self.engine_core.close(fatal)


class CoreEngineActorManager:
    """The placement groups and actors of every DP rank, created from the frontend; close()
    removes them all (and stops the local Ray cluster if it started one)."""

    def __init__(self, config: EngineConfig):
        self.config = config
        # RAY_ADDRESS's cluster, else a new local instance (not Ray's guess from the address file
        # of the last cluster started here, which outlives that cluster); none if the caller
        # connected already.
        self.owns_ray = not ray.is_initialized()
        self.local_ray = self.owns_ray and not os.environ.get("RAY_ADDRESS")
        if self.local_ray:
            _init_local_ray()
        elif self.owns_ray:
            ray.init(address=os.environ["RAY_ADDRESS"])
        self.placement_groups = []
        self.actors = []
        self.here = ray.get_runtime_context().get_node_id()
        gpus = ray.cluster_resources().get("GPU", 0.0)
        device = config.model_config.device or ("cuda" if gpus else "cpu")
        # One CPU for the engine process, and its GPU on CUDA (vLLM's bundles).
        self.bundle = {"CPU": 1.0} if device.startswith("cpu") else {"CPU": 1.0, "GPU": 1.0}

    @property
    def procs(self) -> dict:
        """No engine process of the frontend's own: Ray starts them, and they are watched
        through their actors' run()."""
        return {}

    def place(self, deadline: float) -> EngineConfig:
        """A placement group per rank, ready (ValueError if the cluster cannot hold them,
        TimeoutError naming what is missing if they do not fit in time); returns the config
        with the address the ranks reach the frontend at."""
        pc = self.config.parallel_config
        self.place_ranks(range(pc.data_parallel_size), deadline)
        address = pc.data_parallel_address or (
            "127.0.0.1" if set(self.node_ids) == {self.here} else ray.util.get_node_ip_address())
        self.config = dataclasses.replace(self.config, parallel_config=dataclasses.replace(
            pc, data_parallel_address=address))
        logger.info("Ray placed DP ranks on nodes %s; the frontend listens on %s",
                    [node_id[:8] for node_id in self.node_ids], address)
        return self.config

    def place_ranks(self, ranks: range, deadline: float) -> None:
        """A placement group for each of ranks (the ranks after them have none yet), ready."""
        pc = self.config.parallel_config
        nodes = {n["NodeID"]: n for n in ray.nodes() if n["Alive"]}
        self._check_fits(nodes, ranks.stop)
        new = [placement_group(
            [self.bundle], strategy="STRICT_PACK", name=f"dp_rank_{rank}",
            bundle_label_selector=([{"ray.io/node-id": self.here}]
                                   if rank < pc.data_parallel_size_local else None))
            for rank in ranks]
        ready = [pg.ready() for pg in new]
        limit = float(os.environ.get(PLACEMENT_TIMEOUT_ENV, DEFAULT_PLACEMENT_TIMEOUT_S))
        timeout = max(0.0, min(limit, deadline - time.monotonic()))
        done, _ = ray.wait(ready, num_returns=len(ready), timeout=timeout)
        if len(done) < len(ready):
            for pg in new:
                remove_placement_group(pg)
            missing = [rank for rank, ref in zip(ranks, ready) if ref not in done]
            raise TimeoutError(
                f"Ray could not place DP rank(s) {missing} within {timeout:g} s "
                f"({PLACEMENT_TIMEOUT_ENV}): each needs {self.bundle}"
                f"{self._local_note(missing)}; available now in the cluster: "
                f"{ {key: ray.available_resources().get(key, 0.0) for key in self.bundle} }")
        self.placement_groups.extend(new)
        self.node_ids = [ray.util.placement_group_table(pg)["bundles_to_node_id"][0]
                         for pg in self.placement_groups]

    def _check_fits(self, nodes: dict, num_ranks: int) -> None:
        """Refuse at once what no wait could fix: more ranks than the nodes' total resources
        hold (local ranks on this node, the rest anywhere)."""
        slots = {node_id: _slots(n["Resources"], self.bundle) for node_id, n in nodes.items()}
        local = self.config.parallel_config.data_parallel_size_local
        if slots.get(self.here, 0) >= local and sum(slots.values()) >= num_ranks:
            return
        totals = {node_id: n["Resources"] for node_id, n in nodes.items()}
        raise ValueError(
            f"the Ray cluster cannot hold {num_ranks} DP ranks, each needing "
            f"{self.bundle}{self._local_note(range(local))}; its nodes have "
            f"{_describe(totals, self.here, self.bundle)}")

    def _local_note(self, ranks) -> str:
        local = [r for r in ranks if r < self.config.parallel_config.data_parallel_size_local]
        return (f", rank(s) {local} on this node ({self.here[:8]}, "
                "--data-parallel-size-local)") if local else ""

    def start_actors(self, addresses: dict[str, list[str]], ranks: range | None = None) -> None:
        """An actor for each of ranks (default: every placed rank) on the frontend's sockets."""
        self.addresses = addresses
        actor_cls = ray.remote(DPEngineCoreActor)
        for rank in range(len(self.placement_groups)) if ranks is None else ranks:
            # Named as the mp backend's processes (unique within this frontend's Ray job).
            options = {"name": f"EngineCore_DP{rank}", "num_cpus": self.bundle["CPU"],
                       "num_gpus": self.bundle.get("GPU", 0),
                       "scheduling_strategy": PlacementGroupSchedulingStrategy(
                           self.placement_groups[rank], 0),
                       "runtime_env": {"env_vars": self._engine_env(rank)}}
            self.actors.append(actor_cls.options(**options).remote(self.config, addresses, rank))

    def _engine_env(self, rank: int) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}
        if "MINICORE_CPU_THREADS" not in env and "GPU" not in self.bundle:
            # The ranks on one node share its cores, as the mp backend's local ranks do.
            node_id = self.node_ids[rank]
            cpus = next(n["Resources"].get("CPU", 1) for n in ray.nodes()
                        if n["NodeID"] == node_id)
            env["MINICORE_CPU_THREADS"] = str(max(1, int(cpus) // self.node_ids.count(node_id)))
        return env

    async def wait_for_init(self, deadline: float, ranks: range) -> dict[int, int]:
        """Each rank's KV blocks once its actor is built; the first failure raised at once."""
        pending = {asyncio.wrap_future(self.actors[rank].wait_for_init.remote().future()): rank
                   for rank in ranks}
        num_blocks = {}
        while pending:
            done, _ = await asyncio.wait(pending, timeout=max(0.0, deadline - time.monotonic()),
                                         return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise TimeoutError(f"no READY from engine(s) {sorted(pending.values())} within "
                                   "the startup timeout")
            for future in done:
                rank = pending.pop(future)
                if (error := future.exception()) is not None:
                    for other in pending:
                        other.cancel()
                    raise RuntimeError(f"engine core {rank} (Ray actor on node "
                                       f"{self.node_ids[rank][:8]}) failed to start: "
                                       f"{_cause(error)}") from None
                num_blocks[rank] = future.result()
        return num_blocks

    def run(self, ranks: range) -> list[asyncio.Future]:
        """Start the ranks' busy loops; the futures end when the actors do."""
        return [asyncio.wrap_future(self.actors[rank].run.remote().future()) for rank in ranks]

    def terminate(self) -> None:
        """Kill every actor (a rank cannot go on without its peers)."""
        for actor in self.actors:
            ray.kill(actor)

    def close(self) -> None:
        """Kill the actors and leave the cluster as found: a joined cluster's placement groups
        removed, a local instance of our own stopped."""
        self.terminate()
        # A local instance's placement groups end with its GCS. Removing them first would wait for
        # the GCS's answer, which never comes once it is stopping on a signal of its own (systemd's
        # stop signals every process of the service, Ray's too).
        if not self.local_ray:
            for pg in self.placement_groups:
                remove_placement_group(pg)
        if self.owns_ray:
            ray.shutdown()


class RayDPLBAsyncMPClient(DPLBAsyncMPClient):
    """DPLBAsyncMPClient whose engines are Ray actors: placed before the sockets are bound (their
    address depends on where the ranks run), started without the ZMQ handshake, watched through
    their run() instead of process sentinels."""

    manager_class = CoreEngineActorManager

    async def start(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self.manager = await asyncio.to_thread(self.manager_class, self.config)
        self.config = await asyncio.to_thread(self.manager.place, deadline)
        await super().start(max(0.0, deadline - time.monotonic()))

    def _start_engine_processes(self) -> None:
        pass  # actors, placed by start() and started by _launch_engines once the sockets are bound

    async def _launch_engines(self, addresses: dict[str, list[str]],
                              deadline: float) -> dict[int, int]:
        self.manager.start_actors(addresses)
        return await self._watch_actors(range(len(self.manager.actors)), deadline)

    async def _watch_actors(self, ranks: range, deadline: float) -> dict[int, int]:
        """The ranks' KV blocks once their actors are built; from then on an actor's end turns
        the client dead."""
        num_blocks = await self.manager.wait_for_init(deadline, ranks)
        for rank, future in zip(ranks, self.manager.run(ranks)):
            actor = self.manager.actors[rank]
            future.add_done_callback(functools.partial(self._on_actor_exit, rank, actor))
        return num_blocks

    def _on_actor_exit(self, rank: int, actor, future: asyncio.Future) -> None:
        error = None if future.cancelled() else future.exception()
        if not any(actor is current for current in self.manager.actors):
            return  # retired by a scale down (minicore/dp/ray_elastic.py)
        how = f"died: {_cause(error)}" if error is not None else "exited"
        self.set_dead(f"engine core {rank}'s Ray actor {how}")


def _init_local_ray() -> None:
    """Start a local Ray instance without the dashboard, a UI whose ten processes took some 7 s
    of CPU to start on two cores (a cluster started with `ray start --head` has it). Its
    processes (GCS, raylet, monitors, and the raylet's workers and agents under it) run outside
    the frontend's process group, each in a session of its own, so that a signal to the whole
    group (`kill -- -PGID`, a terminal's Ctrl+C) reaches the frontend alone, which then stops them
    in order (close()). Ray keeps SIGINT from them itself (it blocks it in each) but not SIGTERM:
    in the group, the GCS and raylet stopped under the frontend, whose placement group removal
    then never returned. Ray's Popen is the only way in (ray.init has no such option); Ray's fate
    sharing stays, so they still die with a frontend killed by SIGKILL."""
    popen = services.ConsolePopen
    services.ConsolePopen = functools.partial(popen, start_new_session=True)
    try:
        ray.init(address="local", include_dashboard=False)
    finally:
        services.ConsolePopen = popen


def _slots(resources: dict, bundle: dict) -> int:
    return min(math.floor(resources.get(key, 0.0) / need) for key, need in bundle.items())


def _describe(resources_by_node: dict, here: str, bundle: dict) -> str:
    """Each node's amount of what a rank needs, this node marked."""
    return "; ".join(
        f"node {node_id[:8]}{' (this one)' if node_id == here else ''}: "
        + str({key: resources.get(key, 0.0) for key in bundle})
        for node_id, resources in resources_by_node.items())


def _cause(error: BaseException) -> str:
    """The engine's own exception inside Ray's wrapper, as one line."""
    text = str(getattr(error, "cause", None) or error).strip()
    return text.splitlines()[-1] if text else type(error).__name__
