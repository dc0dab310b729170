"""A Llama model's layers as plain calls (minicore/model/llama_forward.py) against transformers'
forward, side by side in one process: the same engine, its runner's forward swapped between runs.

Single stream: one prompt of 128 random ids, 128 greedy tokens, EOS ignored, ms per token; W1:
64 such prompts at once, output tok/s. Each side runs --repeat times, the order alternated, after
an untimed run of each; the greedy tokens of both are checked equal (the plain forward gives
transformers' bits). The CPU model and flags are printed; results go to
benchmarks/results/bench_llama_forward.json.

    python benchmarks/bench_llama_forward.py [--dtype auto] [--batch-invariant] [--repeat 5]
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from machine import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

PARAMS = SamplingParams(max_tokens=128, temperature=0, ignore_eos=True)


def run(llm: LLM, forward, num_prompts: int, rng: random.Random) -> tuple[float, list]:
    """(seconds, token ids) of num_prompts fresh prompts through llm with forward."""
    llm.llm_engine.model_runner.forward_hidden = forward
    llm.reset_prefix_cache()  # both sides get the same prompts: neither may read the other's KV
    prompts = [[rng.randrange(100, 40000) for _ in range(128)] for _ in range(num_prompts)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    return time.perf_counter() - start, [o.outputs[0].token_ids for o in outputs]


def compare(llm: LLM, num_prompts: int, repeat: int) -> dict:
    runner = llm.llm_engine.model_runner
    sides = {"plain": runner.forward_hidden, "transformers": runner._transformers_forward}
    seconds: dict[str, list[float]] = {name: [] for name in sides}
    equal = True
    for forward in sides.values():  # untimed: first allocations
        run(llm, forward, num_prompts, random.Random(99))
    for r in range(repeat):
        tokens = {}
        for name in (list(sides) if r % 2 == 0 else list(reversed(sides))):
            elapsed, tokens[name] = run(llm, sides[name], num_prompts, random.Random(r))
            seconds[name].append(elapsed)
        equal &= tokens["plain"] == tokens["transformers"]
    runner.forward_hidden = sides["plain"]
    out_tokens = num_prompts * PARAMS.max_tokens
    return {"num_prompts": num_prompts, "equal": equal,
            **{f"{name}_s": s for name, s in seconds.items()},
            **{f"{name}_tok_s": out_tokens / statistics.median(s) for name, s in seconds.items()},
            **{f"{name}_ms_per_token": 1000 * statistics.median(s) / PARAMS.max_tokens
               for name, s in seconds.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--batch-invariant", action="store_true")
    ap.add_argument("--repeat", type=int, default=5, help="timed runs of each side, alternated")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results"
                                          / "bench_llama_forward.json"))
    args = ap.parse_args()
    llm = LLM(dtype=args.dtype, batch_invariant=args.batch_invariant, max_model_len=1024,
              kv_cache_memory=1 << 30)
    if getattr(llm.llm_engine.model_runner.forward_hidden, "func", None) is None:
        raise SystemExit("this model or device runs transformers' forward: nothing to compare")
    result = {"cpu": cpu_description(), "args": vars(args), "threads": torch.get_num_threads(),
              "dtype": str(llm.llm_engine.model_runner.model.dtype),
              "batch1": compare(llm, 1, args.repeat), "w1": compare(llm, 64, args.repeat)}
    print(f"CPU: {result['cpu']}; torch threads {result['threads']}; {result['dtype']}; "
          f"batch invariant {args.batch_invariant}; median of {args.repeat} runs a side")
    print(f"{'workload':8} {'plain':>12} {'transformers':>13} {'ratio':>6} {'equal':>5}")
    b1, w1 = result["batch1"], result["w1"]
    plain, other = b1["plain_ms_per_token"], b1["transformers_ms_per_token"]
    print(f"{'batch-1':8} {plain:>9.2f} ms {other:>10.2f} ms {other / plain:>6.2f} "
          f"{'yes' if b1['equal'] else 'NO':>5}")
    plain, other = w1["plain_tok_s"], w1["transformers_tok_s"]
    print(f"{'W1':8} {plain:>6.1f} tok/s {other:>7.1f} tok/s {plain / other:>6.2f} "
          f"{'yes' if w1['equal'] else 'NO':>5}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
