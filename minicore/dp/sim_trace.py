"""The DP simulator's step trace: what each simulated rank did, step by step, in the step trace's
schema (minicore/tracing/step_trace.py), on the simulated clock.

minicore's own, as the simulator is (minicore/dp/simulator.py). One TraceWriter per simulated rank,
as one per engine rank process: pid N named ``DP rank N``, each bounded at ``limit`` records. Times
are simulated microseconds from 0. Each lockstep step gives every rank its step (or dummy batch)
lasting its own cost, then on its collectives track the wait for the slowest rank
(``max_step_time``, the simulated runner's all-reduce in minicore/dp/engine.py); its
``kv_usage`` and ``requests`` counters at the step's end, where they changed; ``wave start`` and
``wave end`` instants; and each request an async track from the step it reached its rank to the
step it finished in. As the engine's tracer marks them, a step's gate is ``hold`` when the gate
was shut while the rank had waiting requests (and no preemption, which skips the gate), and
drafts_proposed and drafts_accepted are the draft tokens it verified and accepted. Left out: the
collectives' own cost, the every-32-steps all-reduce and the count gather (the simulator gives
them no time); grammars and remote KV, which the simulator has not (no request waits for them).
"""

from __future__ import annotations

from pathlib import Path

from minicore.tracing.step_trace import COLLECTIVES, DEFAULT_LIMIT, STEPS, TraceWriter


class NoSimTrace:
    """Tracing off, the simulator's default: each hook, called once a step, does nothing."""

    def scheduled(self, sim, outputs, gated: bool) -> None:
        pass

    def stepped(self, sim, start: float, outputs, costs) -> None:
        pass

    def close(self) -> None:
        pass


NO_TRACE = NoSimTrace()


class _SimClockWriter(TraceWriter):
    """A TraceWriter whose own time (its ``trace truncated`` mark's) is the simulated clock."""
    clock_us = 0.0

    def now(self) -> float:
        return self.clock_us


class SimTrace(NoSimTrace):
    """Writes a simulator run's trace to ``path``, which it replaces (a run is its only writer)."""

    def __init__(self, path: str | Path, dp_size: int, limit: int = DEFAULT_LIMIT):
        Path(path).unlink(missing_ok=True)
        self.writers = [_SimClockWriter(path, rank, f"DP rank {rank}", limit)
                        for rank in range(dp_size)]
        self.wave, self.step, self.in_wave = 0, 0, False
        self.num_sent = 0  # requests of the workload whose tracks have begun
        self.held = [False] * dp_size
        self.spec_counts = [(0, 0)] * dp_size  # per rank: draft tokens verified, accepted
        self.counters: list[tuple | None] = [None] * dp_size  # per rank: the last ones written

    def scheduled(self, sim, outputs, gated: bool) -> None:
        """Right after the ranks scheduled, before the step's arrivals are taken in: which ranks
        the gate held."""
        self.held = [gated and not so.preempted_req_ids and len(rank.scheduler.waiting) > 0
                     for rank, so in zip(sim.ranks, outputs)]

    def stepped(self, sim, start: float, outputs, costs) -> None:
        """After the lockstep step from ``start`` to ``sim.now``: every rank's records."""
        start_us, end_us = _us(start), _us(sim.now)
        self.step += 1
        if not self.in_wave:
            self.in_wave = True
            self._instant("wave start", start_us)
        for request in sim.workload[self.num_sent:sim.next_to_send]:
            # Sent when this step began; on its rank from then (taken in before or after the
            # rank scheduled).
            self.writers[request.rank].emit(
                {"ph": "b", "cat": "request", "id": str(request.index),
                 "name": f"request {request.index}", "ts": _us(request.send_time),
                 "args": {"prompt_tokens": len(request.prompt_token_ids),
                          "max_tokens": request.output_len}})
        self.num_sent = sim.next_to_send
        for index, (rank, so, (seconds, num_prefill)) in enumerate(zip(sim.ranks, outputs, costs)):
            writer, scheduler = self.writers[index], rank.scheduler
            writer.clock_us = end_us
            forward_end = start_us + _us(seconds)
            self._rank_step(index, scheduler, so, start_us, forward_end, num_prefill)
            writer.complete("max_step_time", forward_end, end_us, COLLECTIVES,
                            waited_ms=round((end_us - forward_end) / 1e3, 3))
            self._counters(index, scheduler, end_us)
            for req_id in so.num_scheduled_tokens:
                if req_id not in scheduler.requests:  # finished in this step, at max_tokens
                    writer.emit({"ph": "e", "cat": "request", "id": req_id,
                                 "name": f"request {req_id}", "ts": end_us,
                                 "args": {"finish_reason": "length"}})
        if not sim.engines_running:
            self._instant("wave end", end_us)
            self.wave, self.step, self.in_wave = self.wave + 1, 0, False

    def _rank_step(self, index: int, scheduler, so, start_us: float, end_us: float,
                   num_prefill: int) -> None:
        """One rank's step record: a step with its tokens by kind, or a dummy batch."""
        args = {"wave": self.wave, "step": self.step}
        if self.held[index]:
            args["gate"] = "hold"
        forward_ms = round((end_us - start_us) / 1e3, 3)
        preempted = sorted(so.preempted_req_ids)
        if not so.total_num_scheduled_tokens:
            if preempted:
                args["preempted"] = preempted
            self.writers[index].complete("dummy batch", start_us, end_us, forward_ms=forward_ms,
                                         **args)
            return
        num_drafts = sum(map(len, so.scheduled_spec_decode_tokens.values()))
        stats = scheduler.spec_decode.stats
        counts = (stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0)
        before, self.spec_counts[index] = self.spec_counts[index], counts
        proposed, accepted = counts[0] - before[0], counts[1] - before[1]
        self.writers[index].complete(
            "step", start_us, end_us, **args, tokens=dict(so.num_scheduled_tokens),
            prefill_tokens=num_prefill,
            decode_tokens=so.total_num_scheduled_tokens - num_prefill - num_drafts,
            draft_tokens=num_drafts, forward_ms=forward_ms, preempted=preempted,
            drafts_proposed=proposed, drafts_accepted=accepted, waiting_for_grammar=[],
            waiting_for_remote_kv=[])

    def _counters(self, index: int, scheduler, ts: float) -> None:
        """A rank's kv_usage and requests counters, where they changed."""
        usage = round(scheduler.kv_cache_manager.usage, 4)
        running, waiting = scheduler.get_request_counts()
        before, self.counters[index] = self.counters[index], (usage, running, waiting)
        if before is None or before[0] != usage:
            self.writers[index].counter("kv_usage", ts, usage=usage)
        if before is None or before[1:] != (running, waiting):
            self.writers[index].counter("requests", ts, running=running, waiting=waiting)

    def _instant(self, name: str, ts: float) -> None:
        for writer in self.writers:
            writer.emit({"ph": "i", "name": name, "ts": ts, "tid": STEPS, "s": "t",
                         "args": {"wave": self.wave}})

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def _us(seconds: float) -> float:
    """Simulated seconds as the trace's microseconds, to the nanosecond (no float dust)."""
    return round(seconds * 1e6, 3)
