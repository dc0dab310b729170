"""Balance scheduling study: data-parallel engines with and without vllm-ascend's balance gate, side
by side in one run, in the columns of vllm-ascend PR #5212's table (DeepSeek-V3.1, 3.5K in /
1.5K out, 512 requests, batch 128; balance gave +18% output throughput, -19% TPOT, +6% TTFT).

Each variant starts its own AsyncLLM (in-process frontend, real engine processes, a real
gloo DP group on a free port pair) and runs the same workload: fixed input length, distinct random
prompt ids per request (seeded; prefix caching off, so every prefill is paid), EOS ignored, fixed
output length unless --output-range-ratio spreads it. The default client is a closed loop whose
concurrency is the engines' total slots, like the PR's `bench serve --max-concurrency` (why:
docs/BALANCE_STUDY.md); --client burst sends everything at once. TTFT and TPOT come from the
RequestOutputs the frontend streams: first output - send, and (last output - first output) /
(output tokens - 1). Before the variants, the two ways of sharing the running counts (the
all-gather and the all-reduce MAX of benchmarks/dp_collective_cost.py) are timed between dp
processes: the balance variants pay one on every step, and on a small machine it is not
negligible. The balance variants use the cheaper one unless --count-sync says which.

  simulated (default): DP=4 on the SIMULATED runner (no weights; lockstep: every step takes the
      slowest rank's time), variants baseline / balance "full" (gate while a rank runs
      max_num_seqs) / balance "one-short" (gate at max_num_seqs - 1).
  --real: DP=2 with the real default model (SmolLM2-135M) on CPU, the same three variants.
  --moe: DP=2 (--dp 4 too) expert-parallel, with benchmarks/moe_bench_model.py's random Qwen3-MoE
      model on CPU (every forward meets the other ranks in every MoE layer: a real lockstep), the
      same variants; its workload is the simulator's draw (make_random_workload: input and output
      lengths both spread by --output-range-ratio, as vllm bench's --random-range-ratio), and
      after the variants `python -m minicore simulate` runs the same settings with the cost model
      fitted by benchmarks/moe_cost_fit.py, its table printed below the measured one.

    python benchmarks/balance_study.py            # simulated, ~3 min on 2 cores
    python benchmarks/balance_study.py --quick    # simulated, smaller (~1.5 min)
    python benchmarks/balance_study.py --output-range-ratio 0.25   # desynchronised ranks
    python benchmarks/balance_study.py --real     # real model, DP=2
    python benchmarks/balance_study.py --moe --output-range-ratio 0.25   # EP MoE model, DP=2

The tables are printed by benchmarks/balance_report.py; the collectives are timed by
benchmarks/dp_collective_cost.py.
"""

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balance_report import (
    PUBLISHED_RESULT,
    print_header,
    print_results,
    simulate_same,
    step_counts,
    summarize,
)
from dp_collective_cost import COLLECTIVES, collective_cost_ms, format_cost, free_port_pair

from minicore.config import create_engine_config
from minicore.dp.simulator import make_random_workload
from minicore.engine.async_llm import AsyncLLM
from minicore.model.config import SimulatedCost
from minicore.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
# The variants' names are their --balance-threshold values, and the keys of the JSON's results.
VARIANTS = [("baseline", {}),
            ("full", {"balance_scheduling": True, "balance_threshold": "full"}),
            ("one-short", {"balance_scheduling": True, "balance_threshold": "one-short"})]
# Per variant: the whole run (start-up, warm-up, workload, shutdown) must end within this.
VARIANT_TIMEOUT_S = 420.0


@dataclass(slots=True)
class Record:
    """One request, frontend-side times (time.monotonic())."""
    send: float
    first: float | None = None
    last: float | None = None
    num_output: int = 0
    engine: int = -1


def make_workload(n: int, input_len: int, output_len: int, vocab: int,
                  output_range_ratio: float = 0.0, seed: int = 0):
    """n (prompt ids, output length) pairs: fixed input length, random ids clear of special
    tokens; output lengths uniform in output_len * [1 - ratio, 1 + ratio] (fixed at 0)."""
    rng = random.Random(seed)
    lo = round(output_len * (1 - output_range_ratio))
    hi = round(output_len * (1 + output_range_ratio))
    return [([rng.randrange(100, vocab) for _ in range(input_len)], rng.randint(lo, hi))
            for _ in range(n)]


async def one_request(client: AsyncLLM, request_id: str, prompt: list[int],
                      output_len: int, records: dict[str, Record]) -> None:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True, temperature=0.0)
    record = records[request_id] = Record(send=time.monotonic())
    async with contextlib.aclosing(client.generate(prompt, params, request_id)) as stream:
        async for output in stream:
            now = time.monotonic()
            num = len(output.outputs[0].token_ids)
            if num and record.first is None:
                record.first = now
            if num > record.num_output:
                record.last, record.num_output = now, num


async def drive(client, work, mode: str, concurrency: int, prefix: str,
                jitter_s: float = 0.0, seed: int = 0) -> dict[str, Record]:
    """Closed loop: `concurrency` workers, each sends its next request when the previous ends,
    after a random delay in [0, jitter_s) if given (a stand-in for an HTTP frontend's
    per-request latency). Burst: every request at once."""
    records: dict[str, Record] = {}
    rng = random.Random(seed)
    if mode == "burst":
        await asyncio.gather(*(one_request(client, f"{prefix}{i}", p, o, records)
                               for i, (p, o) in enumerate(work)))
        return records
    pending = iter(enumerate(work))  # shared by the workers: asyncio, so no races

    async def worker():
        for i, (prompt, output_len) in pending:
            if jitter_s > 0:
                await asyncio.sleep(rng.uniform(0, jitter_s))
            await one_request(client, f"{prefix}{i}", prompt, output_len, records)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return records


class LoadSampler:
    """Samples the engines' published running counts every `interval` s: how full the ranks are
    on average, and how often some rank is at or above a threshold (the balance gate's view)."""

    def __init__(self, client: AsyncLLM, interval: float = 0.005):
        self.client, self.interval = client, interval
        self.samples: list[list[int]] = []
        self._task: asyncio.Task | None = None

    async def _run(self):
        while True:
            stats = self.client.latest_stats
            self.samples.append([stats[e].num_running_reqs if e in stats else 0
                                 for e in range(self.client.num_engines)])
            await asyncio.sleep(self.interval)

    def __enter__(self):
        self._task = asyncio.create_task(self._run())
        return self

    def __exit__(self, *exc):
        self._task.cancel()

    def summary(self, max_num_seqs: int) -> dict:
        if not self.samples:
            return {}
        flat = [n for s in self.samples for n in s]
        return {"mean_running_per_rank": statistics.mean(flat),
                "frac_some_rank_ge_seq_minus_1": statistics.mean(
                    max(s) >= max_num_seqs - 1 for s in self.samples),
                "frac_some_rank_full": statistics.mean(
                    max(s) >= max_num_seqs for s in self.samples)}


async def run_variant(name: str, engine_args: dict, work, args, max_num_seqs: int,
                      decode_step_s: float | None) -> dict:
    port = free_port_pair()
    config = create_engine_config(**engine_args, data_parallel_rpc_port=port)
    t_start = time.monotonic()
    client = await AsyncLLM.from_engine_config(config, startup_timeout=300.0)
    try:
        startup_s = time.monotonic() - t_start
        # Warm-up: a first wave through every rank (gloo's first collectives, the model's
        # first forwards), not timed.
        warm = [(p, 4) for p, _ in work[:2 * client.num_engines]]
        await drive(client, warm, "burst", 0, "warm-")
        engine_of: dict[str, int] = {}
        token_times: list[float] = []  # engine 0's token outputs: one time per step

        def on_new_tokens(state, num_tokens, interval):
            engine_of[state.request_id] = state.engine_index
            if state.engine_index == 0:
                token_times.append(state.last_token_time)

        client.output_processor.on_new_tokens = on_new_tokens
        with LoadSampler(client) as sampler:
            start = time.monotonic()
            records = await drive(client, work, args.client, args.concurrency, "req-",
                                  args.arrival_jitter_ms / 1000)
            end = time.monotonic()
        client.output_processor.on_new_tokens = None
        for rid, record in records.items():
            record.engine = engine_of.get(rid, -1)
        result = summarize(records, statistics.mean(len(p) for p, _ in work), start, end)
        if decode_step_s is not None:
            result.update(step_counts(records, token_times, decode_step_s))
        result.update(sampler.summary(max_num_seqs))
        result["preemptions"] = sum(s.num_preemptions for s in client.latest_stats.values())
        result["startup_s"] = startup_s
        if args.dump_records:
            result["records"] = [[rid, r.engine, r.send - start, r.first - start, r.last - start,
                                  r.num_output] for rid, r in records.items()]
        return {"variant": name, **result}
    finally:
        await client.shutdown()


def common_engine_args(args) -> dict:
    # Prefix caching off: the prompts share no prefix anyway, and every prefill must be paid.
    return {"data_parallel_size": args.dp, "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.input_len + 2 * args.output_len + 64,
            "enable_prefix_caching": False}


def simulated_setup(args) -> tuple[list, dict, float]:
    cost = SimulatedCost(step_s=args.step_ms / 1000, prefill_token_s=args.prefill_token_us / 1e6,
                         decode_seq_s=args.decode_seq_ms / 1000)
    engine_args = {"runner": "simulated", "simulated_cost": cost, **common_engine_args(args)}
    decode_step_s = cost.step_s + cost.decode_seq_s * args.max_num_seqs
    return VARIANTS, engine_args, decode_step_s


def real_setup(args) -> tuple[list, dict, None]:
    engine_args = common_engine_args(args)
    return VARIANTS, engine_args, None


def moe_setup(args) -> tuple[list, dict, float]:
    """Expert-parallel engines on the benchmark MoE model; decode_step_s (for the step counts'
    clustering) from the fitted cost model."""
    from moe_bench_model import bench_model_dir

    model = args.model or str(bench_model_dir())
    engine_args = {**common_engine_args(args), "model": model, "enable_expert_parallel": True}
    engine_args["max_model_len"] += args.input_len  # inputs spread too
    decode_step_s = (args.step_ms + args.decode_seq_ms * args.max_num_seqs) / 1000
    return VARIANTS, engine_args, decode_step_s


# Fitted to the benchmark MoE model, DP=2 expert parallel, on this machine by
# benchmarks/moe_cost_fit.py (docs/BALANCE_STUDY.md, "Expert-parallel MoE model, DP=2").
# 2026-11-23, load 0.1 -> 1.0: decode steps 41.5 / 52.2 / 54.1 / 61.7 ms at 1 / 2 / 4 / 8 a rank,
# TTFT slope 462 us per prompt token.
MOE_COST = {"step_ms": 43.2, "decode_seq_ms": 2.44, "prefill_token_us": 462.0}
SIM_COST = {"step_ms": 30.0, "decode_seq_ms": 0.625, "prefill_token_us": 180.0}


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="DP=2 with the real model on CPU")
    ap.add_argument("--moe", action="store_true",
                    help="expert parallel with the benchmark MoE model on CPU (DP=2 unless --dp)")
    ap.add_argument("--model", default=None,
                    help="--moe: this MoE model directory instead of the benchmark model")
    ap.add_argument("--quick", action="store_true", help="smaller simulated run")
    ap.add_argument("--client", choices=["closed", "burst"], default="closed")
    ap.add_argument("--concurrency", type=int, default=None,
                    help="closed-loop concurrency (default: dp * max_num_seqs, every slot)")
    ap.add_argument("--output-range-ratio", type=float, default=0.0,
                    help="output lengths uniform in output_len * [1 - r, 1 + r] (0: fixed)")
    ap.add_argument("--arrival-jitter-ms", type=float, default=0.0,
                    help="closed loop: each request is sent after a random delay in [0, this)")
    ap.add_argument("--variants", nargs="*", default=None, choices=[n for n, _ in VARIANTS],
                    help="run only these variants")
    ap.add_argument("--dp", type=int, default=None)
    ap.add_argument("--num-prompts", type=int, default=None)
    ap.add_argument("--input-len", type=int, default=None)
    ap.add_argument("--output-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--step-ms", type=float, default=None,
                    help="simulated: fixed cost per step (--moe: the fitted cost model's)")
    ap.add_argument("--decode-seq-ms", type=float, default=None,
                    help="simulated: cost per decoding request in a step")
    ap.add_argument("--prefill-token-us", type=float, default=None,
                    help="simulated: cost per prefill token")
    ap.add_argument("--count-sync", choices=["cheaper", *COLLECTIVES], default="cheaper",
                    help="the balance variants' --balance-count-sync (default: whichever the "
                         "timing before the variants finds cheaper)")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump-records", action="store_true",
                    help="keep every request's times in the JSON")
    args = ap.parse_args()
    if args.real and args.moe:
        ap.error("--real and --moe are two different studies")
    if args.real:
        defaults = {"dp": 2, "num_prompts": 48, "input_len": 128, "output_len": 32,
                    "max_num_seqs": 8, "max_num_batched_tokens": 512}
    elif args.moe:
        defaults = {"dp": 2, "num_prompts": 96, "input_len": 128, "output_len": 64,
                    "max_num_seqs": 8, "max_num_batched_tokens": 512, **MOE_COST}
    else:
        defaults = {"dp": 4, "num_prompts": 128 if args.quick else 256, "input_len": 448,
                    "output_len": 96 if args.quick else 192, "max_num_seqs": 16,
                    "max_num_batched_tokens": 2048}
    for k, v in {**SIM_COST, **defaults}.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.concurrency is None:
        args.concurrency = args.dp * args.max_num_seqs
    if args.json is None:
        name = "real" if args.real else f"moe_dp{args.dp}" if args.moe else "sim"
        args.json = str(RESULTS_DIR / f"balance_study_{name}.json")
    return args


async def choose_count_sync(args) -> tuple[str, dict]:
    """Time both ways of sharing the running counts between args.dp processes (the balance
    variants pay one on every step) and pick the one for the balance variants: args.count_sync,
    or the one with the lower median."""
    cost = await asyncio.wait_for(asyncio.to_thread(collective_cost_ms, args.dp), 180)
    print("balance count sync alone, " + format_cost(args.dp, cost), flush=True)
    if args.count_sync != "cheaper":
        return args.count_sync, cost
    chosen = min(COLLECTIVES, key=lambda name: cost[name]["median_ms"])
    print(f"the balance variants run with --balance-count-sync {chosen} (the cheaper here)")
    return chosen, cost


async def run_variants(args, variants, engine_args: dict, work, count_sync: str,
                       decode_step_s: float | None) -> list[dict]:
    results = []
    for name, extra in variants:
        if extra.get("balance_scheduling"):
            extra = {**extra, "balance_count_sync": count_sync}
        t = time.monotonic()
        r = await asyncio.wait_for(
            run_variant(name, {**engine_args, **extra}, work, args, args.max_num_seqs,
                        decode_step_s), VARIANT_TIMEOUT_S)
        r["wall_s"] = time.monotonic() - t
        results.append(r)
        print(f"  {name}: {r['completed']} done in {r['duration_s']:.1f} s "
              f"(start-up {r['startup_s']:.1f} s, variant wall {r['wall_s']:.1f} s; load average "
              f"{os.getloadavg()[0]:.2f})", flush=True)
    return results


async def main_async(args) -> None:
    setup = real_setup if args.real else moe_setup if args.moe else simulated_setup
    variants, engine_args, decode_step_s = setup(args)
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants]
    if args.moe:
        # The simulator's own draw (its default vocabulary, ids < SmolLM2's 49152), so that
        # `minicore simulate` with the same settings sees the same requests.
        work = [(r.prompt_token_ids, r.output_len) for r in make_random_workload(
            args.num_prompts, args.input_len, args.output_len, args.output_range_ratio)]
    else:
        # Vocabulary of SmolLM2, which both runners read.
        work = make_workload(args.num_prompts, args.input_len, args.output_len, 49152,
                             args.output_range_ratio)
    kind = print_header(args, decode_step_s)
    t0 = time.monotonic()
    count_sync, sync_cost = await choose_count_sync(args)
    results = await run_variants(args, variants, engine_args, work, count_sync, decode_step_s)
    total_s = time.monotonic() - t0
    print_results(kind, args, results, count_sync, decode_step_s is not None, total_s)
    simulated = simulate_same(args) if args.moe else None
    payload = {
        "benchmark": "balance_study", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg(),
        "args": vars(args), "engine_args": {k: (asdict(v) if k == "simulated_cost" else v)
                                            for k, v in engine_args.items()},
        "count_sync_cost": sync_cost, "balance_count_sync": count_sync,
        "results": {r["variant"]: r for r in results}, "published_result": PUBLISHED_RESULT,
        "total_wall_s": total_s, "simulated_same_settings": simulated,
    }
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=2))
    print(f"wrote {out}")


def main() -> None:
    logging.basicConfig(level=logging.WARNING)
    asyncio.run(main_async(parse_args()))


if __name__ == "__main__":
    main()
