"""Fits the simulator's cost model (--step-ms, --decode-seq-ms, --prefill-token-us) to the benchmark
MoE model (benchmarks/moe_bench_model.py) served DP=2 with expert parallelism on this machine, from
the engines themselves, and times the expert-parallel collectives alone.

- Decode: 2n requests of a 16-token prompt and 48 output tokens sent at once, so every rank
  decodes n of them in lockstep (n = 1, 2, 4, 8); the step time is the median TPOT (last output -
  first output over output tokens - 1, frontend-side, so the frontend's and IO's share of a step
  is in it, as it is in the study). A least-squares line through (n, step) gives step_ms (the
  intercept) and decode_seq_ms (the slope).
- Prefill: two requests of L prompt tokens, one a rank, max_tokens 1, sent at once (L = 64, 192,
  320, 448; 3 repeats each); the slope of the median TTFT against L is prefill_token_us.
- The EP collectives alone: two spawned processes with a gloo group issue one forward's worth of
  the naive scheme's collectives (one all-gather of the token counts, then per MoE layer one
  all-gather of the packed rows and one reduce-scatter of the partial sums, shaped as
  minicore/model/expert_parallel.py's), no compute between them, for n tokens a rank.

    python benchmarks/moe_cost_fit.py              # ~2 min on 2 cores
"""

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from balance_study import drive
from dp_collective_cost import free_port_pair
from moe_bench_model import BENCH_CONFIG, bench_model_dir

from minicore.config import create_engine_config
from minicore.engine.async_llm import AsyncLLM

DECODE_SEQS = (1, 2, 4, 8)
PREFILL_LENS = (64, 192, 320, 448)


def fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least squares: (intercept, slope)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = (sum((x - mx) * (y - my) for x, y in zip(xs, ys))
             / sum((x - mx) ** 2 for x in xs))
    return my - slope * mx, slope


async def engine_profile(model: str, dp: int) -> dict:
    config = create_engine_config(
        model=model, enable_expert_parallel=True, data_parallel_size=dp, max_num_seqs=8,
        max_num_batched_tokens=512, max_model_len=1024, enable_prefix_caching=False,
        data_parallel_rpc_port=free_port_pair())
    client = await AsyncLLM.from_engine_config(config, startup_timeout=300.0)
    ids = iter(range(10**6))
    try:
        await drive(client, [([100 + i] * 16, 4) for i in range(2 * dp)], "burst", 0, "warm-")
        decode = {}
        for n in DECODE_SEQS:
            work = [([200 + next(ids)] * 16, 48) for _ in range(dp * n)]
            records = await drive(client, work, "burst", 0, f"d{n}-")
            decode[n] = statistics.median((r.last - r.first) * 1000 / (r.num_output - 1)
                                          for r in records.values())
            print(f"  decode, {n} a rank: step {decode[n]:.1f} ms", flush=True)
        prefill = {}
        for length in PREFILL_LENS:
            ttfts = []
            for rep in range(3):
                work = [([300 + next(ids)] * length, 1) for _ in range(dp)]
                records = await drive(client, work, "burst", 0, f"p{length}-{rep}-")
                ttfts += [(r.first - r.send) * 1000 for r in records.values()]
            prefill[length] = statistics.median(ttfts)
            print(f"  prefill of {length} tokens a rank: TTFT {prefill[length]:.1f} ms",
                  flush=True)
        return {"decode_step_ms": decode, "prefill_ttft_ms": prefill}
    finally:
        await client.shutdown()


def _collective_rank(rank: int, size: int, port: int, tokens: tuple, rounds: int, out) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    hidden, top_k = BENCH_CONFIG["hidden_size"], BENCH_CONFIG["num_experts_per_tok"]
    row_bytes = hidden * 4 + top_k * 8 + top_k * 4  # hidden states, top-k ids, top-k weights
    result = {}
    for n in tokens:
        counts, mine = torch.empty(size, dtype=torch.long), torch.tensor([n])
        packed = torch.zeros(n, row_bytes, dtype=torch.uint8)
        gathered = packed.new_empty(size * n, row_bytes)
        partial, back = torch.zeros(size * n, hidden), torch.empty(n, hidden)
        times = []
        for i in range(rounds + 10):
            t = time.perf_counter()
            dist.all_gather_single(counts, mine)
            for _ in range(BENCH_CONFIG["num_hidden_layers"]):
                dist.all_gather_single(gathered, packed)
                dist.reduce_scatter_single(back, partial)
            if i >= 10:
                times.append(time.perf_counter() - t)
        result[n] = 1000 * statistics.median(times)
    out.put(result)
    dist.destroy_process_group()


def collective_profile(size: int, tokens=(1, 8, 512), rounds: int = 200) -> dict[int, float]:
    """Median ms of one forward's EP collectives for n tokens a rank: the slowest rank's."""
    ctx = multiprocessing.get_context("spawn")
    out, port = ctx.Queue(), free_port_pair()
    procs = [ctx.Process(target=_collective_rank, args=(r, size, port, tokens, rounds, out),
                         daemon=True) for r in range(size)]
    for proc in procs:
        proc.start()
    per_rank = [out.get(timeout=300) for _ in procs]
    for proc in procs:
        proc.join(10)
    return {n: max(r[n] for r in per_rank) for n in tokens}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--json", default=str(Path(__file__).resolve().parent / "results"
                                          / "moe_cost_fit.json"))
    args = ap.parse_args()
    load = [os.getloadavg()]
    model = str(bench_model_dir())
    print(f"model {model}; DP={args.dp} expert parallel; load average "
          f"{' '.join(f'{x:.2f}' for x in load[0])}", flush=True)
    collectives = collective_profile(args.dp)
    print("EP collectives of one forward alone (1 count gather + "
          f"{BENCH_CONFIG['num_hidden_layers']} x (all-gather + reduce-scatter)): "
          + ", ".join(f"{n} tokens a rank {ms:.2f} ms" for n, ms in collectives.items()),
          flush=True)
    profile = asyncio.run(engine_profile(model, args.dp))
    step_ms, decode_seq_ms = fit_line(list(DECODE_SEQS), list(profile["decode_step_ms"].values()))
    base_ms, prefill_ms = fit_line(list(PREFILL_LENS), list(profile["prefill_ttft_ms"].values()))
    load.append(os.getloadavg())
    fit = {"step_ms": round(step_ms, 1), "decode_seq_ms": round(decode_seq_ms, 2),
           "prefill_token_us": round(prefill_ms * 1000)}
    print(f"fit: --step-ms {fit['step_ms']} --decode-seq-ms {fit['decode_seq_ms']} "
          f"--prefill-token-us {fit['prefill_token_us']} (prefill line's intercept "
          f"{base_ms:.1f} ms); load average {' '.join(f'{x:.2f}' for x in load[1])}")
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "config": BENCH_CONFIG, "dp": args.dp,
                               "collectives_ms": collectives, **profile, "fit": fit,
                               "prefill_intercept_ms": base_ms, "loadavg": load}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
