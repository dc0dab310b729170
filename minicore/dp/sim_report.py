"""python -m minicore simulate: the balance gate against the baseline on simulated DP ranks.

Runs minicore/dp/simulator.py once per variant (the baseline, and each balance threshold of
minicore/scheduler/balance.py) on the same workload, then prints the columns of vllm-ascend PR
#5212's result table with the ratios to the baseline, and writes the results with the keys of
`vllm bench serve --save-result` (vllm/benchmarks/serve.py). Engine flags have `vllm serve`'s
names, workload flags `vllm bench serve`'s. Everything here is simulated, and says so.
"""

import argparse
import json
import math
import statistics
import time
from dataclasses import fields
from pathlib import Path

from minicore.config import SUB_CONFIGS, CacheConfig, SchedulerConfig
from minicore.dp.sim_trace import NO_TRACE, SimTrace
from minicore.dp.simulator import (
    CostModel,
    DPSimulator,
    SimConfig,
    SimRequest,
    StepRecord,
    make_random_workload,
)
from minicore.engine.arg_utils import add_engine_cli_args
from minicore.protocol import SpecDecodingStats
from minicore.tracing.step_trace import DEFAULT_LIMIT

THRESHOLDS = ("full", "one-short")
# The engine settings a simulated rank has; every other engine flag is left out.
ENGINE_FLAGS = ("max_num_seqs", "max_num_batched_tokens", "long_prefill_token_threshold",
                "enable_chunked_prefill", "scheduler_reserve_full_isl", "block_size",
                "enable_prefix_caching", "data_parallel_size")
# vllm-ascend PR #5212's table: DeepSeek-V3.1, 3,500 in / 1,500 out, 512 requests, 128 in flight.
PUBLISHED = {"baseline": (6600, 86.85, 591.9, 3030.5, 1297.3, 0.86),
             "balance": (7012, 70.63, 501.7, 3575.7, 1530.7, 1.02)}
COLUMNS = (("mean_ttft_ms", "TTFT ms"), ("mean_tpot_ms", "TPOT ms"), ("duration", "e2e s"),
           ("input_throughput", "in tok/s"), ("output_throughput", "out tok/s"),
           ("request_throughput", "req/s"))
EXPERIMENT = ("--data-parallel-size 4 --max-num-seqs 32 --max-num-batched-tokens 4096 "
              "--num-prompts 512 --random-input-len 3500 --random-output-len 1500 "
              "--max-concurrency 128 --num-speculative-tokens 3 --acceptance-rate 0.7")


def add_simulate_args(parser: argparse.ArgumentParser) -> None:
    parser.description = ("SIMULATED: N data-parallel ranks stepped in lockstep in one process, "
                          "on minicore's real schedulers and a cost model; prints the baseline "
                          "and each balance-gate threshold side by side.")
    parser.epilog = f"vllm-ascend PR #5212's experiment: python -m minicore simulate {EXPERIMENT}"
    exclude = tuple(f.name for _, cls, _ in SUB_CONFIGS for f in fields(cls)
                    if f.name not in ENGINE_FLAGS)
    engine = add_engine_cli_args(
        parser, exclude + ("model", "kv_transfer_config", "speculative_config"))["scheduler"]
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="default: the longest request of the workload")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV cache blocks per rank (default: room for max_num_seqs requests "
                             "of max_model_len tokens, so nothing is preempted)")
    engine.add_argument("--balance-scheduling", action=argparse.BooleanOptionalAction,
                        default=True, help="run the balance-gated variants next to the baseline "
                                           "(--no-balance-scheduling: the baseline alone)")
    engine.add_argument("--balance-threshold", choices=THRESHOLDS, default=None,
                        help="only this gate threshold (default: each)")
    work = parser.add_argument_group("workload (vllm bench serve's random dataset)")
    work.add_argument("--num-prompts", type=int, default=1000)
    work.add_argument("--random-input-len", type=int, default=1024)
    work.add_argument("--random-output-len", type=int, default=128)
    work.add_argument("--random-range-ratio", type=float, default=0.0,
                      help="input and output lengths uniform in len * [1 - r, 1 + r]")
    work.add_argument("--request-rate", type=float, default=float("inf"),
                      help="Poisson arrivals per second (inf: all at once)")
    work.add_argument("--max-concurrency", type=int, default=None,
                      help="most requests in flight (with rate inf: a closed loop)")
    work.add_argument("--num-speculative-tokens", type=int, default=0,
                      help="K: draft tokens a decoding request is given each step")
    work.add_argument("--acceptance-rate", type=parse_acceptance_rate, default=0.7,
                      metavar="P or P0,P1,...",
                      help="P: each draft accepted independently (a decode step emits 1 + "
                           "Binomial(K, P) tokens); K rates: draft i accepted at rate i once "
                           "drafts 0..i-1 were (the prefix rejection sampling keeps; from vLLM's "
                           "per-position acceptance a_i, rate i = a_i / a_(i-1)). Default: 0.7")
    work.add_argument("--seed", type=int, default=0)
    cost = parser.add_argument_group("cost model (one rank's step; ranks wait for the slowest)")
    for f in fields(CostModel):
        cost.add_argument("--" + f.name.replace("_", "-"), type=float, default=f.default,
                          help=f"default: {f.default}")
    parser.add_argument("--result-file", default=None, help="write the results as JSON here")
    trace = parser.add_argument_group("step trace")
    trace.add_argument("--trace-steps", metavar="PATH", default=None,
                       help="write each variant's steps, every rank's, as Trace Event Format "
                            "(ui.perfetto.dev opens it; `python -m minicore trace-view` draws it), "
                            "on the simulated clock, to PATH with the variant's name before its "
                            "suffix: PATH trace.json gives trace.baseline.json, trace.full.json, "
                            "trace.one-short.json (each replaced)")
    trace.add_argument("--trace-steps-limit", type=int, default=DEFAULT_LIMIT, metavar="N",
                       help="most records a rank writes to its trace (about 200 bytes each), "
                            "then a `trace truncated` mark (default: %(default)s)")


def parse_acceptance_rate(text: str) -> float | tuple[float, ...]:
    """--acceptance-rate: "0.7" (a scalar) or "0.9,0.75,0.6" (per position); the range and the
    count are checked by SimConfig."""
    try:
        values = tuple(float(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a rate or comma-separated rates per draft position, got {text!r}") from None
    return values[0] if len(values) == 1 else values


def build_sim_config(args: argparse.Namespace, workload: list[SimRequest],
                     threshold: str | None) -> SimConfig:
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in workload)
    max_model_len = args.max_model_len or max_len + args.num_speculative_tokens
    scheduler = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=max_model_len, long_prefill_token_threshold=args.long_prefill_token_threshold,
        enable_chunked_prefill=args.enable_chunked_prefill,
        scheduler_reserve_full_isl=args.scheduler_reserve_full_isl,
        balance_scheduling=threshold is not None, balance_threshold=threshold or "full")
    num_blocks = args.num_gpu_blocks_override or (
        1 + args.max_num_seqs * -(-max_model_len // args.block_size))
    cache = CacheConfig(block_size=args.block_size, num_blocks=num_blocks,
                        enable_prefix_caching=args.enable_prefix_caching)
    cost = CostModel(args.step_ms, args.decode_seq_ms, args.prefill_token_us,
                     args.context_token_us)
    return SimConfig(args.data_parallel_size, scheduler, cache, cost,
                     args.num_speculative_tokens, args.acceptance_rate, args.request_rate,
                     args.max_concurrency, args.seed)


def _percentile(values: list[float], p: float) -> float:
    """numpy.percentile's default (linear) interpolation, as vllm bench serve reports."""
    ordered = sorted(values)
    k = (len(ordered) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def _summary(name: str, values_s: list[float]) -> dict:
    ms = [v * 1000 for v in values_s] or [0.0]
    return {f"mean_{name}_ms": statistics.mean(ms), f"median_{name}_ms": statistics.median(ms),
            f"std_{name}_ms": statistics.pstdev(ms), f"p99_{name}_ms": _percentile(ms, 99)}


def bench_result(requests: list[SimRequest]) -> dict:
    """vllm bench serve's result keys, from the simulated requests (times from t = 0)."""
    duration = max(r.chunk_times[-1] for r in requests)
    total_in = sum(len(r.prompt_token_ids) for r in requests)
    total_out = sum(r.num_output for r in requests)
    ttfts = [r.chunk_times[0] - r.send_time for r in requests]
    tpots = [(r.chunk_times[-1] - r.chunk_times[0]) / (r.num_output - 1)
             for r in requests if r.num_output > 1]
    itls = [b - a for r in requests for a, b in zip(r.chunk_times, r.chunk_times[1:])]
    e2els = [r.chunk_times[-1] - r.send_time for r in requests]
    return {"duration": duration, "completed": len(requests), "total_input_tokens": total_in,
            "total_output_tokens": total_out, "request_throughput": len(requests) / duration,
            "output_throughput": total_out / duration, "input_throughput": total_in / duration,
            "total_token_throughput": (total_in + total_out) / duration,
            **_summary("ttft", ttfts), **_summary("tpot", tpots), **_summary("itl", itls),
            **_summary("e2el", e2els),
            "input_lens": [len(r.prompt_token_ids) for r in requests],
            "output_lens": [r.num_output for r in requests], "ttfts": ttfts}


def step_summary(steps: list[StepRecord], requests: list[SimRequest], dp: int) -> dict:
    """What the ranks did: lockstep iterations, those that computed prompt tokens, those with
    the gate shut."""
    return {"steps": len(steps), "prefill_steps": sum(s.has_prefill for s in steps),
            "gated_steps": sum(s.gated for s in steps),
            "mean_step_ms": 1000 * steps[-1].end_time / len(steps),
            "requests_per_rank": [sum(r.rank == i for r in requests) for i in range(dp)]}


def run_variant(args: argparse.Namespace, threshold: str | None) -> dict:
    workload = make_random_workload(args.num_prompts, args.random_input_len,
                                    args.random_output_len, args.random_range_ratio,
                                    seed=args.seed)
    config = build_sim_config(args, workload, threshold)
    path = args.trace_steps and variant_trace_path(args.trace_steps, threshold or "baseline")
    trace = SimTrace(path, args.data_parallel_size, args.trace_steps_limit) if path else NO_TRACE
    start = time.perf_counter()
    simulator = DPSimulator(config, workload, trace)
    try:
        requests, steps = simulator.run()
    finally:
        trace.close()
    # As vllm bench serve saves it: "inf" is not a JSON number.
    rate = "inf" if math.isinf(args.request_rate) else args.request_rate
    result = {"simulated": True, "backend": "minicore-simulate",
              "balance_threshold": threshold, "num_prompts": args.num_prompts,
              "request_rate": rate, "burstiness": 1.0,
              "max_concurrency": args.max_concurrency, **bench_result(requests),
              "simulation": {**step_summary(steps, requests, args.data_parallel_size),
                             "preemptions": simulator.num_preemptions,
                             "spec_decoding": spec_summary(simulator.spec_decoding_stats()),
                             "wall_s": time.perf_counter() - start,
                             "step_trace": path and str(path)}}
    return result


def variant_trace_path(path: str, variant: str) -> Path:
    """--trace-steps trace.json for a variant: trace.<variant>.json."""
    path = Path(path)
    return path.with_name(f"{path.stem}.{variant}{path.suffix}")


def spec_summary(stats: SpecDecodingStats | None) -> dict | None:
    """vLLM's counters and the figures its SpecDecoding log line derives from them."""
    if stats is None:
        return None
    drafts = max(stats.num_drafts, 1)
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": stats.num_accepted_tokens_per_pos,
            "mean_acceptance_length": 1 + stats.num_accepted_tokens / drafts,
            "acceptance_per_position": [n / drafts for n in stats.num_accepted_tokens_per_pos]}


def print_table(results: dict[str, dict]) -> None:
    names = list(results)
    print(f"\nSIMULATED {', '.join(names)}: mean TTFT and TPOT in ms, duration in s")
    print(f"{'':<22}" + "".join(f"{label:>11}" for _, label in COLUMNS)
          + f"{'steps':>8}{'prefill':>9}{'gated':>7}")
    for name, r in results.items():
        sim = r["simulation"]
        print(f"{name + ' (simulated)':<22}" + "".join(f"{r[k]:>11.2f}" for k, _ in COLUMNS)
              + f"{sim['steps']:>8}{sim['prefill_steps']:>9}{sim['gated_steps']:>7}")
    if "baseline" in results:
        base = results["baseline"]
        for name in names[1:]:
            print(f"{name + ' / baseline':<22}"
                  + "".join(f"{results[name][k] / base[k]:>11.3f}" for k, _ in COLUMNS))
    published = [b / a for a, b in zip(PUBLISHED["baseline"], PUBLISHED["balance"])]
    print(f"{'PR #5212 published':<22}" + "".join(f"{v:>11.3f}" for v in published)
          + "   (measured, DeepSeek-V3.1)")
    if spec := results[names[0]]["simulation"]["spec_decoding"]:
        per_pos = ", ".join(f"{a:.3f}" for a in spec["acceptance_per_position"])
        print(f"{names[0]} drafts (simulated): mean acceptance length "
              f"{spec['mean_acceptance_length']:.3f}, accepted per position {per_pos}")


def simulate_main(args: argparse.Namespace) -> None:
    thresholds = [args.balance_threshold] if args.balance_threshold else list(THRESHOLDS)
    variants = [None] + (thresholds if args.balance_scheduling else [])
    results = {}
    for threshold in variants:
        name = threshold or "baseline"
        results[name] = run_variant(args, threshold)
        print(f"simulated {name}: {results[name]['completed']} requests, "
              f"{results[name]['simulation']['wall_s']:.1f} s of wall time"
              + (f", steps traced to {trace}" if (trace := results[name]["simulation"]
                                                  ["step_trace"]) else ""), flush=True)
    print_table(results)
    if args.result_file:
        path = Path(args.result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: str(v) if isinstance(v, float) and math.isinf(v) else v
                    for k, v in vars(args).items()}
        path.write_text(json.dumps({"simulated": True, "args": settings, **results}, indent=1))
        print(f"wrote {path} (simulated)")
