"""DPLBAsyncMPClient: the frontend's client of several DP engines.

Mirrors DPLBAsyncMPClient in vllm/v1/engine/core_client.py: an AsyncMPClient
(minicore/engine/core_client.py) that sends each request to the least loaded engine (or the one it
names) and starts the engines' waves as requests arrive, with the DPCoordinator
(minicore/dp/coordinator.py) as its picture of the engines. With several API servers
(`serve --api-server-count`) each has its own client and coordinator, and every engine sends each
of them its stats and wave news (minicore/engine/client_router.py).
"""

from minicore.config import EngineConfig
from minicore.dp.coordinator import DPCoordinator
from minicore.engine.core_client import AsyncMPClient
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
        engine_index = self.coordinator.select_engine(request.data_parallel_rank)
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


def engine_client_class(config: EngineConfig) -> type[AsyncMPClient]:
    """The frontend's client of the mp backend's engines: DPLBAsyncMPClient with data
    parallelism, else AsyncMPClient."""
    return DPLBAsyncMPClient if config.parallel_config.data_parallel_size > 1 else AsyncMPClient
