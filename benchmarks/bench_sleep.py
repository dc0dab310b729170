"""Sleep mode: the memory each sleep level frees, and how long sleeping and waking up take.

For each --kv-cache-memory, the default model (float32, CPU) generates a few greedy tokens once
(so the KV pool, the weights and the decode buffers are touched); then for level 1 and level 2 in
turn: the process's RSS before llm.sleep(level) and while asleep (freed: the difference), the
time llm.sleep and llm.wake_up take (level 2 reloads the weights from the model directory), and
whether the greedy tokens generated after waking equal those before sleeping. The CPU model and
flags are printed; results go to benchmarks/results/bench_sleep.json.

    python benchmarks/bench_sleep.py [--kv-cache-memory 256M 1G] [--max-tokens 16]
"""

import argparse
import gc
import json
import sys
import time
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore import LLM, SamplingParams  # noqa: E402
from minicore.arg_utils import human_readable_int  # noqa: E402

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Sleep mode frees memory by"]
MIB = 2**20


def rss() -> int:
    return psutil.Process().memory_info().rss


def greedy(llm: LLM, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def timed(fn, *args) -> float:
    start = time.perf_counter()
    fn(*args)
    return time.perf_counter() - start


def bench(kv_cache_memory: int, max_tokens: int) -> list[dict]:
    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory=kv_cache_memory)
    runner = llm.llm_engine.model_runner
    kv_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
    weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    reference = greedy(llm, max_tokens)
    rows = []
    for level in (1, 2):
        before = rss()
        sleep_s = timed(llm.sleep, level)
        assert llm.is_sleeping() and not runner.kv_caches
        asleep = rss()
        wake_s = timed(llm.wake_up)
        woken = rss()
        rows.append({"kv_cache_memory": kv_cache_memory, "num_blocks": runner.num_blocks,
                     "kv_pool_bytes": kv_bytes, "weights_bytes": weight_bytes, "level": level,
                     "rss_before": before, "rss_asleep": asleep, "rss_woken": woken,
                     "freed": before - asleep, "sleep_s": sleep_s, "wake_s": wake_s,
                     "equal": greedy(llm, max_tokens) == reference})
    del llm, runner
    gc.collect()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kv-cache-memory", nargs="+", type=human_readable_int,
                    default=[256 * MIB, 1024 * MIB], help="KV pool sizes (256M, 1G, ...)")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "bench_sleep.json"))
    args = ap.parse_args()

    rows = [row for memory in args.kv_cache_memory for row in bench(memory, args.max_tokens)]
    print(f"CPU: {cpu_description()}")
    print(f"torch threads {torch.get_num_threads()}, {len(PROMPTS)} prompts x "
          f"{args.max_tokens} greedy tokens")
    print(f"{'kv pool MiB':>11} {'weights MiB':>11} {'level':>5} {'RSS before MiB':>14} "
          f"{'RSS asleep MiB':>14} {'freed MiB':>9} {'sleep s':>8} {'wake s':>7} "
          f"{'output equal':>12}")
    for r in rows:
        print(f"{r['kv_pool_bytes'] / MIB:>11.1f} {r['weights_bytes'] / MIB:>11.1f} "
              f"{r['level']:>5} {r['rss_before'] / MIB:>14.1f} {r['rss_asleep'] / MIB:>14.1f} "
              f"{r['freed'] / MIB:>9.1f} {r['sleep_s']:>8.3f} {r['wake_s']:>7.3f} "
              f"{str(r['equal']):>12}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(),
                                           "threads": torch.get_num_threads(),
                                           "max_tokens": args.max_tokens, "results": rows},
                                          indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
