"""DPEngineCoreProc: one data-parallel rank, an EngineCoreProc whose busy loop keeps step with its
peers.

Mirrors DPEngineCoreProc in vllm/v1/engine/core.py (seed 003) with the balance gather of
vllm-ascend's BalanceDPEngineCoreProc.run_busy_loop (seed 000), as a coroutine. Each rank has its
own scheduler, KV cache and model replica; the ranks agree through two collectives (minicore/dp/
group.py): every 32 steps an all-reduce of "has unfinished requests", and with balance scheduling
an all-gather of len(running) right after it on every active step. A rank with nothing to run while
its peers still have work (the wave is running) runs a dummy batch, so that it keeps issuing the
same collectives in the same order as they do: a rank that skipped one would hang them all.

Waves: the ranks run together from the first request after an idle period to the all-reduce that
finds no unfinished request anywhere; then rank 0 reports wave_complete, every rank advances its
wave number and idles. A request wakes the rank it reaches, and the frontend wakes the others with
START_DP_WAVE (or the woken rank asks it to, when the request was sent for a wave that has ended).
Left out: elastic scaling (reinitialize_distributed), Ray actors, external load balancers.
"""

import asyncio
import logging

import zmq
import zmq.asyncio

from minicore.config import EngineConfig
from minicore.dp.group import DPGroup
from minicore.engine.core_proc import HANDSHAKE_TIMEOUT_S, EngineCoreProc
from minicore.protocol import EngineCoreRequest, EngineCoreRequestType

logger = logging.getLogger(__name__)

# vLLM's: the unfinished-requests all-reduce runs every this many steps of a wave.
STEPS_PER_SYNC = 32


class DPEngineCoreProc(EngineCoreProc):
    def __init__(self, config: EngineConfig, handshake_address: str, engine_index: int,
                 handshake_timeout: float = HANDSHAKE_TIMEOUT_S):
        # Steps of the current wave, for the every-32-steps sync.
        self.step_counter = 0
        self.current_wave = 0
        # True from a wave's first request (or START_DP_WAVE) to the sync that ends it.
        self.engines_running = False
        self.dp_rank = config.parallel_config.data_parallel_rank
        self.balance = config.scheduler_config.balance_scheduling
        self.dp_group: DPGroup | None = None
        self._monitor: zmq.Socket | None = None
        super().__init__(config, handshake_address, engine_index, handshake_timeout)

    def _init_data_parallel(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        self.dp_group = DPGroup(self.dp_rank, pc.data_parallel_size, pc.data_parallel_address,
                                pc.data_parallel_rpc_port, timeout_s=HANDSHAKE_TIMEOUT_S)
        self.dp_group.check_same_config({
            "--balance-scheduling": int(self.balance),
            "--runner simulated": int(config.model_config.runner == "simulated"),
        })

    def close(self, fatal: bool) -> None:
        if self.dp_group is not None:
            self.dp_group.destroy()
        if self._monitor is not None:
            # An open socket would hold up the context's termination forever.
            self._input_socket.disable_monitor()
            self._monitor.close(linger=0)
        super().close(fatal)

    async def run(self) -> None:
        # A rank on another machine has no frontend parent to watch: it stops when the
        # frontend's end of its input socket goes away.
        self._monitor = self._input_socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        monitor = zmq.asyncio.Socket.from_socket(self._monitor)

        async def watch_frontend():
            await monitor.recv_multipart()
            logger.warning("DP rank %d: the frontend disconnected; shutting down.", self.dp_rank)
            self._request_shutdown()

        watch_task = asyncio.create_task(watch_frontend())
        try:
            await super().run()
        finally:
            watch_task.cancel()

    # ---- the busy loop -------------------------------------------------------------------------

    async def run_busy_loop(self) -> None:
        try:
            await self._run_dp_busy_loop()
        except RuntimeError:
            # A peer that stopped first fails the pending collective; that is no error now.
            if not self.shutdown_requested:
                raise
            logger.info("DP rank %d: a collective failed while shutting down.", self.dp_rank)

    async def _run_dp_busy_loop(self) -> None:
        """Seed 003's DPEngineCoreProc.run_busy_loop, with seed 000's balance gather."""
        while not self.shutdown_requested:
            await self._process_input_queue()
            if self.shutdown_requested:
                return
            executed = await self._process_engine_step()
            local_unfinished_reqs = self.scheduler.has_unfinished_requests()
            if not executed:
                # A step that ran sent its stats; one skipped may leave inputs' changes unsent.
                self._publish_stats_if_changed()
                if not local_unfinished_reqs and not self.engines_running:
                    continue  # every rank is idle
                # The wave is running: keep in step with the peers that have work.
                await self._run_forward(self.model_runner.execute_dummy_batch)
            self.engines_running = await self._has_global_unfinished_reqs(local_unfinished_reqs)
            if self.balance:
                # Here, on every active step, dummy ones included; a gather inside schedule()
                # would deadlock, as a drained rank does not schedule.
                await self.dp_group.balance_gather_async(self.scheduler)
            if not self.engines_running:
                if self.dp_rank == 0:
                    logger.debug("Wave %d finished, pausing engine loop.", self.current_wave)
                    self._send(wave_complete=self.current_wave)
                self.current_wave += 1
                self.step_counter = 0

    async def _process_input_queue(self) -> None:
        """Wait while every rank is idle; then take all pending inputs."""
        while not self.engines_running and not self.scheduler.has_unfinished_requests():
            if self.shutdown_requested:
                return
            self._publish_stats_if_changed()
            self._handle_client_request(*await self.input_queue.get())
        self._drain_input_queue()

    async def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        # vLLM's optimisation: only every 32nd step pays for the all-reduce.
        self.step_counter += 1
        if self.step_counter % STEPS_PER_SYNC != 0:
            return True
        return await self.dp_group.has_global_unfinished_reqs_async(local_unfinished)

    # ---- inputs --------------------------------------------------------------------------------

    def _handle_client_request(self, request_type, request) -> None:
        if request_type is EngineCoreRequestType.START_DP_WAVE:
            new_wave, exclude_engine_index = request
            # A stale START (for a wave that has ended here) must not wake the rank.
            if exclude_engine_index != self.engine_index and new_wave >= self.current_wave:
                self.current_wave = new_wave
                self.engines_running = True
        else:
            super()._handle_client_request(request_type, request)

    def _add_request(self, request: EngineCoreRequest) -> None:
        if request.current_wave > self.current_wave:
            self.current_wave = request.current_wave
        elif request.current_wave < self.current_wave and not self.engines_running:
            # Sent for a wave that ended before it arrived: the frontend did not wake the other
            # ranks, so ask it to.
            self._send(start_wave=self.current_wave)
        # This rank wakes itself (the frontend's START_DP_WAVE skips it), even if the request is
        # rejected: its peers are waking and will expect its collectives.
        self.engines_running = True
        super()._add_request(request)
