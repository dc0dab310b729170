"""StepTracer: an engine's steps as step-trace records (--trace-steps), bound once when the
engine is built; NoStepTracer, the default, binds nothing.

minicore's own (vLLM's torch profiler is kernel-level, its OpenTelemetry spans are per request).
make_step_tracer, called by the composition root (minicore/engine/components.py), wraps what
exists when the engine is built, so that no step function asks whether tracing is on: the
scheduler's add_request and _finish (a request's track begins with the next step, ends with the
one that finished it), schedule (each step's tokens, preemptions, the balance gate's decision)
and update_from_output (drafts accepted, KV transfers), the runner's dummy batch and the DP
group's collectives (how long this rank waited in each). EngineCore.__init__ then binds the engine
itself (bind): the forward's time, a DP rank's waves (DPEngineCoreProc.current_wave, wave start
and end) and its shutdown, which writes and closes the file. The busy loop takes timestamps and
what a step's records need (no loop over the batch); the records are built on the writer's thread
(step_trace.py, which states the schema). A step that computed nothing is no record of its own:
what it has to say (the gate held, requests arrived or ended) goes into the dummy batch that
follows it, or, without one, into a step record with no tokens. Left out: elastic EP's re-formed
groups (refused with it: their collectives would go untimed).
"""

import time
from dataclasses import dataclass

from minicore.request import RequestStatus
from minicore.tracing.clock import clock_offset_us, machine_id
from minicore.tracing.step_trace import COLLECTIVES, STEPS, TraceWriter, overlap_records

# The DP group's collectives in a step (minicore/dp/group.py), each timed on the collectives track.
TIMED_COLLECTIVES = ("has_global_unfinished_reqs", "gather_running_counts", "max_running_count",
                     "max_step_time")
WAITING_FOR_FSM = RequestStatus.WAITING_FOR_FSM


class NoStepTracer:
    """Tracing off: nothing is wrapped."""

    def bind(self, engine) -> None:
        """Called once by EngineCore.__init__."""


@dataclass(slots=True)
class _Step:
    """One schedule() until its update: filled on the busy loop and the forward's thread."""
    start_ns: int
    arrived: list[tuple[str, int]]  # (request id, prompt tokens) added since the step before
    aborted: list[tuple[str, RequestStatus]]  # finished since the step before
    gate: bool
    scheduled_ns: int = 0  # schedule()'s end
    forward_ns: int = 0
    forward_start_ns: int = 0


@dataclass(slots=True)
class _Taken:
    """What a step's records need of its SchedulerOutput and ModelRunnerOutput, taken on the busy
    loop: held until written (up to WRITE_INTERVAL_S), those would keep a whole batch's objects
    alive, which measured slower than taking this."""
    tokens: dict[str, int]  # the scheduler's own: nothing changes it once schedule() returns it
    total: int
    new_ones: int  # new requests that schedule one token (a prompt's last, after a prefix hit)
    preempted: list[str]
    kv_transfers: dict
    num_drafts: int = 0
    draft_decodes: int = 0  # requests that schedule one token and their drafts
    proposed: int = 0
    accepted: int = 0


class StepTracer(NoStepTracer):
    def __init__(self, writer: TraceWriter, scheduler, model_runner):
        self.writer = writer
        self._scheduler = scheduler
        self._wave = lambda: 0  # a DP rank's current_wave once bound
        # The busy loop's: steps scheduled and not yet updated, by id(SchedulerOutput); requests
        # added, and finished, since the last step; whether the gate held this step; requests
        # whose grammar compiles; a step that computed nothing, kept for a dummy batch to take.
        self._steps: dict[int, _Step] = {}
        self._arrived: list[tuple[str, int]] = []
        self._ended: list[tuple[str, RequestStatus]] = []
        self._gate_held = False
        self._grammar: dict[str, object] = {}
        self._idle: tuple | None = None
        self._remote_kv = getattr(scheduler.remote_kv, "waiting_for_remote_kvs", {})
        self._num_proposed = getattr(scheduler.spec_decode, "num_proposed",
                                     lambda req_id, drafts, output: len(drafts))
        # The writer thread's: the open request tracks, the wave and its forwards, the end of
        # the last step record, the counters' last values.
        self._open: set[str] = set()
        self._wave_seen, self._forwards, self._last_end = 0, 0, 0.0
        self._counters: tuple = ()
        self._wrap_scheduler(scheduler)
        self._wrap_dummy_batch(model_runner)

    # ---- binding (construction only) -----------------------------------------------------------

    def bind(self, engine) -> None:
        engine.execute_model = self._timed_forward(engine.execute_model)
        shutdown = engine.shutdown

        def traced_shutdown() -> None:
            try:
                shutdown()
            finally:
                self._flush_idle()
                self.writer.close()

        engine.shutdown = traced_shutdown
        if hasattr(engine, "current_wave"):  # a DP rank
            self._bind_waves(engine)

    def wrap_collectives(self, dp_group) -> None:
        for name in TIMED_COLLECTIVES:
            setattr(dp_group, name, self._timed_collective(name, getattr(dp_group, name)))

    def _wrap_scheduler(self, scheduler) -> None:
        add_request, finish = scheduler.add_request, scheduler._finish
        schedule, update = scheduler.schedule, scheduler.update_from_output
        gated = scheduler._admission_gated

        def traced_add_request(request) -> None:
            add_request(request)
            self._arrived.append((request.request_id, request.num_prompt_tokens))
            if request.status is WAITING_FOR_FSM:
                self._grammar[request.request_id] = request

        def traced_finish(finished) -> None:
            finish(finished)
            self._ended += [(request.request_id, status) for request, status, _ in finished]

        def traced_gate() -> bool:
            if held := gated():
                self._gate_held = bool(scheduler.waiting)
            return held

        def traced_schedule():
            start = time.time_ns()
            if self._idle is not None:  # no dummy batch took it
                self._flush_idle()
            output = schedule()
            self._steps[id(output)] = _Step(start, self._arrived, self._ended, self._gate_held,
                                            time.time_ns())
            self._arrived, self._ended, self._gate_held = [], [], False
            return output

        def traced_update(scheduler_output, model_output):
            outputs = update(scheduler_output, model_output)
            if (step := self._steps.pop(id(scheduler_output), None)) is not None:
                done = (step, time.time_ns(), self._take(scheduler_output, model_output),
                        self._ended, self._wave(), *self._probe())
                self._ended = []
                if scheduler_output.total_num_scheduled_tokens:
                    self.writer.defer(self._step_records, *done)
                else:
                    self._flush_idle()
                    self._idle = done
            return outputs

        scheduler.add_request, scheduler._finish = traced_add_request, traced_finish
        scheduler.schedule, scheduler.update_from_output = traced_schedule, traced_update
        scheduler._admission_gated = traced_gate

    def _wrap_dummy_batch(self, runner) -> None:
        dummy_batch = runner.execute_dummy_batch

        def traced_dummy_batch() -> None:
            start = time.time_ns()
            dummy_batch()
            idle, self._idle = self._idle, None
            self.writer.defer(self._dummy_records, start, time.time_ns(), self._wave(), idle)

        runner.execute_dummy_batch = traced_dummy_batch

    def _timed_forward(self, execute_model):
        def traced_forward(scheduler_output):
            start = time.time_ns()
            output = execute_model(scheduler_output)
            if (step := self._steps.get(id(scheduler_output))) is not None:
                step.forward_start_ns, step.forward_ns = start, time.time_ns() - start
            return output

        return traced_forward

    def _timed_collective(self, name: str, collective):
        async def timed(*args):
            start = time.time_ns()
            result = await collective(*args)
            self.writer.defer(self._collective_records, name, start, time.time_ns())
            return result

        return timed

    def _bind_waves(self, engine) -> None:
        join_wave, end_wave = engine._join_wave, engine._end_wave
        self._wave = lambda: engine.current_wave

        def traced_join_wave(wave: int) -> None:
            running = engine.engines_running
            join_wave(wave)
            if not running:
                self.writer.instant("wave start", wave=engine.current_wave)

        def traced_end_wave() -> None:
            wave = engine.current_wave
            end_wave()
            self.writer.instant("wave end", wave=wave)

        engine._join_wave, engine._end_wave = traced_join_wave, traced_end_wave

    # ---- on the busy loop, once a step ---------------------------------------------------------

    def _take(self, so, mo) -> _Taken:
        tokens, new, kv = so.num_scheduled_tokens, so.scheduled_new_reqs, mo.kv_connector_output
        # Each test spares the common step (decodes alone, no connector) a call.
        taken = _Taken(tokens, so.total_num_scheduled_tokens,
                       sum(tokens[r.req_id] == 1 for r in new) if new else 0,
                       sorted(so.preempted_req_ids) if so.preempted_req_ids else [],
                       _kv_transfers(so.kv_connector_metadata, kv)
                       if so.kv_connector_metadata is not None or kv is not None else {})
        if drafts := so.scheduled_spec_decode_tokens:
            index, sampled = mo.req_id_to_index, mo.sampled_token_ids
            for req_id, ids in drafts.items():
                taken.num_drafts += len(ids)
                taken.draft_decodes += bool(ids) and tokens.get(req_id) == 1 + len(ids)
                taken.proposed += self._num_proposed(req_id, ids, mo)
                if (row := index.get(req_id)) is not None and sampled[row]:
                    taken.accepted += len(sampled[row]) - 1
        return taken

    def _probe(self) -> tuple:
        """What the step's records read of the scheduler after its update: KV usage, the request
        counts, the requests waiting for a grammar or for remote KV."""
        scheduler = self._scheduler
        if self._grammar:
            self._grammar = {i: r for i, r in self._grammar.items() if r.status is WAITING_FOR_FSM}
        return (scheduler.kv_cache_manager.usage, scheduler.get_request_counts(),
                list(self._grammar), list(self._remote_kv))

    def _flush_idle(self) -> None:
        if self._idle is not None:
            self.writer.defer(self._step_records, *self._idle)
            self._idle = None

    # ---- on the writer's thread ----------------------------------------------------------------

    def _us(self, ns: int) -> float:
        return ns / 1000 + self.writer.offset_us

    def _span(self, start_ns: int, end_ns: int) -> tuple[float, float]:
        """A step record's times: after the record before it (with async scheduling a step is
        scheduled while the one before runs)."""
        start, end = max(self._us(start_ns), self._last_end), self._us(end_ns)
        self._last_end = end
        return start, end

    def _index(self, wave: int, forward: bool) -> dict:
        """wave and step: the number of the wave's forward this record is, or precedes."""
        if wave != self._wave_seen:
            self._wave_seen, self._forwards = wave, 0
        self._forwards += forward
        return {"wave": wave, "step": self._forwards + (not forward)}

    def _step_records(self, step: _Step, end_ns: int, taken: _Taken, ended, wave: int,
                      usage: float, counts: tuple[int, int], grammar: list[str],
                      remote_kv: list[str]) -> list[dict]:
        start, end = self._span(step.start_ns, end_ns)
        records = self._tracks(step, ended, start, end)
        notes = _notes(step, taken)
        if not taken.total and not notes and not records:
            return []  # polled, nothing computed, nothing to say
        # A request the runner knew from a step before that schedules one token (and its
        # drafts) decodes; every other token is a prompt's, or after a preemption a recomputed
        # one's (a prompt's last chunk of one token counts as a decode): no loop over the batch.
        decode = (list(taken.tokens.values()).count(1) - taken.new_ones + taken.draft_decodes)
        args = {**self._index(wave, bool(taken.total)), "tokens": taken.tokens,
                "prefill_tokens": taken.total - decode - taken.num_drafts,
                "decode_tokens": decode, "draft_tokens": taken.num_drafts,
                "forward_ms": round(step.forward_ns / 1e6, 3), "preempted": [],
                "drafts_proposed": taken.proposed, "drafts_accepted": taken.accepted,
                "waiting_for_grammar": grammar, "waiting_for_remote_kv": remote_kv, **notes}
        records.append({"ph": "X", "name": "step", "ts": start, "dur": end - start,
                        "tid": STEPS, "args": args})
        records += overlap_records(args["step"], (self._us(step.start_ns), self._us(
            step.scheduled_ns)), (self._us(step.forward_start_ns), self._us(
                step.forward_start_ns + step.forward_ns)))
        return records + self._counter_records(end, usage, counts)

    def _dummy_records(self, start_ns: int, end_ns: int, wave: int, idle: tuple | None
                       ) -> list[dict]:
        """A dummy batch, with what the step before it, which computed nothing, has to say."""
        forward_ms = round((end_ns - start_ns) / 1e6, 3)
        if idle is None:
            start, end = self._span(start_ns, end_ns)
            records, notes, counters = [], {}, []
        else:
            step, _, taken, ended, _, usage, counts, grammar, remote_kv = idle
            start, end = self._span(step.start_ns, end_ns)
            records = self._tracks(step, ended, start, end)
            notes = _notes(step, taken) | {
                key: ids for key, ids in (("waiting_for_grammar", grammar),
                                          ("waiting_for_remote_kv", remote_kv)) if ids}
            counters = self._counter_records(end, usage, counts)
        records.append({"ph": "X", "name": "dummy batch", "ts": start, "dur": end - start,
                        "tid": STEPS, "args": {**self._index(wave, True),
                                               "forward_ms": forward_ms, **notes}})
        return records + counters

    def _collective_records(self, name: str, start_ns: int, end_ns: int) -> list[dict]:
        start, end = self._us(start_ns), self._us(end_ns)
        return [{"ph": "X", "name": name, "ts": start, "dur": end - start, "tid": COLLECTIVES,
                 "args": {"waited_ms": round((end_ns - start_ns) / 1e6, 3)}}]

    def _tracks(self, step: _Step, ended, start: float, end: float) -> list[dict]:
        """Request tracks: begun by the requests that arrived since the step before, ended at
        its start by those aborted meanwhile, at its end by those it finished."""
        self._open.update(req_id for req_id, _ in step.arrived)
        records = [_track("b", req_id, start, prompt_tokens=n) for req_id, n in step.arrived]
        for ts, finished in ((start, step.aborted), (end, ended)):
            for req_id, status in finished:
                if req_id in self._open:
                    self._open.remove(req_id)
                    reason = RequestStatus.get_finished_reason(status)
                    records.append(_track("e", req_id, ts, finish_reason=str(reason)))
        return records

    def _counter_records(self, ts: float, usage: float, counts: tuple[int, int]) -> list[dict]:
        """kv_usage and requests, where they changed."""
        usage, (running, waiting) = round(usage, 4), counts
        before, self._counters = self._counters, (usage, running, waiting)
        records = []
        if not before or before[0] != usage:
            records.append({"ph": "C", "name": "kv_usage", "ts": ts, "args": {"usage": usage}})
        if not before or before[1:] != (running, waiting):
            records.append({"ph": "C", "name": "requests", "ts": ts,
                            "args": {"running": running, "waiting": waiting}})
        return records


def _notes(step: _Step, taken: _Taken) -> dict:
    """What a step says besides its tokens: the gate held, preemptions, KV transfers."""
    notes: dict = {"gate": "hold"} if step.gate else {}
    if taken.preempted:
        notes["preempted"] = taken.preempted
    if taken.kv_transfers:
        notes["kv_transfers"] = taken.kv_transfers
    return notes


def _track(ph: str, req_id: str, ts: float, **args) -> dict:
    return {"ph": ph, "cat": "request", "id": req_id, "name": f"request {req_id}", "ts": ts,
            "args": args}


def _kv_transfers(metadata, kv_output) -> dict:
    """What a KV connector started this step (NixlConnector's metadata: reads, blocks held for a
    peer) and what its worker side finished, by vLLM's field names; {} if nothing."""
    transfers = {}
    for key, ids in (("reqs_to_recv", getattr(metadata, "reqs_to_recv", None)),
                     ("reqs_to_send", getattr(metadata, "reqs_to_send", None)),
                     ("finished_recving", getattr(kv_output, "finished_recving", None)),
                     ("finished_sending", getattr(kv_output, "finished_sending", None))):
        if ids:
            transfers[key] = sorted(ids)
    if invalid := getattr(kv_output, "invalid_block_ids", None):
        transfers["invalid_block_ids"] = len(invalid)
    return transfers


# ---- construction ------------------------------------------------------------------------------

def make_step_tracer(config, scheduler, model_runner, dp_group=None) -> NoStepTracer:
    """A StepTracer writing to --trace-steps, or NoStepTracer without it. A DP rank first meets
    its peers (every rank, traced alike: the engine fingerprint compares it): the first rank of
    each machine replaces the file before the others open it, and a rank on another machine than
    rank 0 measures its clock against rank 0's."""
    oc = config.observability_config
    if oc.trace_steps is None:
        return NoStepTracer()
    if config.parallel_config.enable_elastic_ep:
        raise ValueError("--trace-steps with --enable-elastic-ep is not supported: a re-formed DP "
                         "group's collectives would go untimed")
    rank = config.parallel_config.data_parallel_rank

    def open_writer(fresh: bool) -> TraceWriter:
        try:
            return TraceWriter(oc.trace_steps, rank, f"DP rank {rank}", oc.trace_steps_limit,
                               fresh)
        except OSError as e:
            raise ValueError(f"--trace-steps {oc.trace_steps}: {e}") from None

    if dp_group is None:
        writer = open_writer(True)
    else:
        machines = dp_group.all_gather_json(machine_id())
        first = open_writer(True) if machines.index(machines[rank]) == rank else None
        offset_us = clock_offset_us(dp_group)
        writer = first or open_writer(False)
        writer.set_clock_offset(0.0 if machines[rank] == machines[0] else offset_us)
    tracer = StepTracer(writer, scheduler, model_runner)
    if dp_group is not None:
        tracer.wrap_collectives(dp_group)
    return tracer
