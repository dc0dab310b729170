"""The balance study's report (benchmarks/balance_study.py): each variant's requests summed up in
the columns of vllm-ascend PR #5212's table, the lockstep step counts, and the printed tables.
"""

import os
import statistics

PUBLISHED_RESULT = {  # vllm-ascend PR #5212, "Experiment Results" (the "full" gate)
    "baseline": {"ttft_ms": 6600, "tpot_ms": 86.85, "duration_s": 591.9, "input_tok_s": 3030.5,
                 "output_tok_s": 1297.3, "req_s": 0.86},
    "balance": {"ttft_ms": 7012, "tpot_ms": 70.63, "duration_s": 501.7, "input_tok_s": 3575.7,
                "output_tok_s": 1530.7, "req_s": 1.02},
}
# The variant column's width: "one-short / base".
LABEL_WIDTH = 18
COLUMNS = [("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("duration_s", "e2e s"),
           ("input_tok_s", "in tok/s"), ("output_tok_s", "out tok/s"), ("req_s", "req/s")]


def count_clusters(times: list[float], gap: float) -> int:
    """Groups of times closer than gap to their neighbour: the outputs of one lockstep step
    arrive within a few ms of each other, consecutive steps a step time apart."""
    times = sorted(times)
    return sum(1 for a, b in zip([float("-inf")] + times, times) if b - a > gap)


def summarize(records: dict, input_len: int, start: float, end: float) -> dict:
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


def step_counts(records: dict, token_times: list[float],
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


def print_table(title: str, results: list[dict], extra: list[tuple[str, str, str]]) -> None:
    base = results[0]
    print(f"\n{title}")
    hdr = f"{'variant':<{LABEL_WIDTH}}" + "".join(f"{label:>11}" for _, label in COLUMNS)
    print(hdr)
    print("-" * len(hdr))
    for r in results:
        print(f"{r['variant']:<{LABEL_WIDTH}}" + "".join(f"{r[k]:>11.2f}" for k, _ in COLUMNS))
    for r in results[1:]:
        print(f"{r['variant'] + ' / base':<{LABEL_WIDTH}}" +
              "".join(f"{r[k] / base[k]:>11.3f}" for k, _ in COLUMNS))
    published = {k: PUBLISHED_RESULT["balance"][k] / PUBLISHED_RESULT["baseline"][k]
                 for k, _ in COLUMNS}
    print(f"{'PR #5212 full/base':<{LABEL_WIDTH}}"
          + "".join(f"{published[k]:>11.3f}" for k, _ in COLUMNS))
    extra = [c for c in extra if any(c[0] in r for r in results)]
    if extra:
        print()
        hdr = f"{'variant':<{LABEL_WIDTH}}" + "".join(f"{label:>{len(label) + 2}}"
                                                      for _, label, _ in extra)
        print(hdr)
        for r in results:
            print(f"{r['variant']:<{LABEL_WIDTH}}" + "".join(
                f"{format(r.get(k, float('nan')), fmt):>{len(label) + 2}}"
                for k, label, fmt in extra))


EXTRA_COLUMNS = [("ttft_median_ms", "TTFT p50", ".0f"), ("ttft_p99_ms", "TTFT p99", ".0f"),
                 ("tpot_median_ms", "TPOT p50", ".2f"),
                 ("mean_running_per_rank", "running/rank", ".2f"),
                 ("frac_some_rank_ge_seq_minus_1", "t(max>=S-1)", ".2f"),
                 ("frac_some_rank_full", "t(max>=S)", ".2f"),
                 ("steps", "steps", ".0f"), ("tokens_per_step", "tok/step", ".1f"),
                 ("mean_step_ms", "step ms", ".1f"),
                 ("prefill_steps", "prefill steps", ".0f"), ("preemptions", "preempt", ".0f")]


def print_header(args, decode_step_s: float | None) -> str:
    kind = ("REAL SmolLM2-135M on CPU" if args.real
            else "REAL Qwen3-MoE bench model, expert parallel, on CPU" if args.moe
            else "SIMULATED runner (lockstep)")
    print(f"balance study: DP={args.dp}, {kind}; {args.num_prompts} requests of "
          f"{args.input_len} in / {args.output_len} out (range ratio {args.output_range_ratio}); "
          f"max_num_seqs {args.max_num_seqs}/rank, max_num_batched_tokens "
          f"{args.max_num_batched_tokens}; client {args.client}"
          + (f" (concurrency {args.concurrency})" if args.client == "closed" else ""))
    if args.moe:
        print("workload: make_random_workload (the simulator's draw): input AND output lengths "
              f"uniform in len * [1 - {args.output_range_ratio}, 1 + {args.output_range_ratio}]")
    if decode_step_s is not None:
        print(("fitted cost model (step clustering and the simulator): " if args.moe else "")
              + f"cost: step {args.step_ms} ms + {args.decode_seq_ms} ms/decoding seq + "
              f"{args.prefill_token_us} us/prefill token -> decode step of {args.max_num_seqs} = "
              f"{decode_step_s * 1000:.1f} ms, one {args.input_len}-token prefill = "
              f"{args.input_len * args.prefill_token_us / 1000:.1f} ms", flush=True)
    return kind


def print_results(kind: str, args, results: list[dict], count_sync: str, lockstep: bool,
                  total_s: float) -> None:
    print_table(f"{kind}, DP={args.dp} (times in ms, durations in s; ratios to baseline; the "
                "published balance/baseline ratios for comparison)", results, EXTRA_COLUMNS)
    print("running/rank: time-averaged running requests per rank (frontend's view); "
          "t(max>=S-1), t(max>=S): share of\ntime some rank had >= max_num_seqs - 1 (one-short "
          "gate closed) / max_num_seqs (full gate closed) running")
    if lockstep:
        print("steps, tok/step, step ms: engine 0's token-producing steps, its tokens per step, "
              "its mean step interval;\nprefill steps: steps in which some rank finished a "
              "prefill (first tokens clustered over all ranks)")
    print(f"balance variants' count sync: {count_sync}")
    print(f"\ntotal wall time {total_s:.0f} s; load average at the end "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; requests per engine: "
          + "; ".join(f"{r['variant']} {r['requests_per_engine']}" for r in results))


def simulate_same(args) -> dict:
    """`python -m minicore simulate` with the study's settings and cost model (the same workload
    draw, seed 0): prints its table and the command, returns its results."""
    import argparse

    from minicore.dp.sim_report import add_simulate_args, print_table, run_variant

    flags = (f"--data-parallel-size {args.dp} --max-num-seqs {args.max_num_seqs} "
             f"--max-num-batched-tokens {args.max_num_batched_tokens} --num-prompts "
             f"{args.num_prompts} --random-input-len {args.input_len} --random-output-len "
             f"{args.output_len} --random-range-ratio {args.output_range_ratio} "
             f"--max-concurrency {args.concurrency} --step-ms {args.step_ms} --decode-seq-ms "
             f"{args.decode_seq_ms} --prefill-token-us {args.prefill_token_us}")
    parser = argparse.ArgumentParser()
    add_simulate_args(parser)
    sim_args = parser.parse_args(flags.split())
    print(f"\nthe simulator's prediction: python -m minicore simulate {flags}")
    results = {"baseline": run_variant(sim_args, None)}
    for threshold in ("full", "one-short"):
        results[threshold] = run_variant(sim_args, threshold)
    print_table(results)
    print(f"{'':<22}{'TTFT p99':>11}{'TPOT p50':>11}{'prefill steps':>15}")
    for name, r in results.items():
        print(f"{name + ' (simulated)':<22}{r['p99_ttft_ms']:>11.0f}{r['median_tpot_ms']:>11.2f}"
              f"{r['simulation']['prefill_steps']:>15}")
    return {"flags": flags, "results": results}
