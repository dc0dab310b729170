"""What balance scheduling's per-step collective costs on this machine:
DPGroup.gather_running_counts (the all-gather of every rank's len(running), as vllm-ascend PR
#5212's balance_gather) against DPGroup.max_running_count (an all-reduce MAX of one int64, all the
gate reads), between `size` spawned processes with a real gloo group, called back to back through
the same thread-and-event-loop path the engines use.

The two are timed in the same run, interleaved: each round calls both, alternating which goes first,
so that a change of load during the run hits both alike. A few untimed rounds warm the group up.
Each rank times its own calls; the figures are the slowest rank's median and mean (a collective
ends for all ranks together, and the slowest one is what a lockstep step waits for).

    python benchmarks/dp_collective_cost.py                      # 2 and 4 processes, 400 rounds
    python benchmarks/dp_collective_cost.py --sizes 4 --rounds 1000 --repeats 3
"""

import argparse
import asyncio
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.ports import free_port_pair  # noqa: E402  (balance_study imports it from here)

COLLECTIVES = ("all-gather", "all-reduce-max")
WARMUP_ROUNDS = 20


def _probe_rank(rank: int, size: int, port: int, rounds: int, results) -> None:
    from minicore.dp.group import DPGroup

    group = DPGroup(rank, size, "127.0.0.1", port, timeout_s=60)
    calls = {"all-gather": group.gather_running_counts, "all-reduce-max": group.max_running_count}

    async def timed():
        times = {name: [] for name in COLLECTIVES}
        for i in range(WARMUP_ROUNDS + rounds):
            order = COLLECTIVES if i % 2 == 0 else COLLECTIVES[::-1]
            for name in order:
                t = time.perf_counter()
                await calls[name](rank)
                if i >= WARMUP_ROUNDS:
                    times[name].append(time.perf_counter() - t)
        return times

    results.put((rank, asyncio.run(timed())))
    group.destroy()


def collective_cost_ms(size: int, rounds: int = 400) -> dict[str, dict[str, float]]:
    """{collective: {"median_ms", "mean_ms"}}: the slowest rank's, over `rounds` interleaved
    calls of each between `size` processes."""
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port_pair()
    procs = [ctx.Process(target=_probe_rank, args=(r, size, port, rounds, results), daemon=True)
             for r in range(size)]
    for proc in procs:
        proc.start()
    try:
        per_rank = [results.get(timeout=120)[1] for _ in procs]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return {name: {"median_ms": max(statistics.median(t[name]) for t in per_rank) * 1000,
                   "mean_ms": max(statistics.mean(t[name]) for t in per_rank) * 1000}
            for name in COLLECTIVES}


def format_cost(size: int, cost: dict[str, dict[str, float]]) -> str:
    gather, reduce = cost["all-gather"], cost["all-reduce-max"]
    return (f"{size} processes: all-gather median {gather['median_ms']:.3f} ms, mean "
            f"{gather['mean_ms']:.3f} ms; all-reduce MAX median {reduce['median_ms']:.3f} ms, mean "
            f"{reduce['mean_ms']:.3f} ms (ratio of medians "
            f"{reduce['median_ms'] / gather['median_ms']:.2f}; load average "
            f"{os.getloadavg()[0]:.2f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2, 4], help="numbers of processes")
    ap.add_argument("--rounds", type=int, default=400, help="timed calls of each collective")
    ap.add_argument("--repeats", type=int, default=1, help="runs per size")
    args = ap.parse_args()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    for _ in range(args.repeats):
        for size in args.sizes:
            print(format_cost(size, collective_cost_ms(size, args.rounds)), flush=True)
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
