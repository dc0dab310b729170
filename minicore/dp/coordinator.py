"""DPCoordinator: the frontend's picture of the DP engines: how loaded each is, and the wave.

Mirrors DPCoordinatorProc (vllm/v1/engine/coordinator.py: the engines' request counts, the wave
number, START_DP_WAVE) and the engine choice of DPLBAsyncMPClient (vllm/v1/engine/core_client.py).
vLLM runs its coordinator as a process of its own, which gathers the engines' counts and publishes
them to every API server; minicore's engines send every frontend their counts and wave news
(minicore/engine/client_router.py), so the coordinator is an object on each frontend's event loop
that its DPLBAsyncMPClient (minicore/dp/client.py) consults as it sends requests and reads engine
outputs. It never does IO: it returns the START_DP_WAVE (wave, engine to skip) for the client to
broadcast (several frontends may send the same one: an engine takes a wave's start once).

Load: an engine's score is 4 * waiting + running, from the counts in its newest output frame, plus
the requests sent to it that the engine had not yet received when it made that frame (every frame
says how many of this frontend's it has received), so a burst spreads out before any engine
answers.
Liveness: EngineWatchdog (any number of engines, one alone too) turns the client dead when an
engine stops answering, which no socket or process watch sees: a hung or SIGSTOPped engine, and in
a DP wave every rank that waits for it in a collective, until gloo's own timeout (300 s).
Left out: elastic scaling.
"""

import asyncio
import os
import time
from collections.abc import Callable

from minicore.protocol import EngineCoreOutputs

# vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S (vllm/envs.py), with its default: how long an engine may
# send nothing, though asked, before the frontend declares it hung. 0 turns the watch off.
ITERATION_TIMEOUT_ENV = "MINICORE_ENGINE_ITERATION_TIMEOUT_S"
DEFAULT_ITERATION_TIMEOUT_S = 60.0
# Checks per timeout: each adds its interval to how late a hang can be declared.
TICKS_PER_TIMEOUT = 10


class DPCoordinator:
    def __init__(self, num_engines: int):
        self.num_engines = num_engines
        # The wave the engines are in (or, while they are paused, the next one) and whether it runs.
        self.current_wave = 0
        self.engines_running = False
        self.num_waiting = [0] * num_engines
        self.num_running = [0] * num_engines
        self.num_sent = [0] * num_engines
        self.num_received = [0] * num_engines
        # The engines a request may go to unless it names one: all but those an elastic scale
        # down is draining.
        self.selectable = range(num_engines)

    def resize(self, num_engines: int) -> None:
        """After an elastic scale: engines added (nothing known of them yet) or removed."""
        for counts in (self.num_waiting, self.num_running, self.num_sent, self.num_received):
            resize_list(counts, num_engines, 0)
        self.num_engines, self.selectable = num_engines, range(num_engines)

    def score(self, engine_index: int) -> int:
        in_flight = self.num_sent[engine_index] - self.num_received[engine_index]
        return 4 * (self.num_waiting[engine_index] + in_flight) + self.num_running[engine_index]

    def select_engine(self, data_parallel_rank: int | None = None) -> int:
        """The engine for a new request: the explicit rank if given, else the least loaded
        (the lowest index among equals). Counts the request as sent to it."""
        if data_parallel_rank is None:
            data_parallel_rank = min(self.selectable, key=self.score)
        self.num_sent[data_parallel_rank] += 1
        return data_parallel_rank

    def on_request_sent(self, engine_index: int) -> tuple[int, int] | None:
        """A request went to engine_index: while the engines are paused it starts a wave, and the
        others must be told (START_DP_WAVE (wave, engine_index): the engine with the request
        wakes itself)."""
        if self.engines_running:
            return None
        self.engines_running = True
        return self.current_wave, engine_index

    def on_outputs(self, outputs: EngineCoreOutputs) -> tuple[int, int] | None:
        """Take an engine frame's counts and wave news; returns a START_DP_WAVE to broadcast
        when an engine got a request for a wave that had already ended."""
        engine = outputs.engine_index
        if (stats := outputs.scheduler_stats) is not None:
            self.num_waiting[engine] = stats.num_waiting_reqs
            self.num_running[engine] = stats.num_running_reqs
            self.num_received[engine] = outputs.num_received_requests
        if (wave := outputs.wave_complete) is not None:
            if wave >= self.current_wave:
                self.current_wave = wave + 1
                self.engines_running = False
        elif (wave := outputs.start_wave) is not None:
            if wave > self.current_wave or (wave == self.current_wave and not self.engines_running):
                self.current_wave = wave
                self.engines_running = True
                return wave, engine
        return None


def make_watchdog(num_engines: int, ping: Callable[[int], None],
                  frames_pending: Callable[[], bool],
                  on_hung: Callable[[str], None]) -> "EngineWatchdog | NoWatchdog":
    """The client's watchdog, by MINICORE_ENGINE_ITERATION_TIMEOUT_S (chosen once, at startup)."""
    value = os.environ.get(ITERATION_TIMEOUT_ENV, str(DEFAULT_ITERATION_TIMEOUT_S))
    try:
        timeout_s = float(value)
    except ValueError:
        timeout_s = -1.0
    if not 0 <= timeout_s < float("inf"):
        raise ValueError(f"{ITERATION_TIMEOUT_ENV} must be a number of seconds (0: no watchdog), "
                         f"not {value!r}")
    if timeout_s == 0:
        return NoWatchdog(num_engines)
    return EngineWatchdog(num_engines, timeout_s, ping, frames_pending, on_hung)


def resize_list(values: list, length: int, fill) -> None:
    """values cut or padded with fill to length, in place (others hold the same list)."""
    del values[length:]
    values.extend([fill] * (length - len(values)))


class NoWatchdog:
    """MINICORE_ENGINE_ITERATION_TIMEOUT_S=0: nothing is watched (an engine under a debugger)."""

    def __init__(self, num_engines: int):
        self.last_frame = [0.0] * num_engines

    def resize(self, num_engines: int) -> None:
        resize_list(self.last_frame, num_engines, 0.0)

    def start(self) -> None:
        """Nothing to watch."""

    def stop(self) -> None:
        """Nothing to stop."""


class EngineWatchdog:
    """Declares engines hung when they send nothing for timeout_s, not even the answer to a ping.

    An engine sends a frame after every step it takes with requests, so one that has work is never
    quiet for long; one that is idle, or runs only dummy batches in a DP wave, legitimately sends
    nothing. Rather than guess which engines ought to be stepping (the load counts can be stale:
    an ADD and its ABORT taken together change no stats, so no frame says so), the watchdog pings
    an engine once it has been quiet for a quarter of the timeout: its busy loop answers within an
    iteration, idle or not. A ping unanswered for timeout_s means that no iteration ended in that
    time: a hang, declared timeout_s to 1.5 * timeout_s after it began. So the timeout must stay
    above the longest step (a big prefill on a CPU). In a DP wave the ranks wait for a hung one in
    their collectives and go quiet with it: the reason names every rank whose ping has gone
    unanswered for half the timeout, which the frontend cannot tell apart.
    """

    def __init__(self, num_engines: int, timeout_s: float, ping: Callable[[int], None],
                 frames_pending: Callable[[], bool], on_hung: Callable[[str], None]):
        self.timeout_s = timeout_s
        # When the client read each engine's newest frame (time.monotonic()): the client writes
        # it, the watchdog's one cost per frame.
        self.last_frame = [0.0] * num_engines
        # When each engine was last pinged; a ping older than its newest frame has been answered.
        self._pinged = [-float("inf")] * num_engines
        self._ping = ping
        self._frames_pending = frames_pending
        self._on_hung = on_hung
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        """Watch from now on (the engines' startup is the startup timeout's)."""
        self.last_frame[:] = [time.monotonic()] * len(self.last_frame)
        self._schedule()

    def resize(self, num_engines: int) -> None:
        """After an elastic scale: an engine added is watched from now on."""
        resize_list(self.last_frame, num_engines, time.monotonic())
        resize_list(self._pinged, num_engines, -float("inf"))

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _schedule(self) -> None:
        self._timer = asyncio.get_running_loop().call_later(
            self.timeout_s / TICKS_PER_TIMEOUT, self._tick)

    def _tick(self) -> None:
        now = time.monotonic()
        for engine, last in enumerate(self.last_frame):
            if self._pinged[engine] < last and now - last >= self.timeout_s / 4:
                self._pinged[engine] = now
                self._ping(engine)
        unanswered = {engine: now - pinged for engine, pinged in enumerate(self._pinged)
                      if pinged > self.last_frame[engine]}
        # Frames waiting to be read mean that the frontend's loop is behind, not the engines.
        if max(unanswered.values(), default=0) >= self.timeout_s and not self._frames_pending():
            self._on_hung(self._reason(unanswered))
        elif self._timer is not None:  # not stopped meanwhile, by a ping whose send failed
            self._schedule()

    def _reason(self, unanswered: dict[int, float]) -> str:
        seconds = max(unanswered.values())
        stalled = [engine for engine, age in unanswered.items() if age >= self.timeout_s / 2]
        setting = f"{ITERATION_TIMEOUT_ENV}={self.timeout_s:g}"
        if len(stalled) == 1:
            return (f"engine core {stalled[0]} made no progress for {seconds:.1f} s: it sent "
                    f"nothing, not even the answer to a ping (hung? {setting})")
        return (f"engine cores {', '.join(map(str, stalled))} made no progress for {seconds:.1f} "
                f"s: none sent anything, not even the answer to a ping (one hung, the others "
                f"waiting for it in a collective? {setting})")
