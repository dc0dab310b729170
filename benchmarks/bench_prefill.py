"""What batch invariance costs a long prompt: the time to first token of one prompt, with batch
invariance (the CPU's default) against --no-batch-invariant, side by side in one run.

Each prompt is random token ids, one output token, prefix caching off (each run computes the whole
prompt); both engines load once and alternate --repeat times; the median is reported. With
--batch-invariant every prompt token is a query of the decode attention kernel
(minicore/model/csrc/decode_attention.c) over its own prefix, where without it SDPA runs over each
prefill chunk; the linear layers take the invariant kernel for every row count. The CPU's
model and flags are printed with the figures.

    python benchmarks/bench_prefill.py [--lengths 1000 3000] [--repeat 3] [--dtype auto]
"""

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def prefill_s(llm: LLM, prompt: list[int]) -> float:
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], ONE_TOKEN, use_tqdm=False)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1000, 3000])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "bench_prefill.json"))
    args = ap.parse_args()
    engines = {mode: LLM(dtype=args.dtype, max_model_len=max(args.lengths) + 16,
                         enable_prefix_caching=False, batch_invariant=mode == "invariant")
               for mode in ("plain", "invariant")}
    vocab = engines["plain"].llm_engine.model_runner.vocab_size
    rng, rows = random.Random(0), []
    for length in args.lengths:
        prompt = [rng.randrange(100, vocab) for _ in range(length)]
        times = {mode: [] for mode in engines}
        for llm in engines.values():
            prefill_s(llm, prompt[:64])  # warm-up
        for _ in range(args.repeat):
            for mode, llm in engines.items():
                times[mode].append(prefill_s(llm, prompt))
        medians = {mode: statistics.median(t) for mode, t in times.items()}
        rows.append({"prompt_tokens": length, "plain_s": medians["plain"],
                     "invariant_s": medians["invariant"], "times": times})
    print(f"CPU: {cpu_description()}")
    print(f"dtype {engines['plain'].llm_engine.model_runner.model.dtype}, median of "
          f"{args.repeat} alternated runs, one output token, prefix caching off")
    print(f"{'prompt tokens':>13} {'invariant s':>12} {'not invariant s':>16} {'ratio':>6}")
    for r in rows:
        print(f"{r['prompt_tokens']:>13} {r['invariant_s']:>12.2f} {r['plain_s']:>16.2f} "
              f"{r['invariant_s'] / r['plain_s']:>5.2f}x")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(), "results": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
