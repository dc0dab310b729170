"""DPCoordinator: the frontend's picture of the DP engines: how loaded each is, and the wave.

Mirrors DPCoordinatorProc (vllm/v1/engine/coordinator.py: the engines' request counts, the wave
number, START_DP_WAVE) and the engine choice of DPLBAsyncMPClient (vllm/v1/engine/core_client.py).
vLLM runs its coordinator as a process of its own because several API server processes share it;
minicore has one frontend, so the coordinator is an object on the frontend's event loop that
DPLBAsyncMPClient (minicore/engine/core_client.py) consults as it sends requests and reads engine
outputs. It never does IO: it returns the START_DP_WAVE (wave, engine to skip) for the client to
broadcast. The frontend's wave state lives here only; the engines' in DPEngineCoreProc.

Load: an engine's score is 4 * waiting + running, from the counts in its newest output frame, plus
the requests sent to it that the engine had not yet received when it made that frame (every frame
says how many it has received), so a burst spreads out before any engine answers.
Left out: several frontends, elastic scaling.
"""

from minicore.protocol import EngineCoreOutputs


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

    def score(self, engine_index: int) -> int:
        in_flight = self.num_sent[engine_index] - self.num_received[engine_index]
        return 4 * (self.num_waiting[engine_index] + in_flight) + self.num_running[engine_index]

    def select_engine(self, data_parallel_rank: int | None = None) -> int:
        """The engine for a new request: the explicit rank if given, else the least loaded
        (the lowest index among equals). Counts the request as sent to it."""
        if data_parallel_rank is None:
            data_parallel_rank = min(range(self.num_engines), key=self.score)
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
