"""The frontend's clients of several DP engines, and the wave coordinator.

Mirrors DPLBAsyncMPClient in vllm/v1/engine/core_client.py, and the wave role of DPCoordinatorProc
(vllm/v1/engine/coordinator.py) under vLLM's --data-parallel-external-lb and
--data-parallel-hybrid-lb. DPLBAsyncMPClient, an AsyncMPClient (minicore/engine/core_client.py),
sends each request to the least loaded engine (or the one it names) and starts the engines' waves
as requests arrive, with a DPCoordinator (minicore/dp/coordinator.py) as its picture of them. With
several API servers (`serve --api-server-count`) each has its own, and every engine sends each
its stats and wave news (minicore/engine/client_router.py).

External and hybrid load balancing run a frontend per rank or per machine
(LocalDPLBAsyncMPClient): it sends requests to its own ranks only and can wake only those; a rank
woken from idle tells every client it has (start_wave, minicore/dp/engine.py). The wave
coordinator is one more client of every engine, on rank 0's machine: a DPLBAsyncMPClient that
sends no request and answers that news with START_DP_WAVE to the other ranks, as the one frontend
of internal load balancing does. Its sockets are at --data-parallel-address, ports
--data-parallel-rpc-port + 1 (the engines' input) and + 2 (their outputs; rpc_port itself is the
DP group's rendezvous); every frontend hands them to its engines beside its own. Rank 0's
frontend runs it once its own engines are READY (every rank has joined the DP group by then, and
so has connected to it), and is dead when the coordinator sees an engine die or hang.
Left out: vLLM's gathering of the ranks' load for external balancers.
"""

import asyncio
import dataclasses
import time

from minicore.config import EngineConfig
from minicore.dp.coordinator import DPCoordinator
from minicore.engine.core_client import AsyncMPClient, EngineDeadError
from minicore.protocol import EngineCoreOutputs, EngineCoreRequest, EngineCoreRequestType


class DPLBAsyncMPClient(AsyncMPClient):
    """Several engines: each request goes to the least loaded (or the one it names), and the
    engines' waves are started as requests arrive."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.coordinator = DPCoordinator(self.num_engines)
        # The engine of every request in flight, for its abort.
        self.reqs_in_flight: dict[str, int] = {}

    def add_request(self, request: EngineCoreRequest) -> int:
        rank = request.data_parallel_rank
        engine_index = self.coordinator.select_engine(None if rank is None
                                                      else rank - self.first_rank)
        request.current_wave = self.coordinator.current_wave
        self._send(EngineCoreRequestType.ADD, request, engine_index)
        self.reqs_in_flight[request.request_id] = engine_index
        if (start := self.coordinator.on_request_sent(engine_index)) is not None:
            self._start_wave(*start)
        return engine_index

    def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for request_id in request_ids:
            if (engine_index := self.reqs_in_flight.pop(request_id, None)) is not None:
                by_engine.setdefault(engine_index, []).append(request_id)
        for engine_index, ids in by_engine.items():
            self._send(EngineCoreRequestType.ABORT, ids, engine_index, raise_if_dead=False)

    def resume_waves(self) -> None:
        """After a resume, requests kept through the pause must step again: wake every engine
        (a rank that steps alone would wait in a collective for its peers)."""
        if self.reqs_in_flight and not self.coordinator.engines_running:
            self.coordinator.engines_running = True
            self._start_wave(self.coordinator.current_wave, -1)

    def _start_wave(self, wave: int, exclude_engine_index: int) -> None:
        """Wake the engines for a wave (the one given the request that starts it wakes itself)."""
        for engine_index in range(self.num_engines):
            if engine_index != exclude_engine_index:
                self._send(EngineCoreRequestType.START_DP_WAVE, (wave, exclude_engine_index),
                           engine_index, raise_if_dead=False)

    def _process_engine_outputs(self, outputs: EngineCoreOutputs) -> None:
        super()._process_engine_outputs(outputs)
        if (start := self.coordinator.on_outputs(outputs)) is not None:
            self._start_wave(*start)
        for output in outputs.outputs:
            if output.finished:
                self.reqs_in_flight.pop(output.request_id, None)


def coordinator_addresses(config: EngineConfig) -> dict[str, list[str]]:
    """The wave coordinator's input and output addresses, as a handshake's lists."""
    pc = config.parallel_config
    host, port = pc.data_parallel_address, pc.data_parallel_rpc_port
    return {"inputs": [f"tcp://{host}:{port + 1}"], "outputs": [f"tcp://{host}:{port + 2}"]}


class LocalDPLBAsyncMPClient(DPLBAsyncMPClient):
    """The frontend of one machine's ranks (external load balancing: one rank). Its engines also
    connect to the wave coordinator, which rank 0's frontend runs."""

    def __init__(self, config: EngineConfig):
        super().__init__(config)
        self.wave_coordinator: WaveCoordinator | None = None

    async def _launch_engines(self, addresses: dict[str, list[str]],
                              deadline: float) -> dict[int, int]:
        coordinator = coordinator_addresses(self.config)
        num_blocks = await super()._launch_engines(
            {kind: [*addresses[kind], *coordinator[kind]] for kind in addresses}, deadline)
        if self.first_rank == 0:
            self.wave_coordinator = WaveCoordinator(self.config, self.set_dead)
            self.wave_coordinator.start(deadline)
        return num_blocks

    async def shutdown(self) -> None:
        await super().shutdown()  # dead first: the coordinator's end is no news then
        if self.wave_coordinator is not None:
            await self.wave_coordinator.shutdown()


class WaveCoordinator:
    """A client of every rank that keeps their waves in step; on_dead(reason) when it sees an
    engine die or hang."""

    def __init__(self, config: EngineConfig, on_dead):
        # The frontend's config seen from every rank (internal load balancing).
        pc = dataclasses.replace(config.parallel_config, data_parallel_external_lb=False,
                                 data_parallel_hybrid_lb=False, data_parallel_start_rank=0,
                                 data_parallel_size_local=None)
        self.client = DPLBAsyncMPClient(dataclasses.replace(config, parallel_config=pc))
        self.client.on_dead = lambda error: on_dead(f"the wave coordinator: {error}")
        self.task: asyncio.Task | None = None

    def start(self, deadline: float) -> None:
        addresses = coordinator_addresses(self.client.config)
        self.client.attach(addresses["inputs"][0], addresses["outputs"][0], {},
                           max(0.0, deadline - time.monotonic()))
        self.task = asyncio.create_task(self._run())

    async def _run(self) -> None:
        """Read every engine's frames: the client answers wave news as it reads them."""
        try:
            while True:
                await self.client.get_output_async()
        except EngineDeadError:
            pass  # on_dead has told the frontend

    async def shutdown(self) -> None:
        if self.task is not None:
            self.task.cancel()
        await self.client.shutdown()


def engine_client_class(config: EngineConfig) -> type[AsyncMPClient]:
    """The frontend's client of the mp backend's engines: with data parallelism
    DPLBAsyncMPClient, or LocalDPLBAsyncMPClient with external or hybrid load balancing; else
    AsyncMPClient."""
    pc = config.parallel_config
    if pc.engine_ranks != range(pc.data_parallel_size):
        return LocalDPLBAsyncMPClient
    return DPLBAsyncMPClient if pc.data_parallel_size > 1 else AsyncMPClient
