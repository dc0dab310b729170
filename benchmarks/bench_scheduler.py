"""Scheduler overhead benchmark: microseconds per engine step spent in minicore's pure-Python
scheduler, ``schedule()`` and ``update_from_output()`` timed separately.

Scenarios (block_size 16, prefix caching on, FCFS):
  decode-N      N requests with 128-token prompts, admitted and prefilled first (untimed), then many
                timed decode steps; ignore_eos and an unreachable max_tokens, so none finish.
                N = 32, 256, 1024.
  prefill-mix   64 long-running decodes plus a steady stream of new 512-token requests
                (max_tokens 4, so they finish and are replaced) under a 2048-token budget.

The fake model's work (building ModelRunnerOutput: one token per request that samples, [] for a
request mid-prefill) and add_request() are not timed.  Each scenario is measured in several
repeats of many steps; the table shows the median over repeats of the mean per step.

    python benchmarks/bench_scheduler.py             # full run; JSON to benchmarks/results/
    python benchmarks/bench_scheduler.py --quick     # a short run
    python benchmarks/bench_scheduler.py --profile   # also cProfile decode-256 (top by tottime)
    python benchmarks/bench_scheduler.py --gc-freeze # gc.freeze() after set-up, as an engine does
    python benchmarks/bench_scheduler.py --trace-steps /tmp/t.json  # also with the step tracer

--trace-steps runs each scenario twice side by side, on two schedulers set up alike, one with the
engine's StepTracer (minicore/tracing/step_tracer.py) writing to PATH, their repeats alternated;
the tracer's writer thread competes for the GIL here (no forward releases it), so this is the
tracer's worst case. Besides the timed step it reports each twin's CPU time per step (the
process's, both threads, the fake model's step included, the trace written before the clock
stops): on a shared machine the steadier measure of what tracing costs.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
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
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.config import CacheConfig, SchedulerConfig  # noqa: E402
from minicore.request import Request  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402
from minicore.scheduler import Scheduler  # noqa: E402
from minicore.scheduler.output import ModelRunnerOutput  # noqa: E402
from minicore.tracing.step_trace import TraceWriter  # noqa: E402
from minicore.tracing.step_tracer import StepTracer  # noqa: E402

BLOCK_SIZE = 16
VOCAB = 32000
EOS = 2
REFERENCE = {
    # vLLM 0.32's own v1 scheduler driven the same way on this machine (issue 2).
    "vllm_0.32_decode_256_us": {"schedule": 2800, "update": 1100, "total": 3900},
    "vllm_0.32_decode_32_us": {"total": 540},
    "target_decode_256_total_us": 500,
    "target_growth": "at most linear in the number of running requests",
}


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fake_output(s: Scheduler, out) -> ModelRunnerOutput:
    """One token for every scheduled request that has caught up with its tokens, [] otherwise."""
    req_ids = list(out.num_scheduled_tokens)
    requests = s.requests
    sampled = []
    for rid in req_ids:
        r = requests.get(rid)
        if r is not None and r.num_computed_tokens >= r.num_tokens:
            sampled.append([(r.num_tokens * 7919) % (VOCAB - 3) + 3])  # never EOS
        else:
            sampled.append([])
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=sampled)


def add_decodes(s: Scheduler, n: int, prompt_len: int, rng: random.Random) -> None:
    """Add n never-ending requests and run (untimed) until all are admitted and prefilled."""
    params = SamplingParams(max_tokens=10**9, ignore_eos=True)
    for i in range(n):
        prompt = [rng.randrange(3, VOCAB) for _ in range(prompt_len)]
        s.add_request(Request(f"d{i}", prompt, params, eos_token_id=EOS, arrival_time=float(i)))
    for _ in range(10_000):
        out = s.schedule()
        s.update_from_output(out, fake_output(s, out))
        if not s.waiting and all(r.num_computed_tokens == r.num_tokens - 1 for r in s.running):
            break


class Scenario:
    name: str

    def setup(self) -> Scheduler: ...

    def before_step(self, s: Scheduler) -> None:
        pass


class Decode(Scenario):
    def __init__(self, n: int, total_steps: int, prompt_len: int = 128):
        self.name = f"decode-{n}"
        self.n, self.prompt_len = n, prompt_len
        self.max_model_len = prompt_len + total_steps + 256
        self.num_blocks = n * cdiv(self.max_model_len, BLOCK_SIZE) + 16

    def setup(self) -> Scheduler:
        rng = random.Random(0)
        s = Scheduler(
            SchedulerConfig(max_num_seqs=max(self.n, 1), max_num_batched_tokens=8192,
                            max_model_len=self.max_model_len),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=self.num_blocks),
        )
        add_decodes(s, self.n, self.prompt_len, rng)
        for _ in range(5):
            out = s.schedule()
            s.update_from_output(out, fake_output(s, out))
        assert len(s.running) == self.n and not s.waiting, (len(s.running), len(s.waiting))
        return s


class PrefillMix(Scenario):
    def __init__(self, total_steps: int, n_decode: int = 64, prompt_len: int = 512,
                 budget: int = 2048, queue_depth: int = 8):
        self.name = "prefill-mix"
        self.n_decode, self.prompt_len, self.budget = n_decode, prompt_len, budget
        self.queue_depth = queue_depth
        self.max_model_len = 128 + total_steps + 256
        assert self.max_model_len >= prompt_len + 16
        self.num_blocks = (n_decode * cdiv(self.max_model_len, BLOCK_SIZE)
                           + 64 * cdiv(prompt_len + 8, BLOCK_SIZE) + 16)
        self.rng = random.Random(1)
        self.next_id = 0

    def setup(self) -> Scheduler:
        s = Scheduler(
            SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=self.budget,
                            max_model_len=self.max_model_len),
            CacheConfig(block_size=BLOCK_SIZE, num_blocks=self.num_blocks),
        )
        add_decodes(s, self.n_decode, 128, self.rng)
        for _ in range(20):  # reach the steady state of the stream
            self.before_step(s)
            out = s.schedule()
            s.update_from_output(out, fake_output(s, out))
        return s

    def before_step(self, s: Scheduler) -> None:
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        while len(s.waiting) < self.queue_depth:
            self.next_id += 1
            prompt = [self.rng.randrange(3, VOCAB) for _ in range(self.prompt_len)]
            s.add_request(Request(f"p{self.next_id}", prompt, params, eos_token_id=EOS,
                                  arrival_time=1e6 + self.next_id))


def time_steps(sc: Scenario, s: Scheduler, steps: int) -> dict:
    sched_ns = upd_ns = 0
    running = tokens = 0
    perf = time.perf_counter_ns
    for _ in range(steps):
        sc.before_step(s)
        t0 = perf()
        out = s.schedule()
        t1 = perf()
        mro = fake_output(s, out)
        running += len(s.running)
        tokens += out.total_num_scheduled_tokens
        t2 = perf()
        s.update_from_output(out, mro)
        t3 = perf()
        sched_ns += t1 - t0
        upd_ns += t3 - t2
    return {"schedule_us": sched_ns / steps / 1e3, "update_us": upd_ns / steps / 1e3,
            "running": running / steps, "tokens": tokens / steps}


def run_scenario(sc: Scenario, repeats: int, steps: int, gc_freeze: bool = False,
                 writer: TraceWriter | None = None) -> dict:
    """The scenario's figures; with a writer also on a traced twin, repeats alternated."""
    s = sc.setup()
    traced = sc.setup() if writer is not None else None
    if traced is not None:
        StepTracer(writer, traced, SimpleNamespace(execute_dummy_batch=lambda: None))
    if gc_freeze:  # what an engine does after start-up: long-lived objects leave the GC's view
        gc.collect()
        gc.freeze()
    reps, traced_reps, cpu, traced_cpu = [], [], [], []
    for _ in range(repeats):
        gc.collect()
        reps.append(time_steps(sc, s, steps))
        if traced is not None:
            gc.collect()
            traced_reps.append(time_steps(sc, traced, steps))
            cpu.append(cpu_per_step(sc, s, steps))
            traced_cpu.append(cpu_per_step(sc, traced, steps, writer))
    result = {"scenario": sc.name, **summarize(reps), "repeats": repeats,
              "steps_per_repeat": steps, "preemptions": s.num_preemptions,
              "gc_freeze": gc_freeze}
    if traced is not None:
        writer.flush(60)
        result["traced"] = summarize(traced_reps)
        result["trace_overhead_pct"] = 100 * (result["traced"]["total_us"] / result["total_us"] - 1)
        result["cpu_us"], result["traced_cpu_us"] = map(statistics.median, (cpu, traced_cpu))
        result["trace_cpu_overhead_pct"] = 100 * (result["traced_cpu_us"] / result["cpu_us"] - 1)
    if gc_freeze:
        gc.unfreeze()
    del s, traced
    gc.collect()
    return result


def cpu_per_step(sc: Scenario, s: Scheduler, steps: int,
                 writer: TraceWriter | None = None) -> float:
    """The process's CPU microseconds per whole step (the fake model's included), a traced
    scheduler's records written before the clock stops."""
    start = time.process_time()
    for _ in range(steps):
        sc.before_step(s)
        out = s.schedule()
        s.update_from_output(out, fake_output(s, out))
    if writer is not None:
        writer.flush(60)
    return (time.process_time() - start) / steps * 1e6


def summarize(reps: list[dict]) -> dict:
    totals = [r["schedule_us"] + r["update_us"] for r in reps]
    running = statistics.mean(r["running"] for r in reps)
    total = statistics.median(totals)
    return {"running": running, "tokens_per_step": statistics.mean(r["tokens"] for r in reps),
            "schedule_us": statistics.median(r["schedule_us"] for r in reps),
            "update_us": statistics.median(r["update_us"] for r in reps), "total_us": total,
            "per_request_us": total / running if running else None,
            "total_us_min": min(totals), "total_us_max": max(totals)}


def profile_decode(n: int, steps: int, top: int) -> str:
    """cProfile of schedule() + update_from_output() only (the fake model is not profiled)."""
    sc = Decode(n, total_steps=steps + 64)
    s = sc.setup()
    prof = cProfile.Profile()
    for _ in range(steps):
        prof.enable()
        out = s.schedule()
        prof.disable()
        mro = fake_output(s, out)
        prof.enable()
        s.update_from_output(out, mro)
        prof.disable()
    buf = io.StringIO()
    stats = pstats.Stats(prof, stream=buf)
    stats.sort_stats("tottime").print_stats(top)
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short run (fewer repeats and steps)")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None, help="timed steps per repeat")
    ap.add_argument("--profile", action="store_true",
                    help="also cProfile decode-256 and print the top functions by tottime")
    ap.add_argument("--gc-freeze", action="store_true",
                    help="gc.freeze() after each scenario's set-up (default: plain GC)")
    ap.add_argument("--trace-steps", metavar="PATH", default=None,
                    help="also run each scenario with the step tracer writing to PATH (replaced)")
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results"
                                          / "bench_scheduler.json"))
    args = ap.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    steps = args.steps or (40 if args.quick else 200)
    # Each scheduler steps twice as often with --trace-steps (timed, then CPU-timed).
    total_steps = repeats * steps * (2 if args.trace_steps else 1) + 64

    scenarios = [Decode(32, total_steps), Decode(256, total_steps), Decode(1024, total_steps),
                 PrefillMix(total_steps)]
    print(f"minicore scheduler overhead per step (median of {repeats} repeats x {steps} steps), "
          f"Python {platform.python_version()}, GC "
          f"{'frozen after set-up' if args.gc_freeze else 'default'}")
    print("reference: vLLM 0.32 v1 scheduler ~3,900 us/step at 256 running (2,800 schedule + "
          "1,100 update), ~540 us at 32; target < 500 us at 256, growth at most linear")
    hdr = (f"{'scenario':<13} {'running':>8} {'tok/step':>9} {'schedule us':>12} {'update us':>10} "
           f"{'total us':>9} {'us/req':>7}")
    print(hdr)
    print("-" * len(hdr))
    results = []
    writer = TraceWriter(args.trace_steps, 0, "DP rank 0", fresh=True) if args.trace_steps else None
    for sc in scenarios:
        r = run_scenario(sc, repeats, steps, args.gc_freeze, writer)
        results.append(r)
        print(f"{r['scenario']:<13} {r['running']:>8.1f} {r['tokens_per_step']:>9.0f} "
              f"{r['schedule_us']:>12.1f} {r['update_us']:>10.1f} {r['total_us']:>9.1f} "
              f"{r['per_request_us']:>7.2f}", flush=True)
        if writer is not None:
            t = r["traced"]
            print(f"{'  traced':<13} {'':>8} {'':>9} {t['schedule_us']:>12.1f} "
                  f"{t['update_us']:>10.1f} {t['total_us']:>9.1f} "
                  f"{r['trace_overhead_pct']:>+6.1f}%  CPU/step {r['cpu_us']:.1f} -> "
                  f"{r['traced_cpu_us']:.1f} us ({r['trace_cpu_overhead_pct']:+.1f}%)",
                  flush=True)
    if writer is not None:
        writer.close()

    by = {r["scenario"]: r for r in results}
    d32, d256, d1024 = by["decode-32"], by["decode-256"], by["decode-1024"]
    growth = {
        "per_request_us_32": d32["per_request_us"], "per_request_us_256": d256["per_request_us"],
        "per_request_us_1024": d1024["per_request_us"],
        "ratio_total_1024_over_256": d1024["total_us"] / d256["total_us"],  # linear: 4.0
        "ratio_total_256_over_32": d256["total_us"] / d32["total_us"],  # linear: 8.0
    }
    verdict = {
        "decode_256_total_us": d256["total_us"],
        "meets_target_500us": d256["total_us"] < REFERENCE["target_decode_256_total_us"],
        "speedup_vs_vllm_256": REFERENCE["vllm_0.32_decode_256_us"]["total"] / d256["total_us"],
        "at_most_linear": growth["ratio_total_1024_over_256"] <= 4.0 * 1.15,
    }
    print(f"\ndecode-256: {d256['total_us']:.0f} us/step -> "
          f"{'meets' if verdict['meets_target_500us'] else 'MISSES'} the < 500 us target, "
          f"{verdict['speedup_vs_vllm_256']:.1f}x vLLM 0.32's 3,900 us")
    print(f"growth: 256->1024 x{growth['ratio_total_1024_over_256']:.2f} (linear 4.0), "
          f"32->256 x{growth['ratio_total_256_over_32']:.2f} (linear 8.0); us/request "
          f"{growth['per_request_us_32']:.2f} / {growth['per_request_us_256']:.2f} / "
          f"{growth['per_request_us_1024']:.2f}")

    payload = {
        "benchmark": "bench_scheduler", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "quick": args.quick, "gc_freeze": args.gc_freeze,
        "trace_steps": args.trace_steps,
        "block_size": BLOCK_SIZE,
        "results": results, "growth": growth, "verdict": verdict, "reference": REFERENCE,
    }
    if args.profile:
        text = profile_decode(256, steps, 25)
        print(f"\ncProfile, decode-256, {steps} steps (schedule + update), by tottime:")
        print(text)
        payload["profile_decode_256"] = text
    out_path = Path(args.json)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
