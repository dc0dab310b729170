"""python -m minicore trace-view: a picture of a step trace (the schema of
minicore/tracing/step_trace.py), for the docs and for readers who will not open Perfetto.

minicore's own (vLLM has no such view). One lane per DP rank, rank 0 on top; each step a bar
coloured by its kind (prefill, decode, mixed: prompt and decode tokens together, draft
verification, dummy batch), the rank's wait in its collectives a thin grey band after it, the
steps in which the balance gate held waiting requests marked red above their bars, waves shaded
and each wave's end a dashed line; the steps with requests waiting for remote KV marked teal
above their bars, those that started or finished a KV transfer with a triangle; the forwards and
schedule() calls (threads 2 and 3) a thin sub-lane under the bars, where async scheduling's
overlap shows: the next step scheduled while this one's forward runs. Several files (a prefill
and a decode instance's, each its own DP rank 0) are lanes of one picture, named by file. Time is
in ms from the first record. matplotlib is imported here only when drawing, on the Agg backend
(pip install 'minicore[view]'). Left out: request tracks, counters and preemptions (Perfetto
shows them).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

from minicore.tracing.step_trace import COLLECTIVES, FORWARD, SCHEDULE, STEPS, read_trace

KIND_COLOURS = {"prefill": "#e8743b", "decode": "#4c78a8", "mixed": "#8e5ec4",
                "draft verification": "#4a9d4a", "dummy batch": "#b8b8b8"}
WAIT_COLOUR, HOLD_COLOUR, WAVE_END_COLOUR = "#d4d4d4", "#d62728", "#333333"
REMOTE_KV_COLOUR, TRANSFER_COLOUR = "#17becf", "#111111"
FORWARD_COLOUR, SCHEDULE_COLOUR = "#2f4b7c", "#ff7f0e"
PID_STRIDE = 1 << 20  # a file's pids, when several are drawn: apart from the file before
WAVE_SHADES = ("#fff3c9", "#e4effa")  # alternate, so that back-to-back waves stay apart
DEFAULT_WIDTH, LANE_HEIGHT, FRAME_HEIGHT = 1600, 70, 170  # pixels


@dataclass(slots=True)
class Lane:
    """One rank's spans in ms from the trace's start: (start, width) by step kind, waits, holds."""
    name: str
    bars: dict[str, list[tuple[float, float]]] = field(
        default_factory=lambda: {kind: [] for kind in KIND_COLOURS})
    waits: list[tuple[float, float]] = field(default_factory=list)
    holds: list[tuple[float, float]] = field(default_factory=list)
    remote_kv: list[tuple[float, float]] = field(default_factory=list)
    transfers: list[float] = field(default_factory=list)  # the middle of each such step
    forwards: list[tuple[float, float]] = field(default_factory=list)
    schedules: list[tuple[float, float]] = field(default_factory=list)


@dataclass(slots=True)
class TraceView:
    lanes: list[Lane]
    waves: list[tuple[int, float, float, bool]]  # number, start, end, whether it ended in view
    end_ms: float
    truncated: bool


def step_kind(record: dict) -> str | None:
    """A step record's kind, from its tokens: any prompt token with decodes or drafts is mixed.
    None for a step that computed nothing (the engine's record of a gate hold or of requests
    that arrived or ended, with no dummy batch after it): no bar."""
    if record["name"] == "dummy batch":
        return "dummy batch"
    args = record.get("args", {})
    prefill, decode = args.get("prefill_tokens", 0), args.get("decode_tokens", 0)
    drafts = args.get("draft_tokens", 0)
    if prefill:
        return "mixed" if decode or drafts else "prefill"
    if drafts:
        return "draft verification"
    return "decode" if decode else None


def load_view(records: list[dict]) -> TraceView:
    """The lanes and waves of a trace's records, times in ms from its first timed record."""
    timed = [r for r in records if "ts" in r and r.get("name") != "trace truncated"]
    t0 = min((r["ts"] for r in timed), default=0.0)
    names = {r["pid"]: r["args"]["name"] for r in records
             if r.get("ph") == "M" and r.get("name") == "process_name"}
    lanes: dict[int, Lane] = {}
    starts: dict[int, float] = {}
    ends: dict[int, float] = {}
    end_ms = 0.0
    for r in timed:
        ts = (r["ts"] - t0) / 1000
        end_ms = max(end_ms, ts + r.get("dur", 0) / 1000)
        if r["ph"] == "X" and r.get("tid") in (STEPS, COLLECTIVES, FORWARD, SCHEDULE):
            if (lane := lanes.get(r["pid"])) is None:
                lane = lanes[r["pid"]] = Lane(names.get(r["pid"], f"pid {r['pid']}"))
            _add_span(lane, r, (ts, r["dur"] / 1000))
        elif r["ph"] == "i" and r["name"] in ("wave start", "wave end"):
            wave = r["args"]["wave"]
            if r["name"] == "wave start":
                starts[wave] = min(starts.get(wave, ts), ts)
            else:
                ends[wave] = max(ends.get(wave, ts), ts)
    waves = [(w, starts.get(w, 0.0), ends.get(w, end_ms), w in ends)
             for w in sorted(starts.keys() | ends.keys())]
    truncated = any(r.get("name") == "trace truncated" for r in records)
    return TraceView([lanes[pid] for pid in sorted(lanes)], waves, end_ms, truncated)


def _add_span(lane: Lane, record: dict, span: tuple[float, float]) -> None:
    """An X record of a rank's threads into its lane."""
    tid, args = record["tid"], record.get("args", {})
    if tid != STEPS:
        {COLLECTIVES: lane.waits, FORWARD: lane.forwards, SCHEDULE: lane.schedules}[tid].append(
            span)
        return
    if kind := step_kind(record):
        lane.bars[kind].append(span)
    if args.get("gate") == "hold":
        lane.holds.append(span)
    if args.get("waiting_for_remote_kv"):
        lane.remote_kv.append(span)
    if args.get("kv_transfers"):
        lane.transfers.append(span[0] + span[1] / 2)


def read_traces(paths: list[str]) -> list[dict]:
    """The records of several trace files as one trace: with more than one, each file's pids
    moved apart and its ranks named after the file (a P/D pair is two DP rank 0s)."""
    if len(paths) == 1:
        return read_trace(paths[0])
    records = []
    for i, path in enumerate(paths):
        for r in read_trace(path):
            if "pid" in r:
                r["pid"] += i * PID_STRIDE
            if r.get("ph") == "M" and r.get("name") == "process_name":
                r["args"] = {"name": f"{Path(path).stem}: {r['args']['name']}"}
            records.append(r)
    return records


def render(view: TraceView, out: str, width: int = DEFAULT_WIDTH, height: int | None = None,
           window: tuple[float | None, float | None] = (None, None), title: str = "") -> None:
    """Draw view to the PNG out, width x height pixels, the time window in ms (None: the
    trace's start or end)."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("trace-view draws with matplotlib: pip install 'minicore[view]'") from None
    height = height or FRAME_HEIGHT + LANE_HEIGHT * max(1, len(view.lanes))
    lo, hi = window[0] or 0.0, window[1] if window[1] is not None else view.end_ms
    if not hi > lo:
        raise ValueError(f"the time window is empty: {lo} to {hi} ms")
    fig = Figure(figsize=(width / 100, height / 100), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    _draw_waves(ax, view, lo, hi)
    px_per_ms = width * 0.85 / (hi - lo)
    for y, lane in enumerate(view.lanes):
        _draw_lane(ax, lane, y, lo, hi, px_per_ms)
    ax.set_xlim(lo, hi)
    ax.set_ylim(len(view.lanes) - 0.5, -0.5)  # rank 0 on top
    ax.set_yticks(range(len(view.lanes)), [lane.name for lane in view.lanes])
    ax.set_xlabel("time (ms)")
    digits = 0 if hi - lo > 20 else 1 if hi - lo > 2 else 2  # a window of a few ms: tenths
    ax.xaxis.set_major_formatter(lambda value, _: f"{value:,.{digits}f}")
    ax.tick_params(labelsize=8)
    ax.set_title(title + (" (trace truncated)" if view.truncated else ""), fontsize=10)
    handles = _legend_handles(view)
    fig.legend(handles=handles, loc="outside upper center", ncol=min(len(handles), 11),
               fontsize=7.5,
               frameon=False, handlelength=1.5, columnspacing=1.2)
    fig.savefig(out, dpi=100)


def _visible(spans: list[tuple[float, float]], lo: float, hi: float) -> list[tuple[float, float]]:
    return [(s, w) for s, w in spans if s < hi and s + w > lo]


def _draw_lane(ax, lane: Lane, y: int, lo: float, hi: float, px_per_ms: float) -> None:
    """A rank's step bars, waits and gate holds."""
    for kind, colour in KIND_COLOURS.items():
        spans = _visible(lane.bars[kind], lo, hi)
        # White edges part adjacent steps only where a step is wide enough to keep its colour.
        wide = bool(spans) and min(w for _, w in spans) * px_per_ms > 4
        ax.broken_barh(spans, (y - 0.3, 0.6), facecolors=colour,
                       edgecolors="white" if wide else "none", linewidth=0.5)
    ax.broken_barh(_visible(lane.waits, lo, hi), (y - 0.06, 0.12), facecolors=WAIT_COLOUR)
    ax.broken_barh(_visible(lane.holds, lo, hi), (y - 0.42, 0.09), facecolors=HOLD_COLOUR)
    ax.broken_barh(_visible(lane.remote_kv, lo, hi), (y - 0.42, 0.09),
                   facecolors=REMOTE_KV_COLOUR)
    # The sub-lane: forwards under the bars, schedule() calls drawn over them.
    ax.broken_barh(_visible(lane.forwards, lo, hi), (y + 0.33, 0.1), facecolors=FORWARD_COLOUR)
    ax.broken_barh(_visible(lane.schedules, lo, hi), (y + 0.31, 0.14),
                   facecolors=SCHEDULE_COLOUR)
    if marks := [t for t in lane.transfers if lo <= t <= hi]:
        ax.plot(marks, [y - 0.38] * len(marks), linestyle="none", marker="v", markersize=6,
                color=TRANSFER_COLOUR)


def _draw_waves(ax, view: TraceView, lo: float, hi: float) -> None:
    for number, start, end, ended in view.waves:
        if start >= hi or end <= lo:
            continue
        ax.axvspan(start, end, color=WAVE_SHADES[number % 2], zorder=0, linewidth=0)
        ax.text(max(start, lo), 1.0, f" wave {number}", transform=ax.get_xaxis_transform(),
                fontsize=7, va="bottom", ha="left", clip_on=False)
        if ended and lo <= end <= hi:
            ax.axvline(end, color=WAVE_END_COLOUR, linestyle="--", linewidth=0.9)


def _legend_handles(view: TraceView) -> list:
    """The legend, the KV and sub-lane entries only for a trace that has them."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = ([Patch(color=colour, label=kind) for kind, colour in KIND_COLOURS.items()]
               + [Patch(color=WAIT_COLOUR, label="waiting for peers"),
                  Patch(color=HOLD_COLOUR, label="gate hold"),
                  Patch(color=WAVE_SHADES[0], label="wave"),
                  Line2D([], [], color=WAVE_END_COLOUR, linestyle="--", label="wave end")])
    if any(lane.remote_kv or lane.transfers for lane in view.lanes):
        handles += [Patch(color=REMOTE_KV_COLOUR, label="waiting for remote KV"),
                    Line2D([], [], color=TRANSFER_COLOUR, marker="v", linestyle="none",
                           label="KV transfer")]
    if any(lane.forwards for lane in view.lanes):
        handles += [Patch(color=FORWARD_COLOUR, label="forward"),
                    Patch(color=SCHEDULE_COLOUR, label="schedule()")]
    return handles


def add_trace_view_args(parser: argparse.ArgumentParser) -> None:
    parser.description = ("Draw a step trace (--trace-steps of serve, LLM or simulate) as a PNG: "
                          "one lane per DP rank, steps coloured by kind, waves and gate holds "
                          "marked. Needs matplotlib (pip install 'minicore[view]').")
    parser.add_argument("path", nargs="+", help="the trace file (Trace Event Format JSON); "
                        "several: one picture, each file's ranks named after it")
    parser.add_argument("--png", required=True, metavar="OUT", help="the picture to write")
    parser.add_argument("--start-ms", type=float, default=None,
                        help="the window's start, ms from the trace's first record (default 0)")
    parser.add_argument("--end-ms", type=float, default=None,
                        help="the window's end (default: the trace's end)")
    parser.add_argument("--width", type=int, default=DEFAULT_WIDTH, help="pixels (default: "
                        "%(default)s)")
    parser.add_argument("--height", type=int, default=None,
                        help=f"pixels (default: {FRAME_HEIGHT} + {LANE_HEIGHT} a rank)")
    parser.add_argument("--title", default=None, help="default: the trace's file name")


def trace_view_main(args: argparse.Namespace) -> None:
    view = load_view(read_traces(args.path))
    if not view.lanes:
        raise ValueError(f"{' '.join(args.path)} has no step records")
    render(view, args.png, args.width, args.height, (args.start_ms, args.end_ms),
           args.title if args.title is not None else " + ".join(Path(p).name for p in args.path))
    print(f"wrote {args.png}")
