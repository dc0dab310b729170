"""`serve --api-server-count 1` against `2` on this machine: start-up, throughput, TTFT, and what
the frontend costs a request.

Each count's server is started alone (`python -m minicore serve --api-server-count N`, with
--server-args), timed from launch to /health 200, then driven by bench_serve.py's load (random
token prompts, streamed, --max-concurrency in flight); the counts alternate, --repeat times, in one
run. The frontend's CPU is every process of the server but the engines (the launcher and the API
servers; with one server, the server itself), read before and after the load: its seconds per
request are what the HTTP side, tokenizing and detokenizing cost. Prints a table with the CPU's
model and flags, and writes JSON.

    python benchmarks/bench_api_servers.py --num-prompts 256 --max-concurrency 64
"""

import argparse
import asyncio
import json
import shlex
import sys
import time
from argparse import Namespace
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serve import benchmark, started_server  # noqa: E402
from machine import cpu_description  # noqa: E402

from minicore.ports import free_port  # noqa: E402


def frontend_cpu(server_pid: int) -> float:
    """CPU seconds of the server's processes that are not engines."""
    root = psutil.Process(server_pid)
    procs = [root, *root.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs if not p.name().startswith("EngineCore"))


def run_one(count: int, args) -> dict:
    port = free_port()
    command = [sys.executable, "-m", "minicore", "serve", "--port", str(port),
               "--api-server-count", str(count), "--disable-uvicorn-access-log",
               *shlex.split(args.server_args)]
    started = time.perf_counter()
    with started_server(command, port) as (base, pid):
        startup = time.perf_counter() - started
        before = frontend_cpu(pid)
        load = Namespace(endpoint="/v1/completions", api_key=None, model=None, tokenizer=None,
                         backend="openai", num_prompts=args.num_prompts,
                         random_input_len=args.input_len, random_output_len=args.output_len,
                         random_range_ratio=0.0, seed=0, request_rate=float("inf"),
                         burstiness=1.0, max_concurrency=args.max_concurrency,
                         metric_percentiles="99", result_dir=args.result_dir)
        result = asyncio.run(benchmark(load, base, f"bench_api_servers_{count}.json"))
        cpu = frontend_cpu(pid) - before
    return {"api_server_count": count, "startup_s": startup,
            "output_throughput": result["output_throughput"],
            "mean_ttft_ms": result["mean_ttft_ms"], "median_ttft_ms": result["median_ttft_ms"],
            "p99_ttft_ms": result["p99_ttft_ms"], "completed": result["completed"],
            "frontend_cpu_ms_per_request": 1000 * cpu / max(result["completed"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=64)
    ap.add_argument("--server-args", default="", help="more `serve` flags, for every count")
    ap.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    rows = [run_one(count, args) for _ in range(args.repeat) for count in args.counts]
    print(f"\nCPU: {cpu_description()}")
    header = ("count", "start-up s", "output tok/s", "mean TTFT ms", "median TTFT ms",
              "p99 TTFT ms", "frontend CPU ms/req")
    print(" | ".join(header))
    for r in rows:
        print(f"{r['api_server_count']:5} | {r['startup_s']:10.1f} | "
              f"{r['output_throughput']:12.1f} | {r['mean_ttft_ms']:12.1f} | "
              f"{r['median_ttft_ms']:14.1f} | {r['p99_ttft_ms']:11.1f} | "
              f"{r['frontend_cpu_ms_per_request']:19.2f}")
    path = Path(args.result_dir) / "bench_api_servers.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_description(), "args": vars(args), "rows": rows},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
