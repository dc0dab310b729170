"""What --trace-steps costs a served run: `minicore serve` started without and with it, in turn,
each driven with the same requests by bench_serve.py's random workload, the two sides alternated
over --rounds; prints each side's output throughput, median TPOT and the CPU time its processes
(the server and its engines) spent on the run, per output token (each the median over rounds),
and the traced side's cost, the median of each round's pair (its two runs back to back), with the
CPU's model and flags, and the trace's size. On a machine shared with other work the CPU time is
the steadier measure, and a round's pair the steadier comparison.

    python benchmarks/bench_trace_steps.py --rounds 3 --num-prompts 64 --random-input-len 128 \
        --random-output-len 64 --max-concurrency 16 [--minicore-args "--data-parallel-size 2"]
"""

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import benchmark, started_server  # noqa: E402
from machine import cpu_description  # noqa: E402

from minicore.ports import free_port  # noqa: E402
from minicore.tracing.step_trace import read_trace  # noqa: E402


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--minicore-args", default="", help="minicore serve's flags, both sides")
    ap.add_argument("--tokenizer", default=None, help="default: minicore's default model")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--random-input-len", type=int, default=128)
    ap.add_argument("--random-output-len", type=int, default=64)
    ap.add_argument("--random-range-ratio", type=float, default=0.0)
    ap.add_argument("--max-concurrency", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    # What bench_serve.benchmark reads besides: vllm bench serve's defaults.
    args.backend, args.endpoint, args.api_key, args.model = "openai", "/v1/completions", None, None
    args.request_rate, args.burstiness, args.metric_percentiles = float("inf"), 1.0, "99"
    return args


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its children (a server and its engines)."""
    processes = [psutil.Process(pid)]
    processes += processes[0].children(recursive=True)
    return sum(sum(p.cpu_times()[:2]) for p in processes)


def main() -> None:
    args = parse_args()
    trace = Path(tempfile.mkdtemp()) / "served.trace.json"
    sides = {"off": [], "on": ["--trace-steps", str(trace)]}
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for round_ in range(args.rounds):
        # Each side first in every other round: a drift in the machine's load spares neither.
        for side in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
            flags, port = sides[side], free_port()
            command = [sys.executable, "-m", "minicore", "serve", "--port", str(port),
                       *shlex.split(args.minicore_args), *flags]
            print(f"round {round_ + 1}, tracing {side}: {shlex.join(command)}", flush=True)
            with started_server(command, port) as (base, pid):
                before = cpu_seconds(pid)
                result = asyncio.run(benchmark(args, base, f"bench_trace_steps_{side}.json"))
                cpu_ms = 1000 * (cpu_seconds(pid) - before) / result["total_output_tokens"]
            results[side].append({"cpu_ms_per_token": cpu_ms, **{k: result[k] for k in (
                "output_throughput", "median_tpot_ms", "failed")}})
    summary = {side: {key: statistics.median(r[key] for r in rs) for key in (
        "output_throughput", "median_tpot_ms", "cpu_ms_per_token")} | {
        "failed": sum(r["failed"] for r in rs)} for side, rs in results.items()}
    pairs = list(zip(results["off"], results["on"]))

    def paired(key: str) -> float:
        return 100 * (statistics.median(on[key] / off[key] for off, on in pairs) - 1)

    cost = {"throughput_pct": -paired("output_throughput"), "tpot_pct": paired("median_tpot_ms"),
            "cpu_pct": paired("cpu_ms_per_token")}
    records = read_trace(trace)
    print(f"CPU: {cpu_description()}")
    for side, s in summary.items():
        print(f"tracing {side:3}: output {s['output_throughput']:8.1f} tok/s, median TPOT "
              f"{s['median_tpot_ms']:7.2f} ms, CPU {s['cpu_ms_per_token']:6.2f} ms a token, "
              f"failed {s['failed']} (median of {args.rounds})")
    print(f"cost of tracing (median of the rounds' pairs): throughput "
          f"{cost['throughput_pct']:+.2f}%, median TPOT "
          f"{cost['tpot_pct']:+.2f}%, CPU {cost['cpu_pct']:+.2f}%; the last trace: "
          f"{len(records)} records, {trace.stat().st_size / 1e6:.2f} MB")
    path = Path(args.result_dir) / "bench_trace_steps.json"
    path.write_text(json.dumps({"cpu": cpu_description(), "args": vars(args), "rounds": results,
                                "summary": summary, "cost": cost}, indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
