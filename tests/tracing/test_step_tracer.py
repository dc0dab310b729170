"""--trace-steps on one engine (minicore/tracing/step_tracer.py) and the writer's bound
(step_trace.py): an offline LLM's trace holds its steps (tokens by kind, forward time), the
kv_usage and requests counters and every request's track, inside the steps, and a dummy batch
after a sleep (sleep mode puts the tracer's wrap back on waking); the writer keeps to
its limit in records, marks the cut, replaces a stale file when told and appends otherwise. The
DP=2 expert-parallel trace, with the balance gate, is checked in
tests/dp/test_expert_parallel_serving.py."""

from collections import Counter

import pytest

from minicore.llm import LLM
from minicore.sampling_params import SamplingParams
from minicore.tracing.step_trace import STEPS, TraceWriter, read_trace

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


def test_the_writer_keeps_to_its_limit_and_marks_the_cut(tmp_path):
    path = tmp_path / "t.json"
    writer = TraceWriter(path, 3, "DP rank 3", limit=6, fresh=True)  # 3 metadata records first
    writer.emit({"ph": "i", "name": "one", "ts": 1.0})
    writer.defer(lambda n: [{"ph": "i", "name": f"deferred {i}", "ts": 2.0} for i in range(n)], 5)
    assert writer.flush()
    assert writer.full
    writer.emit({"ph": "i", "name": "dropped", "ts": 3.0})
    writer.close()
    writer.close()  # again: nothing
    records = read_trace(path)
    assert [r["name"] for r in records] == [
        "process_name", "thread_name", "thread_name", "one", "deferred 0", "deferred 1",
        "trace truncated"]
    assert {r["pid"] for r in records} == {3} and records[-1]["args"] == {"limit": 6}


def test_a_fresh_writer_replaces_the_file_and_the_others_append(tmp_path):
    path = tmp_path / "t.json"
    path.write_text('[\n{"stale": true},\n')
    first = TraceWriter(path, 0, "DP rank 0", fresh=True)
    second = TraceWriter(path, 1, "DP rank 1")
    for writer in (first, second):
        writer.complete("step", 10.0, 20.0, wave=0)
        writer.close()
    records = read_trace(path)
    assert sorted((r["pid"], r["name"]) for r in records if r["ph"] in "MX") == [
        (pid, name) for pid in (0, 1) for name in ("process_name", "step", "thread_name",
                                                    "thread_name")]
