"""Elastic EP under a steady stream of requests: DP 2 -> 3 -> 2 on a two-node Ray cluster made here
(ray.cluster_utils.Cluster: a head of one CPU, a second node of two).

The model is the balance study's random Qwen3-MoE (benchmarks/moe_bench_model.py, --layers of it),
float32, greedy. A request arrives every --interval seconds (prompts cycling over a fixed set, each
asking --max-tokens tokens, EOS ignored); the DP group is scaled to 3 at --scale-up-at seconds and
back to 2 at --scale-down-at, requests in flight each time; the stream stops at --duration.
Reported: how long each scale took (AsyncLLM.scale_elastic_ep, drain and placement included),
the longest time no request got a token while some were in flight (during each scale, and at any
other time for comparison), and how many outputs differ from one engine's (LLM, same model).
Prints a table with the CPU's model and flags, and writes JSON.

    python benchmarks/bench_elastic_ep.py
"""

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402
from moe_bench_model import bench_model_dir  # noqa: E402

from minicore.config import create_engine_config  # noqa: E402
from minicore.engine.async_llm import AsyncLLM  # noqa: E402
from minicore.llm import LLM  # noqa: E402
from minicore.ports import free_port_pair  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

ENGINE_ARGS = dict(max_model_len=512, kv_cache_memory=64 << 20, dtype="float32")


def prompts_and_reference(model_dir: str, max_tokens: int) -> tuple[list, list]:
    llm = LLM(model_dir, **ENGINE_ARGS)
    vocab_size = llm.llm_engine.model_runner.vocab_size
    prompts = [[(11 * i + 5 * j) % (vocab_size - 3) + 3 for j in range(16 + 4 * i)]
               for i in range(8)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return prompts, [o.outputs[0].token_ids for o in llm.generate(prompts, params,
                                                                   use_tqdm=False)]


async def stream(client: AsyncLLM, args, prompts, reference) -> dict:
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    token_times: list[float] = []
    spans: list[tuple[float, float]] = []  # each request's first and last token
    mismatches = 0

    async def one(i: int) -> None:
        nonlocal mismatches
        seen, first = 0, None
        async for out in client.generate(prompts[i % len(prompts)], params, f"r{i}"):
            now = time.perf_counter()
            tokens = out.outputs[0].token_ids
            token_times.extend([now] * (len(tokens) - seen))
            seen, first = len(tokens), first or now
        spans.append((first, now))
        mismatches += tokens != reference[i % len(prompts)]

    start = time.perf_counter()
    scales, requests, i = {}, [], 0
    plan = [(args.scale_up_at, 3), (args.scale_down_at, 2)]
    while (now := time.perf_counter() - start) < args.duration:
        requests.append(asyncio.create_task(one(i)))
        i += 1
        if plan and now >= plan[0][0]:
            at, size = plan.pop(0)
            scales[size] = asyncio.create_task(timed_scale(client, size))
        await asyncio.sleep(args.interval)
    windows = {size: await task for size, task in scales.items()}
    await asyncio.gather(*requests)
    gaps = silences(token_times, spans)
    return {"requests": i, "mismatches": mismatches, "scales": {
        size: {"seconds": end - begin,
               "longest_gap_s": max((b - a for a, b in gaps if a < end and b > begin),
                                    default=0.0)}
        for size, (begin, end) in windows.items()},
        "longest_gap_elsewhere_s": max((b - a for a, b in gaps if not any(
            a < end and b > begin for begin, end in windows.values())), default=0.0)}


async def timed_scale(client: AsyncLLM, size: int) -> tuple[float, float]:
    begin = time.perf_counter()
    await client.scale_elastic_ep(size)
    return begin, time.perf_counter()


def silences(times: list[float], spans: list) -> list[tuple[float, float]]:
    """The intervals between consecutive tokens (to anyone) while a request was in flight
    (between its first and last token)."""
    times = sorted(times)
    return [(a, b) for a, b in zip(times, times[1:]) if any(s <= a and b <= e for s, e in spans)]


async def run(args) -> dict:
    from ray.cluster_utils import Cluster

    model_dir = str(bench_model_dir({"num_hidden_layers": args.layers}))
    prompts, reference = prompts_and_reference(model_dir, args.max_tokens)
    os.environ["RAY_enable_worker_prestart"] = "0"
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=2)
    cluster.wait_for_nodes()
    os.environ["RAY_ADDRESS"] = cluster.address
    try:
        config = create_engine_config(
            model=model_dir, data_parallel_size=2, data_parallel_backend="ray",
            data_parallel_size_local=1, data_parallel_rpc_port=free_port_pair(),
            enable_expert_parallel=True, enable_elastic_ep=True, **ENGINE_ARGS)
        client = await AsyncLLM.from_engine_config(config)
        try:
            return await stream(client, args, prompts, reference)
        finally:
            await client.shutdown()
    finally:
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--scale-up-at", type=float, default=6.0)
    ap.add_argument("--scale-down-at", type=float, default=20.0)
    ap.add_argument("--duration", type=float, default=30.0)
    ap.add_argument("--result-dir", default=str(Path(__file__).parent / "results"))
    args = ap.parse_args()
    result = asyncio.run(run(args))
    print(f"\nCPU: {cpu_description()}")
    print(f"{result['requests']} requests, {result['mismatches']} differ from one engine's")
    print("scale  | seconds | longest gap in tokens during it (s)")
    for size, s in result["scales"].items():
        print(f"-> {size}   | {s['seconds']:7.2f} | {s['longest_gap_s']:.2f}")
    print(f"longest gap at other times: {result['longest_gap_elsewhere_s']:.2f} s")
    path = Path(args.result_dir) / "bench_elastic_ep.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_description(), "args": vars(args), **result},
                               indent=1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
