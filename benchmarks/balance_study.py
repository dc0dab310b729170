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
(output tokens - 1). Before the variants, the balance gather alone is timed between dp processes:
the balance variants pay it on every step, and on a small machine it is not negligible.

  simulated (default): DP=4 on the SIMULATED runner (no weights; lockstep: every step takes the
      slowest rank's time), variants baseline / balance "full" (gate while a rank runs
      max_num_seqs) / balance "one-short" (gate at max_num_seqs - 1).
  --real: DP=2 with the real default model (SmolLM2-135M) on CPU, the same three variants.

    python benchmarks/balance_study.py            # simulated, ~3 min on 2 cores
    python benchmarks/balance_study.py --quick    # simulated, smaller (~1.5 min)
    python benchmarks/balance_study.py --output-range-ratio 0.25   # desynchronised ranks
    python benchmarks/balance_study.py --real     # real model, DP=2
"""

import argparse
import asyncio
import contextlib
import json
import logging
import multiprocessing
import os
import platform
import random
import socket
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.config import SimulatedCost, create_engine_config
from minicore.engine.async_llm import AsyncLLM
from minicore.sampling_params import SamplingParams

RESULTS_DIR = Path(__file__).resolve().parent / "results"
PUBLISHED_RESULT = {  # vllm-ascend PR #5212, "Experiment Results" (the "full" gate)
    "baseline": {"ttft_ms": 6600, "tpot_ms": 86.85, "duration_s": 591.9, "input_tok_s": 3030.5,
                 "output_tok_s": 1297.3, "req_s": 0.86},
    "balance": {"ttft_ms": 7012, "tpot_ms": 70.63, "duration_s": 501.7, "input_tok_s": 3575.7,
                "output_tok_s": 1530.7, "req_s": 1.02},
}
COLUMNS = [("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("duration_s", "e2e s"),
           ("input_tok_s", "in tok/s"), ("output_tok_s", "out tok/s"), ("req_s", "req/s")]
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


def free_port_pair() -> int:
    """A port P with P + 1 free too: the DP group rendezvous on P, the engine handshake on P + 1."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 1 >= 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair found")


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


def count_clusters(times: list[float], gap: float) -> int:
    """Groups of times closer than gap to their neighbour: the outputs of one lockstep step
    arrive within a few ms of each other, consecutive steps a step time apart."""
    times = sorted(times)
    return sum(1 for a, b in zip([float("-inf")] + times, times) if b - a > gap)


def summarize(records: dict[str, Record], input_len: int, start: float, end: float) -> dict:
    done = [r for r in records.values() if r.num_output > 0]
    duration = end - start
    total_in = input_len * len(done)
    total_out = sum(r.num_output for r in done)
    ttfts = [(r.first - r.send) * 1000 for r in done]
    tpots = [(r.last - r.first) * 1000 / (r.num_output - 1) for r in done if r.num_output > 1]
    return {
        "completed": len(done), "failed": len(records) - len(done),
        "ttft_ms": statistics.mean(ttfts), "ttft_median_ms": statistics.median(ttfts),
        "ttft_p99_ms": sorted(ttfts)[int(0.99 * (len(ttfts) - 1))],
        "tpot_ms": statistics.mean(tpots), "tpot_median_ms": statistics.median(tpots),
        "duration_s": duration, "input_tok_s": total_in / duration,
        "output_tok_s": total_out / duration, "req_s": len(done) / duration,
        "requests_per_engine": [sum(r.engine == e for r in done)
                                for e in range(max(r.engine for r in done) + 1)],
    }


def step_counts(records: dict[str, Record], token_times: list[float],
                decode_step_s: float) -> dict:
    """Lockstep only: engine 0's steps that produced tokens (its output frames) and its tokens
    per such step (how full it ran), and the steps in which some rank finished a prefill (first
    tokens, clustered over all ranks)."""
    steps = count_clusters(token_times, 0.25 * decode_step_s)
    prefill_steps = count_clusters([r.first for r in records.values() if r.first is not None],
                                   0.5 * decode_step_s)
    span = (max(token_times) - min(token_times)) if token_times else 0.0
    engine0_tokens = sum(r.num_output for r in records.values() if r.engine == 0)
    return {"steps": steps, "tokens_per_step": engine0_tokens / max(1, steps),
            "prefill_steps": prefill_steps, "mean_step_ms": 1000 * span / max(1, steps - 1)}


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
        result = summarize(records, len(work[0][0]), start, end)
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


def print_table(title: str, results: list[dict], extra: list[tuple[str, str, str]]) -> None:
    base = results[0]
    print(f"\n{title}")
    hdr = f"{'variant':<14}" + "".join(f"{label:>11}" for _, label in COLUMNS)
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['variant']:<14}" + "".join(f"{r[k]:>11.2f}" for k, _ in COLUMNS))
    for r in results[1:]:
        print(f"{r['variant'] + ' / base':<14}" +
              "".join(f"{r[k] / base[k]:>11.3f}" for k, _ in COLUMNS))
    published = {k: PUBLISHED_RESULT["balance"][k] / PUBLISHED_RESULT["baseline"][k]
                 for k, _ in COLUMNS}
    print(f"{'PR #5212':<14}" + "".join(f"{published[k]:>11.3f}" for k, _ in COLUMNS))
    extra = [c for c in extra if any(c[0] in r for r in results)]
    if extra:
        print()
        hdr = f"{'variant':<14}" + "".join(f"{label:>{len(label) + 2}}" for _, label, _ in extra)
        print(hdr)
        for r in results:
            print(f"{r['variant']:<14}" + "".join(
                f"{format(r.get(k, float('nan')), fmt):>{len(label) + 2}}"
                for k, label, fmt in extra))


def _gather_probe_rank(rank: int, size: int, port: int, calls: int, results) -> None:
    from minicore.dp.group import DPGroup

    group = DPGroup(rank, size, "127.0.0.1", port, timeout_s=60)

    async def timed():
        times = []
        for _ in range(calls):
            t = time.perf_counter()
            await group.gather_running_counts(rank)
            times.append(time.perf_counter() - t)
        return times

    times = asyncio.run(timed())
    results.put((rank, statistics.median(times) * 1000, statistics.mean(times) * 1000))
    group.destroy()


def gather_cost_ms(size: int, calls: int = 200) -> dict:
    """The balance gather's own cost on this machine: back-to-back DPGroup.gather_running_counts
    calls between `size` processes (what balance scheduling adds to every step; in the engines
    it cannot overlap the simulated step's sleep)."""
    ctx = multiprocessing.get_context("spawn")
    results, port = ctx.Queue(), free_port_pair()
    procs = [ctx.Process(target=_gather_probe_rank, args=(r, size, port, calls, results),
                         daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    try:
        per_rank = [results.get(timeout=120) for _ in procs]
    finally:
        for proc in procs:
            proc.join(5)
            if proc.is_alive():
                proc.kill()
    return {"median_ms": max(r[1] for r in per_rank), "mean_ms": max(r[2] for r in per_rank)}


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


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--real", action="store_true", help="DP=2 with the real model on CPU")
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
    ap.add_argument("--step-ms", type=float, default=30.0, help="simulated: fixed cost per step")
    ap.add_argument("--decode-seq-ms", type=float, default=0.625,
                    help="simulated: cost per decoding request in a step")
    ap.add_argument("--prefill-token-us", type=float, default=180.0,
                    help="simulated: cost per prefill token")
    ap.add_argument("--json", default=None)
    ap.add_argument("--dump-records", action="store_true",
                    help="keep every request's times in the JSON")
    args = ap.parse_args()
    if args.real:
        defaults = {"dp": 2, "num_prompts": 48, "input_len": 128, "output_len": 32,
                    "max_num_seqs": 8, "max_num_batched_tokens": 512}
    else:
        defaults = {"dp": 4, "num_prompts": 128 if args.quick else 256, "input_len": 448,
                    "output_len": 96 if args.quick else 192, "max_num_seqs": 16,
                    "max_num_batched_tokens": 2048}
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.concurrency is None:
        args.concurrency = args.dp * args.max_num_seqs
    if args.json is None:
        args.json = str(RESULTS_DIR / ("balance_study_real.json" if args.real
                                       else "balance_study_sim.json"))
    return args


async def main_async(args) -> None:
    variants, engine_args, decode_step_s = (real_setup if args.real else simulated_setup)(args)
    if args.variants:
        variants = [v for v in variants if v[0] in args.variants]
    # Vocabulary of SmolLM2, which both runners read.
    work = make_workload(args.num_prompts, args.input_len, args.output_len, 49152,
                         args.output_range_ratio)
    kind = "REAL SmolLM2-135M on CPU" if args.real else "SIMULATED runner (lockstep)"
    print(f"balance study: DP={args.dp}, {kind}; {args.num_prompts} requests of "
          f"{args.input_len} in / {args.output_len} out; max_num_seqs {args.max_num_seqs}/rank, "
          f"max_num_batched_tokens {args.max_num_batched_tokens}; client {args.client}"
          + (f" (concurrency {args.concurrency})" if args.client == "closed" else ""))
    if not args.real:
        print(f"cost: step {args.step_ms} ms + {args.decode_seq_ms} ms/decoding seq + "
              f"{args.prefill_token_us} us/prefill token -> decode step of {args.max_num_seqs} = "
              f"{decode_step_s * 1000:.1f} ms, one {args.input_len}-token prefill = "
              f"{args.input_len * args.prefill_token_us / 1000:.1f} ms", flush=True)
    results = []
    t0 = time.monotonic()
    # What the balance variants pay per step on this machine, whatever their scheduling gains.
    gather = await asyncio.wait_for(asyncio.to_thread(gather_cost_ms, args.dp), 180)
    print(f"balance gather alone, {args.dp} processes: median {gather['median_ms']:.2f} ms, "
          f"mean {gather['mean_ms']:.2f} ms per call (load average {os.getloadavg()[0]:.1f})",
          flush=True)
    for name, extra in variants:
        t = time.monotonic()
        r = await asyncio.wait_for(
            run_variant(name, {**engine_args, **extra}, work, args, args.max_num_seqs,
                        decode_step_s), VARIANT_TIMEOUT_S)
        r["wall_s"] = time.monotonic() - t
        results.append(r)
        print(f"  {name}: {r['completed']} done in {r['duration_s']:.1f} s "
              f"(start-up {r['startup_s']:.1f} s, variant wall {r['wall_s']:.1f} s)", flush=True)
    total_s = time.monotonic() - t0
    extra = [("ttft_median_ms", "TTFT p50", ".0f"), ("ttft_p99_ms", "TTFT p99", ".0f"),
             ("tpot_median_ms", "TPOT p50", ".2f"),
             ("mean_running_per_rank", "running/rank", ".2f"),
             ("frac_some_rank_ge_seq_minus_1", "t(max>=S-1)", ".2f"),
             ("frac_some_rank_full", "t(max>=S)", ".2f"),
             ("steps", "steps", ".0f"), ("tokens_per_step", "tok/step", ".1f"),
             ("mean_step_ms", "step ms", ".1f"),
             ("prefill_steps", "prefill steps", ".0f"), ("preemptions", "preempt", ".0f")]
    print_table(f"{kind}, DP={args.dp} (times in ms, durations in s; ratios to baseline; the "
                "published balance/baseline ratios for comparison)", results, extra)
    print("running/rank: time-averaged running requests per rank (frontend's view); "
          "t(max>=S-1), t(max>=S): share of\ntime some rank had >= max_num_seqs - 1 (one-short "
          "gate closed) / max_num_seqs (full gate closed) running")
    if decode_step_s is not None:
        print("steps, tok/step, step ms: engine 0's token-producing steps, its tokens per step, "
              "its mean step interval;\nprefill steps: steps in which some rank finished a "
              "prefill (first tokens clustered over all ranks)")
    print(f"\ntotal wall time {total_s:.0f} s; requests per engine: "
          + "; ".join(f"{r['variant']} {r['requests_per_engine']}" for r in results))
    payload = {
        "benchmark": "balance_study", "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "python": platform.python_version(), "platform": platform.platform(),
        "cpu_count": os.cpu_count(), "loadavg_end": os.getloadavg(),
        "args": vars(args), "engine_args": {k: (asdict(v) if k == "simulated_cost" else v)
                                            for k, v in engine_args.items()},
        "gather_cost": gather, "results": {r["variant"]: r for r in results},
        "published_result": PUBLISHED_RESULT,
        "total_wall_s": total_s,
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
