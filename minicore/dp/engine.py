"""DPEngineCoreProc: one data-parallel rank, an EngineCoreProc whose busy loop keeps step with its
peers.

Mirrors DPEngineCoreProc in vllm/v1/engine/core.py with the balance gather of vllm-ascend's
BalanceDPEngineCoreProc.run_busy_loop (PR #5212), as a coroutine. Each rank has its own scheduler,
KV cache and model replica; ranks meet only in the collectives of minicore/dp/group.py, and, with
expert parallelism (--enable-expert-parallel), inside the model's forward.

The rule that keeps ranks from hanging: every rank issues the same DP-group collectives in the
same order, one at a time, all from this busy loop. One iteration of a running wave issues:
  1. exactly one forward: the step's or, with nothing scheduled, a dummy batch (minicore/dp/wave.py
     says when); with expert parallelism every forward meets the peers in every MoE layer, and
     with a runner that reports a step time (the simulated one) max_step_time follows it;
  2. every 32nd step of the wave: has_global_unfinished_reqs, which can end the wave;
  3. with balance scheduling: the running counts (all-gather or all-reduce MAX), on every
     iteration, dummy ones included (inside schedule() a drained rank would never reach it).
Waves, and why each rule holds: docs/DATA_PARALLEL.md; the frontend's side: DPCoordinator
(minicore/dp/coordinator.py). Elastic EP re-forms the group between waves (dp/elastic_ep.py).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import zmq
import zmq.asyncio

from minicore.dp.group import DPGroup
from minicore.dp.wave import is_sync_step, runs_dummy_batch
from minicore.engine.core_proc import HANDSHAKE_TIMEOUT_S, EngineCoreProc
from minicore.protocol import EngineCoreRequestType

if TYPE_CHECKING:
    from minicore.config import EngineConfig
    from minicore.engine.components import EngineComponents

logger = logging.getLogger(__name__)


class DPEngineCoreProc(EngineCoreProc):
    def __init__(self, config: "EngineConfig",
                 build_components: "Callable[..., EngineComponents]", handshake_address: str,
                 engine_index: int, handshake_timeout: float = HANDSHAKE_TIMEOUT_S):
        # Steps of the current wave, for the every-32-steps sync.
        self.step_counter = 0
        self.current_wave = 0
        # True from a wave's first request (or START_DP_WAVE) to the sync that ends it.
        self.engines_running = False
        self.dp_rank = config.parallel_config.data_parallel_rank = engine_index  # its own copy
        self.balance = config.scheduler_config.balance_scheduling
        self.count_sync = config.scheduler_config.balance_count_sync
        self.dp_group: DPGroup | None = None
        self._monitor: zmq.Socket | None = None
        # Bound once: the balance gate's count sync after every step (none without the gate).
        self._sync_balance_counts = self._choose_balance_count_sync()
        # The root checks this rank's config against its peers' and shards its experts first.
        super().__init__(config, lambda c: build_components(c, dp_group=self.dp_group),
                         handshake_address, engine_index, handshake_timeout)
        # For a runner whose forwards report a step time: forwards kept in lockstep.
        if self.runner_info.reports_step_time:
            self._run_forward = self._run_forward_in_lockstep

    def _init_data_parallel(self, config: "EngineConfig") -> None:
        pc = config.parallel_config
        self.dp_group = DPGroup(self.dp_rank, pc.data_parallel_size, pc.data_parallel_address,
                                pc.data_parallel_rpc_port, timeout_s=HANDSHAKE_TIMEOUT_S)

    def close(self, fatal: bool) -> None:
        if self.dp_group is not None:
            self.dp_group.destroy()
        if self._monitor is not None:
            # An open socket would hold up the context's termination forever.
            self._input_sockets[0].disable_monitor()
            self._monitor.close(linger=0)
        super().close(fatal)

    async def run(self) -> None:
        # A rank on another machine has no frontend parent to watch: it stops when the
        # frontend's end of its input socket goes away.
        self._monitor = self._input_sockets[0].get_monitor_socket(zmq.EVENT_DISCONNECTED)
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
        while not self.shutdown_requested:
            await self._process_input_queue()
            if self.shutdown_requested:
                return
            executed = await self._process_engine_step()
            # Requests to compute keep the wave going (vLLM's rule); blocks a KV connector holds
            # for a peer do not: the rank polls them alone between waves (_wait_for_input).
            local_unfinished_reqs = self.scheduler.has_unfinished_requests()
            if not executed:
                # A step that ran sent its stats; one skipped may leave inputs' changes unsent.
                self._publish_stats_if_changed()
            if runs_dummy_batch(executed, local_unfinished_reqs, self.engines_running):
                await self._run_forward(self.model_runner.execute_dummy_batch)
            elif not executed:
                continue  # every rank is idle
            self.engines_running = await self._has_global_unfinished_reqs(local_unfinished_reqs)
            await self._sync_balance_counts()
            if not self.engines_running:
                self._end_wave()

    def _end_wave(self) -> None:
        # Every rank says so (vLLM's rank 0 alone): with external or hybrid load balancing a
        # frontend hears only its own ranks. A frontend takes the first of the same news.
        logger.debug("Wave %d finished, pausing engine loop.", self.current_wave)
        self._send(wave_complete=self.current_wave)
        self.current_wave += 1
        self.step_counter = 0

    async def _process_input_queue(self) -> None:
        """Wait while every rank is idle (this one stepping alone, now and then, while it only
        holds a KV connector's work); then take all pending inputs."""
        while not self.engines_running and not self.scheduler.has_unfinished_requests():
            if self.shutdown_requested:
                return
            if not await self._wait_for_input():
                break
        self._drain_input_queue()

    async def _run_forward_in_lockstep(self, fn, *args):
        """_run_forward for a runner whose forwards report a step time (the simulated one): a
        forward (or dummy batch), then a wait, in lockstep, for the slowest rank's step time. Only
        a forward that ran a batch reports one, so every rank issues max_step_time exactly once
        per iteration of a running wave."""
        output = await super()._run_forward(fn, *args)
        if (step := self.model_runner.pop_step_time()) is not None:
            start, seconds = step
            seconds = await self.dp_group.max_step_time(seconds)
            await super()._run_forward(time.sleep, max(0.0, start + seconds - time.perf_counter()))
        return output

    def _choose_balance_count_sync(self):
        """How the balance gate learns the ranks' running counts after each step, by
        --balance-count-sync; without balance scheduling, no collective."""
        if not self.balance:
            return self._skip_balance_counts
        if self.count_sync == "all-reduce-max":
            return self._max_running_count
        return self._gather_running_counts

    async def _skip_balance_counts(self) -> None:
        """Without balance scheduling: no collective, no counts."""

    async def _gather_running_counts(self) -> None:
        self.scheduler.balance_counts = await self.dp_group.gather_running_counts(
            len(self.scheduler.running))

    async def _max_running_count(self) -> None:
        # The gate reads only max(balance_counts): the maximum alone decides the same.
        self.scheduler.balance_counts = [
            await self.dp_group.max_running_count(len(self.scheduler.running))]

    async def _has_global_unfinished_reqs(self, local_unfinished: bool) -> bool:
        self.step_counter += 1
        if not is_sync_step(self.step_counter):
            return True
        return await self.dp_group.has_global_unfinished_reqs(local_unfinished)

    # ---- inputs --------------------------------------------------------------------------------

    def _handle_client_request(self, request_type, request) -> None:
        if request_type is EngineCoreRequestType.START_DP_WAVE:
            new_wave, exclude_engine_index = request
            # A stale START (for a wave that has ended here) must not wake the rank.
            if exclude_engine_index != self.engine_index and new_wave >= self.current_wave:
                self._join_wave(new_wave)
        else:
            super()._handle_client_request(request_type, request)

    def _on_request_arrived(self, current_wave: int) -> None:
        # This rank wakes itself (the frontend's START_DP_WAVE skips it), even if the request is
        # rejected: its peers are waking and will expect its collectives.
        self._join_wave(current_wave)
        super()._on_request_arrived(current_wave)

    def _join_wave(self, wave: int) -> None:
        """Step in this wave (or the newer one this rank is in). Woken from idle, it tells every
        client: its waker may not have woken every rank (a request sent for a wave that ended
        before it arrived; a frontend that reaches only some ranks, with external or hybrid load
        balancing, whose wave coordinator then wakes the rest)."""
        self.current_wave = max(self.current_wave, wave)
        if not self.engines_running:
            self._send(start_wave=self.current_wave)
            self.engines_running = True
