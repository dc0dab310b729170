"""`python -m minicore trace-view` (minicore/tracing/view.py) on a stored trace: the PNG's pixel
size from its header (given and default), the colours of the step kinds, the gate holds and the
wave end in it, a time window, and the lanes and waves read from the records, also from an
engine's records on the wall clock; two files (a P/D pair) as lanes with their remote-KV waits
and KV transfers; async scheduling's forward and schedule() records as a sub-lane."""

import json
import struct
from pathlib import Path

import pytest

from minicore.__main__ import main
from minicore.tracing.step_trace import FORWARD, SCHEDULE, overlap_records, read_trace
from minicore.tracing.view import (
    HOLD_COLOUR,
    KIND_COLOURS,
    REMOTE_KV_COLOUR,
    WAVE_END_COLOUR,
    load_view,
    read_traces,
    step_kind,
)

# Written by `python -m minicore simulate --data-parallel-size 2 --max-num-seqs 2
# --max-num-batched-tokens 16 --num-prompts 5 --random-input-len 20 --random-output-len 6
# --random-range-ratio 0.5 --max-concurrency 4 --num-speculative-tokens 2 --acceptance-rate 0.5
# --step-ms 10 --decode-seq-ms 1 --prefill-token-us 500 --balance-threshold full
# --trace-steps sim_dp2_gate.trace.json` (its .full file): one wave of 2 ranks, 387.5 ms; prefill,
# mixed, draft-verifying steps, dummy batches, and 4 steps of rank 0 held by the gate.
TRACE = Path(__file__).with_name("sim_dp2_gate.trace.json")


def png_size(path: Path) -> tuple[int, int]:
    header = path.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n" and header[12:16] == b"IHDR"
    return struct.unpack(">II", header[16:24])


def colour_pixels(path: Path, colour: str) -> int:
    """How many pixels of the picture are exactly colour (to within rounding)."""
    import numpy as np
    from matplotlib.image import imread

    rgb = imread(path)[..., :3]
    target = np.array([int(colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(rgb - target) < 1.5 / 255).all(axis=-1).sum())


def test_trace_view_writes_a_png_of_the_given_size(tmp_path, capsys):
    out = tmp_path / "trace.png"
    main(["trace-view", str(TRACE), "--png", str(out), "--width", "900", "--height", "320"])
    assert capsys.readouterr().out.strip() == f"wrote {out}"
    assert png_size(out) == (900, 320)
    # Not blank: every kind of step in the trace and the gate holds are drawn, beyond their
    # legend entries (a legend patch is as many pixels as decode's, which the trace has none of,
    # give or take the edges' antialiasing).
    legend = colour_pixels(out, KIND_COLOURS["decode"])
    assert legend > 0
    for kind in ("prefill", "mixed", "draft verification", "dummy batch"):
        assert colour_pixels(out, KIND_COLOURS[kind]) > legend + 500, kind
    assert colour_pixels(out, HOLD_COLOUR) > legend + 100


def test_default_size_and_a_time_window(tmp_path):
    # After 160 ms both ranks run only dummy batches, to the wave's end at 387.5 ms.
    pictures = {}
    for end in (400, 380):
        pictures[end] = tmp_path / f"window-{end}.png"
        main(["trace-view", str(TRACE), "--png", str(pictures[end]), "--start-ms", "160",
              "--end-ms", str(end), "--title", "dummy batches"])
    out = pictures[400]
    assert png_size(out) == (1600, 170 + 70 * 2)
    legend = colour_pixels(out, KIND_COLOURS["decode"])
    assert colour_pixels(out, KIND_COLOURS["dummy batch"]) > legend + 10_000
    for kind in ("prefill", "mixed", "draft verification"):
        assert colour_pixels(out, KIND_COLOURS[kind]) < legend + 50, kind
    # The wave's end, a dashed line, is in the window to 400 ms, not in the one to 380 ms (where
    # only its legend entry has the colour).
    assert colour_pixels(out, WAVE_END_COLOUR) > 2 * colour_pixels(pictures[380],
                                                                   WAVE_END_COLOUR)


def test_an_empty_window_is_refused(tmp_path):
    with pytest.raises(SystemExit, match="the time window is empty"):
        main(["trace-view", str(TRACE), "--png", str(tmp_path / "x.png"), "--start-ms", "50",
              "--end-ms", "50"])


def test_lanes_and_waves_from_the_records():
    records = read_trace(TRACE)
    view = load_view(records)
    assert [lane.name for lane in view.lanes] == ["DP rank 0", "DP rank 1"]
    assert view.waves == [(0, 0.0, 387.5, True)] and view.end_ms == 387.5
    assert not view.truncated
    for pid, lane in enumerate(view.lanes):
        steps = [r for r in records if r["ph"] == "X" and r["pid"] == pid and r["tid"] == 0]
        assert sum(map(len, lane.bars.values())) == len(steps)
        assert len(lane.holds) == sum(r["args"].get("gate") == "hold" for r in steps)
        assert len(lane.waits) == len(steps)  # one wait for the slowest rank after each
    assert len(view.lanes[0].holds) == 4


@pytest.mark.parametrize("name, tokens, kind", [
    ("dummy batch", {}, "dummy batch"),
    ("step", {"prefill_tokens": 16}, "prefill"),
    ("step", {"prefill_tokens": 8, "decode_tokens": 2}, "mixed"),
    ("step", {"prefill_tokens": 8, "draft_tokens": 2, "decode_tokens": 1}, "mixed"),
    ("step", {"decode_tokens": 3, "draft_tokens": 6}, "draft verification"),
    ("step", {"decode_tokens": 3}, "decode"),
    ("step", {"prefill_tokens": 0, "decode_tokens": 0, "gate": "hold"}, None)])
def test_step_kinds(name, tokens, kind):
    assert step_kind({"name": name, "args": tokens}) == kind


def test_an_engine_trace_on_the_wall_clock():
    # Times in microseconds of the wall clock, a step that computed nothing (only its gate hold
    # is drawn), a wave not ended in the trace, a truncation mark.
    t0 = 1.7e15
    records = [
        {"ph": "M", "name": "process_name", "pid": 3, "args": {"name": "DP rank 3"}},
        {"ph": "i", "name": "wave start", "pid": 3, "tid": 0, "ts": t0, "args": {"wave": 5}},
        {"ph": "X", "name": "step", "pid": 3, "tid": 0, "ts": t0 + 1000, "dur": 2000,
         "args": {"tokens": {"a": 7}, "prefill_tokens": 7, "decode_tokens": 0}},
        {"ph": "X", "name": "step", "pid": 3, "tid": 0, "ts": t0 + 3000, "dur": 500,
         "args": {"tokens": {}, "prefill_tokens": 0, "decode_tokens": 0, "gate": "hold"}},
        {"ph": "X", "name": "gather_running_counts", "pid": 3, "tid": 1, "ts": t0 + 3500,
         "dur": 250, "args": {"waited_ms": 0.25}},
        {"ph": "i", "name": "trace truncated", "pid": 3, "s": "p", "ts": t0 + 9e6,
         "args": {"limit": 4}}]
    view = load_view(records)
    (lane,) = view.lanes
    assert lane.name == "DP rank 3" and lane.bars["prefill"] == [(1.0, 2.0)]
    assert sum(map(len, lane.bars.values())) == 1
    assert lane.holds == [(3.0, 0.5)] and lane.waits == [(3.5, 0.25)]
    assert view.waves == [(5, 0.0, 3.75, False)] and view.end_ms == 3.75 and view.truncated


def test_overlap_records_of_async_scheduling():
    # Step 2's forward (thread 2) and step 3's schedule() (thread 3) inside it: the overlap; a
    # schedule() too short to time leaves no record.
    assert overlap_records(2, (10.0, 10.0), (5.0, 50.0)) == [
        {"ph": "X", "name": "forward", "ts": 5.0, "dur": 45.0, "tid": FORWARD,
         "args": {"step": 2}}]
    schedule, forward = overlap_records(3, (20.0, 20.5), (50.0, 90.0))
    assert (schedule["tid"], schedule["name"], forward["name"]) == (SCHEDULE, "schedule", "forward")
    records = [{**r, "pid": 0, "ts": r["ts"] * 1000, "dur": r["dur"] * 1000}
               for r in overlap_records(2, (1.0, 2.0), (3.0, 9.0))]
    (lane,) = load_view(records).lanes
    assert lane.schedules == [(0.0, 1.0)] and lane.forwards == [(2.0, 6.0)]


def test_two_files_as_lanes_with_remote_kv_and_transfers(tmp_path):
    # A P/D pair: each instance's DP rank 0, in a file of its own; the decode side waits for
    # remote KV in one step and receives it in the next.
    t0 = 1.7e15
    files = []
    for name, steps in (("prefill", [{"prefill_tokens": 64, "kv_transfers": {
                            "reqs_to_send": ["a"]}}]),
                        ("decode", [{"waiting_for_remote_kv": ["a"], "kv_transfers": {
                            "reqs_to_recv": ["a"]}}, {"kv_transfers": {
                                "finished_recving": ["a"]}, "decode_tokens": 1}])):
        path = tmp_path / f"{name}.json"
        records = [{"ph": "M", "name": "process_name", "pid": 0, "args": {"name": "DP rank 0"}}]
        records += [{"ph": "X", "name": "step", "pid": 0, "tid": 0, "ts": t0 + 1000 * i,
                     "dur": 1000, "args": args} for i, args in enumerate(steps)]
        path.write_text(json.dumps(records))
        files.append(str(path))
    prefill, decode = load_view(read_traces(files)).lanes
    assert (prefill.name, decode.name) == ("prefill: DP rank 0", "decode: DP rank 0")
    assert prefill.transfers == [0.5] and decode.transfers == [0.5, 1.5]
    assert decode.remote_kv == [(0.0, 1.0)] and not prefill.remote_kv
    out = tmp_path / "pd.png"
    main(["trace-view", *files, "--png", str(out)])
    assert png_size(out) == (1600, 170 + 70 * 2)
    assert colour_pixels(out, REMOTE_KV_COLOUR) > 100
