"""The DP simulator's step trace (minicore/dp/sim_trace.py, `simulate --trace-steps`): small
scenarios whose schedule is stated by hand, checked record by record (each rank's steps and dummy
batches with their tokens and simulated times, the waits for the slowest rank, the waves, a gate
hold, drafts), the bound in records, and the command's files."""

import json

import pytest

from minicore.__main__ import main
from minicore.config import CacheConfig, SchedulerConfig
from minicore.dp.sim_report import variant_trace_path
from minicore.dp.sim_trace import NO_TRACE, SimTrace
from minicore.dp.simulator import CostModel, DPSimulator, SimConfig, SimRequest
from minicore.tracing.step_trace import read_trace


def run_traced(tmp_path, requests, dp=2, max_num_seqs=2, threshold=None, cost=(10, 1, 1000),
               limit=1_000_000, **kwargs):
    """Run the simulator with a trace; its records grouped by (pid, ph, tid)."""
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=256,
                                max_model_len=64, balance_scheduling=threshold is not None,
                                balance_threshold=threshold or "full")
    cache = CacheConfig(block_size=4, num_blocks=1 + max_num_seqs * 16,
                        enable_prefix_caching=False)
    # cost: ms a step, ms per decoding request, us per prompt token.
    config = SimConfig(dp, scheduler, cache, CostModel(*cost, 0), **kwargs)
    workload = [SimRequest(i, [100 + i] * prompt, out) for i, (prompt, out) in enumerate(requests)]
    trace = SimTrace(tmp_path / "sim.json", dp, limit)
    simulator = DPSimulator(config, workload, trace)
    simulator.run()
    trace.close()
    records = read_trace(tmp_path / "sim.json")
    by_kind = {}
    for r in records:
        by_kind.setdefault((r["pid"], r["ph"], r.get("tid")), []).append(r)
    return simulator, records, by_kind


def ms(us: float) -> float:
    return round(us / 1000, 6)


def steps(by_kind, pid):
    """A rank's steps: (name, start ms, duration ms, tokens or None)."""
    return [(r["name"], ms(r["ts"]), ms(r["dur"]), r["args"].get("tokens"))
            for r in by_kind[pid, "X", 0]]


# Two ranks, two slots each; 10 ms a step, 1 ms per decoding request, 1 ms per prompt token.
# Requests (prompt, output): 0 (4, 3), 1 (2, 1), 2 (4, 2), all at t = 0; routed 0 and 2 to rank 0,
# 1 to rank 1. Step 1: rank 0 prefills 0 and 2 (10 + 8 = 18 ms), rank 1 prefills 1 (12 ms) and
# waits 6 ms for rank 0; 1 ends. Step 2: rank 0 decodes 0 and 2 (12 ms), 2 ends; rank 1, empty in
# a running wave, runs a dummy batch (one decode's cost, 11 ms) and waits 1 ms. Step 3: rank 0
# decodes 0 (11 ms), which ends at 41 ms. Steps 4 to 32: dummy batches on both, until the 32nd
# step's check finds no work anywhere: the wave ends at 41 + 29 * 11 = 360 ms.
def test_a_small_scenario_step_by_step(tmp_path):
    _, records, by_kind = run_traced(tmp_path, [(4, 3), (2, 1), (4, 2)])
    dummies = [("dummy batch", 41 + 11 * i, 11, None) for i in range(29)]
    assert steps(by_kind, 0) == [("step", 0, 18, {"0": 4, "2": 4}),
                                 ("step", 18, 12, {"0": 1, "2": 1}),
                                 ("step", 30, 11, {"0": 1})] + dummies
    assert steps(by_kind, 1) == [("step", 0, 12, {"1": 2}), ("dummy batch", 18, 11, None),
                                 ("dummy batch", 30, 11, None)] + dummies
    kinds = [(r["args"]["prefill_tokens"], r["args"]["decode_tokens"], r["args"]["draft_tokens"])
             for r in by_kind[0, "X", 0][:3]]
    assert kinds == [(8, 0, 0), (0, 2, 0), (0, 1, 0)]
    assert by_kind[1, "X", 0][0]["args"]["prefill_tokens"] == 2
    for pid in (0, 1):
        assert [r["args"]["step"] for r in by_kind[pid, "X", 0]] == list(range(1, 33))
        assert {r["args"]["wave"] for r in by_kind[pid, "X", 0]} == {0}
        assert [r["args"]["forward_ms"] for r in by_kind[pid, "X", 0]] == [
            s[2] for s in steps(by_kind, pid)]
        assert not any("gate" in r["args"] for r in by_kind[pid, "X", 0])
        # The wait for the slowest rank, on the collectives track, ends with the lockstep step.
        waits = by_kind[pid, "X", 1]
        assert {w["name"] for w in waits} == {"max_step_time"}
        assert [ms(w["ts"] + w["dur"]) for w in waits] == [18, 30, 41] + [
            41 + 11 * (i + 1) for i in range(29)]
        assert [(r["name"], ms(r["ts"]), r["args"]) for r in by_kind[pid, "i", 0]] == [
            ("wave start", 0, {"wave": 0}), ("wave end", 360, {"wave": 0})]
    assert [w["args"]["waited_ms"] for w in by_kind[1, "X", 1][:4]] == [6, 1, 0, 0]
    assert {w["args"]["waited_ms"] for w in by_kind[0, "X", 1]} == {0}
    names = {r["args"]["name"] for r in records if r["ph"] == "M" and r["name"] == "process_name"}
    assert names == {"DP rank 0", "DP rank 1"}
    # Each request a track on its rank, from t = 0 to the end of the step that finished it.
    tracks = {(r["pid"], r["id"], r["ph"]): ms(r["ts"]) for r in records
              if r.get("cat") == "request"}
    assert {r["args"]["finish_reason"] for r in records if r["ph"] == "e"} == {"length"}
    assert tracks == {(0, "0", "b"): 0, (1, "1", "b"): 0, (0, "2", "b"): 0,
                      (1, "1", "e"): 18, (0, "2", "e"): 30, (0, "0", "e"): 41}
    # Rank 0's counters, where they changed.
    requests = [(ms(r["ts"]), r["args"]) for r in by_kind[0, "C", None]
                if r["name"] == "requests"]
    assert requests == [(18, {"running": 2, "waiting": 0}), (30, {"running": 1, "waiting": 0}),
                        (41, {"running": 0, "waiting": 0})]
    # KV blocks of 4 tokens, 32 of them: 0 and 2 hold one block each after step 1 and two each
    # in step 2, when 2 ends and frees its two: two of 32 until 0 ends.
    usage = [(ms(r["ts"]), r["args"]["usage"]) for r in by_kind[0, "C", None]
             if r["name"] == "kv_usage"]
    assert usage == [(18, 2 / 32), (41, 0)]


# The gate "full" (shut while a rank runs both its slots), 10 ms every step, at most 3 requests in
# flight. Requests (prompt, output): 0 (2, 4) and 2 (2, 3) on rank 0, 1 (2, 1) on rank 1. Step 1
# admits all three and ends 1; its place goes to 3, sent at 10 ms to the emptier rank 1, which takes
# it in after step 2 scheduled. Steps 2 and 3: rank 0 runs both slots, so the gate is shut; in step
# 3 it holds 3 on rank 1, which runs a dummy batch with a free slot and a waiting request. Step 3
# ends 2; step 4 (the gate open again) admits 3 and ends 0 and 3.
def test_a_rank_held_by_the_gate(tmp_path):
    simulator, _, by_kind = run_traced(tmp_path, [(2, 4), (2, 1), (2, 3), (2, 1)],
                                       threshold="full", cost=(10, 0, 0), max_concurrency=3)
    assert [r.rank for r in simulator.workload] == [0, 1, 0, 1]
    assert [s.gated for s in simulator.steps[:5]] == [False, True, True, False, False]
    assert steps(by_kind, 1)[:4] == [("step", 0, 10, {"1": 2}), ("dummy batch", 10, 10, None),
                                     ("dummy batch", 20, 10, None), ("step", 30, 10, {"3": 2})]
    held = {(r["pid"], r["args"]["step"]) for pid in (0, 1) for r in by_kind[pid, "X", 0]
            if r["args"].get("gate") == "hold"}
    assert held == {(1, 3)}  # rank 0's gated steps had no one waiting, rank 1's step 2 neither
    request_3 = [r for r in by_kind[1, "b", None] if r["id"] == "3"]
    assert [ms(r["ts"]) for r in request_3] == [10]


def test_drafts_proposed_and_accepted(tmp_path):
    # One rank, 2 drafts a decode, every draft accepted; prompt 4, output 7: step 1 prefills
    # (14 ms) and gives a token, steps 2 and 3 verify two drafts each and give 3 tokens (11 ms).
    _, _, by_kind = run_traced(tmp_path, [(4, 7)], dp=1, num_speculative_tokens=2,
                               acceptance_rate=1.0)
    first = by_kind[0, "X", 0][:4]
    assert [(ms(r["ts"]), ms(r["dur"])) for r in first] == [(0, 14), (14, 11), (25, 11), (36, 11)]
    assert [(r["args"].get("tokens"), r["args"].get("draft_tokens"),
             r["args"].get("drafts_proposed"), r["args"].get("drafts_accepted"))
            for r in first] == [({"0": 4}, 0, 0, 0), ({"0": 3}, 2, 2, 2), ({"0": 3}, 2, 2, 2),
                                (None, None, None, None)]
    assert first[1]["args"]["decode_tokens"] == 1 and first[3]["name"] == "dummy batch"


def test_waves_are_numbered_and_steps_counted_within_them(tmp_path):
    # Poisson arrivals far apart (0.5 a second): each request a wave of 32 steps of its own.
    simulator, _, by_kind = run_traced(tmp_path, [(4, 2), (4, 2)], dp=2, request_rate=0.5)
    send = [ms(r.send_time * 1e6) for r in simulator.workload]
    assert send[1] > 400  # after the first wave ended
    for pid in (0, 1):
        assert [(r["args"]["wave"], r["args"]["step"]) for r in by_kind[pid, "X", 0]] == [
            (w, s) for w in (0, 1) for s in range(1, 33)]
        marks = [(r["name"], r["args"]["wave"]) for r in by_kind[pid, "i", 0]]
        assert marks == [("wave start", 0), ("wave end", 0), ("wave start", 1), ("wave end", 1)]
        assert ms(by_kind[pid, "i", 0][2]["ts"]) == send[1]


def test_the_trace_is_bounded_in_records(tmp_path):
    _, records, _ = run_traced(tmp_path, [(4, 3), (2, 1), (4, 2)], limit=40)
    for pid in (0, 1):
        mine = [r for r in records if r["pid"] == pid]
        assert len(mine) == 41
        assert mine[-1]["name"] == "trace truncated" and mine[-1]["args"] == {"limit": 40}
        # Its time is the simulated clock's, not the wall clock's.
        assert mine[-1]["ts"] < 1e6


def test_tracing_is_off_by_default():
    assert DPSimulator.__init__.__defaults__ == (NO_TRACE,)


def test_simulate_writes_a_trace_per_variant(tmp_path, capsys):
    result_file = tmp_path / "result.json"
    main(["simulate", "--data-parallel-size", "2", "--max-num-seqs", "4", "--num-prompts", "12",
          "--random-input-len", "32", "--random-output-len", "8", "--max-concurrency", "6",
          "--balance-threshold", "full", "--trace-steps", str(tmp_path / "t.json"),
          "--result-file", str(result_file)])
    assert "steps traced to" in capsys.readouterr().out
    result = json.loads(result_file.read_text())
    for variant in ("baseline", "full"):
        path = tmp_path / f"t.{variant}.json"
        assert result[variant]["simulation"]["step_trace"] == str(path)
        records = read_trace(path)
        for pid in (0, 1):
            rank_steps = [r for r in records if r["pid"] == pid and r["ph"] == "X"
                          and r["tid"] == 0]
            assert len(rank_steps) == result[variant]["simulation"]["steps"]
        assert sum(r["ph"] == "e" for r in records) == 12
    assert not (tmp_path / "t.one-short.json").exists()


@pytest.mark.parametrize("path, variant, expected", [
    ("a/trace.json", "full", "a/trace.full.json"), ("trace", "baseline", "trace.baseline")])
def test_variant_trace_path(path, variant, expected):
    assert str(variant_trace_path(path, variant)) == expected
