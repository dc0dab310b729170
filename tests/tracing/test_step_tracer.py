"""--trace-steps on one engine (minicore/tracing/step_tracer.py) and the writer's bound
(step_trace.py): an offline LLM's trace holds its steps (tokens by kind, forward time), the
kv_usage and requests counters and every request's track, inside the steps, and a dummy batch
after a sleep (sleep mode puts the tracer's wrap back on waking); a balance-gated scheduler driven
step by step (minicore.testing) shows drafts proposed and accepted, a preemption, the gate's
holds, a step that computed nothing told by the dummy batch after it, and an abort; the writer
keeps to its limit in records, marks the cut, replaces a stale file when told and appends
otherwise. The DP=2 expert-parallel trace, with the balance gate, is checked in
tests/dp/test_expert_parallel_serving.py."""

from collections import Counter
from types import SimpleNamespace

import pytest

from minicore.llm import LLM
from minicore.request import RequestStatus
from minicore.sampling_params import SamplingParams
from minicore.scheduler.balance import BalanceScheduler
from minicore.spec_decode.config import SpeculativeConfig
from minicore.testing import make_request, make_scheduler, propose, step
from minicore.tracing.step_trace import FORWARD, SCHEDULE, STEPS, TraceWriter, read_trace
from minicore.tracing.step_tracer import StepTracer

PROMPTS = [[5 + i, 17, 23, 42, 7 + 3 * i] * (2 + i) for i in range(3)]
MAX_TOKENS = [6, 3, 9]


def inside(ts: float, steps: list[dict]) -> bool:
    # A track begins at a step's start or ends at its end: equal up to the float sum's rounding.
    return any(s["ts"] - 1e-3 <= ts <= s["ts"] + s["dur"] + 1e-3 for s in steps)


@pytest.mark.model
def test_an_offline_llm_traces_its_steps_counters_and_requests(hf_model_and_tokenizer, tmp_path):
    model, tokenizer = hf_model_and_tokenizer
    path = tmp_path / "llm.trace.json"
    path.write_text("stale")  # replaced, not appended to
    llm = LLM(model, tokenizer=tokenizer, max_model_len=128, kv_cache_memory=32 << 20,
              trace_steps=str(path))
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in MAX_TOKENS]
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    llm.sleep(1)
    llm.wake_up()
    llm.llm_engine.model_runner.execute_dummy_batch()
    llm.llm_engine.shutdown()  # writes what is queued and closes the file
    records = read_trace(path)

    assert {r["pid"] for r in records} == {0}
    assert [r["args"]["name"] for r in records if r["name"] == "process_name"] == ["DP rank 0"]
    *steps, dummy = [r for r in records if r["ph"] == "X" and r["tid"] == STEPS]
    assert steps and {s["name"] for s in steps} == {"step"}
    assert dummy["name"] == "dummy batch" and dummy["args"]["step"] == len(steps) + 1
    assert [s["args"]["step"] for s in steps] == list(range(1, len(steps) + 1))
    assert all(s["args"]["wave"] == 0 and s["args"]["forward_ms"] > 0 for s in steps)
    assert all(s["ts"] + s["dur"] <= t["ts"] for s, t in zip(steps, steps[1:]))
    # Every prompt token is computed once, as a prefill; every output token but the last once,
    # as a decode; the tokens per request add up the same.
    assert sum(s["args"]["prefill_tokens"] for s in steps) == sum(map(len, PROMPTS))
    assert sum(s["args"]["decode_tokens"] for s in steps) == sum(n - 1 for n in MAX_TOKENS)
    per_request = Counter()
    for s in steps:
        per_request.update(s["args"]["tokens"])
        assert s["args"]["draft_tokens"] == s["args"]["drafts_proposed"] == 0
        assert s["args"]["preempted"] == s["args"]["waiting_for_grammar"] == []
        assert "gate" not in s["args"] and "kv_transfers" not in s["args"]
    assert per_request == {str(i): len(p) + n - 1 for i, (p, n) in
                           enumerate(zip(PROMPTS, MAX_TOKENS))}

    # Each step's schedule() and forward on their own tracks, in order, inside the step.
    for tid, name in ((SCHEDULE, "schedule"), (FORWARD, "forward")):
        parts = [r for r in records if r["ph"] == "X" and r["tid"] == tid]
        assert [(p["name"], p["args"]["step"]) for p in parts] == [
            (name, s["args"]["step"]) for s in steps]
        assert all(s["ts"] <= p["ts"] and p["ts"] + p["dur"] <= s["ts"] + s["dur"] + 1
                   for s, p in zip(steps, parts))

    usage = [r["args"]["usage"] for r in records if r["ph"] == "C" and r["name"] == "kv_usage"]
    assert max(usage) > 0 and usage[-1] == 0
    counts = [r["args"] for r in records if r["ph"] == "C" and r["name"] == "requests"]
    assert counts[0] == {"running": 3, "waiting": 0} and counts[-1] == {"running": 0, "waiting": 0}

    tracks = [r for r in records if r.get("cat") == "request"]
    assert sorted((r["id"], r["ph"]) for r in tracks) == [
        (str(i), ph) for i in range(3) for ph in "be"]
    for track in tracks:
        assert track["name"] == f"request {track['id']}" and inside(track["ts"], steps)
        if track["ph"] == "b":
            assert track["args"] == {"prompt_tokens": len(PROMPTS[int(track["id"])])}
        else:
            assert track["args"] == {"finish_reason": "length"}


def test_a_gated_scheduler_s_drafts_preemption_holds_and_abort(tmp_path):
    s = make_scheduler(cls=BalanceScheduler, dp_size=2, max_num_seqs=2, num_blocks=8,
                       speculative_config=SpeculativeConfig("ngram", num_speculative_tokens=2))
    runner = SimpleNamespace(execute_dummy_batch=lambda: None)
    writer = TraceWriter(tmp_path / "t.json", 0, "DP rank 0", fresh=True)
    StepTracer(writer, s, runner)
    for req_id in "ab":
        s.add_request(make_request(req_id, 12, max_tokens=8, ignore_eos=True))
    step(s)
    # a's drafts need a block more than 7 usable hold: b is preempted. The fake model accepts
    # the first (the token it samples) and rejects the second.
    propose(s, {"a": [1001, 7]})
    step(s)
    s.balance_counts = [2, 0]  # a peer is full: the gate holds b and c until a ends
    s.add_request(make_request("c", 4, max_tokens=2))
    while s.running:
        step(s)
    step(s)  # nothing computed: the dummy batch after it tells it
    runner.execute_dummy_batch()
    s.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    s.balance_counts = [0, 0]
    while s.has_requests():
        step(s)
    writer.close()
    records = read_trace(tmp_path / "t.json")

    steps = [r for r in records if r["ph"] == "X" and r["tid"] == STEPS]
    drafted = steps[1]["args"]
    assert drafted["tokens"] == {"a": 3} and drafted["preempted"] == ["b"]
    assert (drafted["decode_tokens"], drafted["draft_tokens"], drafted["drafts_proposed"],
            drafted["drafts_accepted"]) == (1, 2, 2, 1)
    held = [r for r in steps if r["args"].get("gate") == "hold"]
    assert held[0] is steps[2] and held[-1]["name"] == "dummy batch"
    assert all(r["name"] == "step" and r["args"]["tokens"] == {"a": 1} for r in held[:-1])
    assert held[-1]["args"]["step"] == len(held) + 2  # the third forward, then one each
    resumed = steps[len(held) + 2]["args"]
    assert resumed["tokens"] == {"b": 5} and resumed["prefill_tokens"] == 5  # after a prefix hit
    tracks = {(r["id"], r["ph"]): r for r in records if r.get("cat") == "request"}
    assert sorted(tracks) == [(i, ph) for i in "abc" for ph in "be"]  # one track through b's
    assert tracks["c", "b"]["ts"] == steps[2]["ts"]  # preemption, from the step after it came
    assert [tracks[i, "e"]["args"]["finish_reason"] for i in "abc"] == ["length", "length",
                                                                       "abort"]
    counters = [r for r in records if r["ph"] == "C"]
    assert counters[-2:] == [
        {**counters[-2], "name": "kv_usage", "args": {"usage": 0.0}},
        {**counters[-1], "name": "requests", "args": {"running": 0, "waiting": 0}}]


def test_the_writer_keeps_to_its_limit_and_marks_the_cut(tmp_path):
    path = tmp_path / "t.json"
    writer = TraceWriter(path, 3, "DP rank 3", limit=9, fresh=True)  # its metadata records first
    writer.emit({"ph": "i", "name": "one", "ts": 1.0})
    writer.defer(lambda n: [{"ph": "i", "name": f"deferred {i}", "ts": 2.0} for i in range(n)], 9)
    assert writer.flush()
    assert writer.full
    writer.emit({"ph": "i", "name": "dropped", "ts": 3.0})
    writer.close()
    writer.close()  # again: nothing
    records = read_trace(path)
    num_metadata = sum(r["ph"] == "M" for r in records)
    assert [r["name"] for r in records[num_metadata:]] == [
        "one", *(f"deferred {i}" for i in range(9 - num_metadata - 1)), "trace truncated"]
    assert {r["pid"] for r in records} == {3} and records[-1]["args"] == {"limit": 9}


def test_a_fresh_writer_replaces_the_file_and_the_others_append(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[\n{"stale": true},\n')
    first = TraceWriter(path, 0, "DP rank 0", fresh=True)
    second = TraceWriter(path, 1, "DP rank 1")
    for writer in (first, second):
        writer.complete("step", 10.0, 20.0, wave=0)
        writer.close()
    records = read_trace(path)
    assert "stale" not in path.read_text()
    assert {(r["pid"], r["name"]) for r in records} == {
        (pid, name) for pid in (0, 1) for name in ("process_name", "thread_name", "step")}
