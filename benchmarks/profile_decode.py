"""Where a single-stream decode step's time goes: one request (128 random prompt ids, 128 greedy
tokens) profiled with cProfile, its cumulative times per token by part (the linear layers'
kernels, decode attention, the model's forward, the LM head and sampling, the runner's step, the
scheduler, the frontend's output processing), without and with batch invariance (the CPU's
default) side by side.
cProfile inflates Python's share; the unprofiled time per token is printed beside it.

    python benchmarks/profile_decode.py [--dtype auto]
"""

import argparse
import cProfile
import json
import pstats
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

TOKENS = 128
# Part name -> (file suffix, function names) of the frames whose cumulative time it is.
PARTS = {
    "linear kernels": ("native.py", ("linear",)),
    "decode attention": ("decode_kv.py", ("kernel_decode_attention",)),
    "model forward": ("runner.py", ("_forward",)),
    "LM head + sampling": ("runner.py", ("_sample",)),
    "runner step": ("runner.py", ("execute_model",)),
    "scheduler": ("scheduler.py", ("schedule", "update_from_output")),
    "output processing": ("output_processor.py", ("process_outputs",)),
}


def profile(dtype: str, batch_invariant: bool) -> dict:
    llm = LLM(dtype=dtype, max_model_len=1024, batch_invariant=batch_invariant)
    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 49000) for _ in range(128)]}
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    llm.generate([prompt], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], params, use_tqdm=False)
    plain = time.perf_counter() - start
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.runcall(llm.generate, [prompt], params, use_tqdm=False)
    profiled = time.perf_counter() - start
    stats = pstats.Stats(profiler).stats
    parts = {name: sum(v[3] for (path, _, func), v in stats.items()
                       if path.endswith(suffix) and func in funcs) / TOKENS * 1e3
             for name, (suffix, funcs) in PARTS.items()}
    return {"batch_invariant": batch_invariant, "ms_per_token": plain / TOKENS * 1e3,
            "profiled_ms_per_token": profiled / TOKENS * 1e3, "parts_ms_per_token": parts}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--json",
                    default=str(Path(__file__).parent / "results" / "profile_decode.json"))
    args = ap.parse_args()
    runs = [profile(args.dtype, invariant) for invariant in (False, True)]
    print(f"CPU: {cpu_description()}; dtype {args.dtype}")
    names = ["invariant" if r["batch_invariant"] else "not invariant" for r in runs]
    print(f"{'ms per token':24}" + "".join(f"{name:>12}" for name in names))
    print(f"{'unprofiled':24}" + "".join(f"{r['ms_per_token']:>12.2f}" for r in runs))
    print(f"{'profiled':24}" + "".join(f"{r['profiled_ms_per_token']:>12.2f}" for r in runs))
    for name in PARTS:
        print(f"{name:24}" + "".join(f"{r['parts_ms_per_token'][name]:>12.2f}" for r in runs))
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(), "dtype": args.dtype,
                                           "runs": runs}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
