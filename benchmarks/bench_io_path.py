"""IO-path benchmark: what the frontend <-> engine path costs by itself.

The engine is a real engine process (EngineCoreProc: sockets, busy loop, scheduler, forward in a
worker thread) with the SIMULATED model runner at zero cost, so a step returns at once and what is
measured is everything else: AsyncLLM (validation, msgpack, ZMQ ipc, detokenizing,
per-request streams) and the engine's loop. The frontend runs on uvloop, as the server does.

Scenarios:
  short      many short requests (8 prompt tokens, max_tokens 4) at a fixed concurrency:
             requests/s, and their latency.
  stream-1   one long stream alone: the time between streamed tokens is the latency the IO path
             adds per token (the model takes no time).
  stream-64  64 concurrent long streams: per-token interval (an interval that brought k tokens
             counts as k intervals of 1/k) and aggregate output tokens/s.

Each scenario runs --repeats times (the machine is shared: other processes steal its 2 cores);
the table shows the median repeat, the JSON every repeat.

    python benchmarks/bench_io_path.py            # full run; JSON to benchmarks/results/
    python benchmarks/bench_io_path.py --quick    # a short run
    python benchmarks/bench_io_path.py --profile  # also cProfile the frontend during "short"
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import io
import json
import os
import platform
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.config import create_engine_config  # noqa: E402
from minicore.engine.async_llm import AsyncLLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

PROMPT_LEN = 8
TARGETS = {"short_requests_per_s": 2000, "stream_1_ms_per_token": 1.0}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def prompts(n: int, vocab_size: int, rng: random.Random) -> list[list[int]]:
    return [[rng.randrange(100, vocab_size) for _ in range(PROMPT_LEN)] for _ in range(n)]


async def run_stream(client: AsyncLLM, prompt: list[int], max_tokens: int,
                     request_id: str, intervals: list[float] | None = None) -> float:
    """Run one request to its end; return its latency. With intervals, record per-token
    intervals as the consumer saw them."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    start = last = time.perf_counter()
    num_tokens = 0
    async for output in client.generate(prompt, params, request_id):
        now = time.perf_counter()
        new = len(output.outputs[0].token_ids) - num_tokens
        if intervals is not None and num_tokens and new:
            intervals.extend([(now - last) / new] * new)
        num_tokens += new
        last = now
    assert num_tokens == max_tokens, (request_id, num_tokens)
    return last - start


async def bench_short(client, num_requests: int, concurrency: int, max_tokens: int,
                      rng: random.Random, profile: bool) -> dict:
    batch = prompts(num_requests, client.vocab_size, rng)
    semaphore = asyncio.Semaphore(concurrency)
    latencies: list[float] = []

    async def one(i: int):
        async with semaphore:
            latencies.append(await run_stream(client, batch[i], max_tokens, f"short-{i}"))

    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    if profiler:
        profiler.disable()
    elapsed = time.perf_counter() - start
    result = {"scenario": "short", "requests": num_requests, "concurrency": concurrency,
              "prompt_tokens": PROMPT_LEN, "max_tokens": max_tokens, "seconds": elapsed,
              "requests_per_s": num_requests / elapsed,
              "output_tokens_per_s": num_requests * max_tokens / elapsed,
              "latency_ms_mean": 1e3 * statistics.fmean(latencies),
              "latency_ms_p50": 1e3 * percentile(latencies, 0.5),
              "latency_ms_p99": 1e3 * percentile(latencies, 0.99)}
    if profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        result["profile"] = out.getvalue()
    return result


async def bench_streams(client, num_streams: int, max_tokens: int, rng: random.Random) -> dict:
    batch = prompts(num_streams, client.vocab_size, rng)
    intervals: list[float] = []
    start = time.perf_counter()
    await asyncio.gather(*(run_stream(client, batch[i], max_tokens, f"stream-{num_streams}-{i}",
                                      intervals) for i in range(num_streams)))
    elapsed = time.perf_counter() - start
    return {"scenario": f"stream-{num_streams}", "streams": num_streams, "max_tokens": max_tokens,
            "seconds": elapsed, "output_tokens_per_s": num_streams * max_tokens / elapsed,
            "ms_per_token_mean": 1e3 * statistics.fmean(intervals),
            "ms_per_token_p50": 1e3 * percentile(intervals, 0.5),
            "ms_per_token_p99": 1e3 * percentile(intervals, 0.99)}


async def main_async(args) -> dict:
    config = create_engine_config(runner="simulated", max_num_seqs=256, max_model_len=4096)
    client = await AsyncLLM.from_engine_config(config)
    rng = random.Random(0)
    try:
        # Warm up both processes (imports, first allocations) before timing.
        await bench_short(client, 200, args.concurrency, 4, rng, False)
        scenarios = [
            lambda: bench_short(client, args.num_requests, args.concurrency, 4, rng, args.profile),
            lambda: bench_streams(client, 1, args.stream_tokens, rng),
            lambda: bench_streams(client, 64, args.stream_tokens // 4, rng),
        ]
        results = []
        for scenario in scenarios:
            repeats = [await scenario() for _ in range(args.repeats)]
            key = "requests_per_s" if "requests_per_s" in repeats[0] else "ms_per_token_mean"
            median = sorted(repeats, key=lambda r: r[key])[len(repeats) // 2]
            results.append({**median, "repeats": [r[key] for r in repeats]})
    finally:
        await client.shutdown()
    return {"benchmark": "bench_io_path", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "quick": args.quick, "targets": TARGETS,
            "load_average": os.getloadavg(),
            "results": results}


def print_table(report: dict) -> None:
    print(f"\nIO path, simulated zero-cost runner ({report['cpu_count']} CPUs)")
    print(f"{'scenario':<10} {'req/s':>8} {'out tok/s':>10} {'lat mean ms':>12} "
          f"{'lat p99 ms':>11} {'ms/token mean':>14} {'p50':>7} {'p99':>7}")
    def fmt(r, key, width, spec=".1f"):
        return f"{r[key]:>{width}{spec}}" if key in r else " " * width

    for r in report["results"]:
        print(f"{r['scenario']:<10} {fmt(r, 'requests_per_s', 8, '.0f')} "
              f"{fmt(r, 'output_tokens_per_s', 10, '.0f')} {fmt(r, 'latency_ms_mean', 12)} "
              f"{fmt(r, 'latency_ms_p99', 11)} {fmt(r, 'ms_per_token_mean', 14, '.3f')} "
              f"{fmt(r, 'ms_per_token_p50', 7, '.3f')} {fmt(r, 'ms_per_token_p99', 7, '.3f')}")
    for r in report["results"]:
        print(f"  {r['scenario']}: repeats " + ", ".join(f"{x:.3g}" for x in r["repeats"]))
    print("load average before the run: " + ", ".join(f"{x:.2f}" for x in report["load_average"]))
    short, stream_1 = report["results"][0], report["results"][1]
    print(f"targets: >= {TARGETS['short_requests_per_s']} short requests/s "
          f"(got {short['requests_per_s']:.0f}); < {TARGETS['stream_1_ms_per_token']} ms per "
          f"streamed token (got {stream_1['ms_per_token_mean']:.3f})")
    if "profile" in short:
        print(short["profile"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer requests and tokens")
    parser.add_argument("--num-requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="cProfile the frontend (short)")
    parser.add_argument("--output", default=str(Path(__file__).parent / "results" /
                                                "bench_io_path.json"))
    args = parser.parse_args()
    args.num_requests = args.num_requests or (500 if args.quick else 2000)
    args.stream_tokens = args.stream_tokens or (256 if args.quick else 1024)
    report = uvloop.run(main_async(args))
    print_table(report)
    if not args.quick:
        for r in report["results"]:
            r.pop("profile", None)
        Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
