"""torch.compile on CPU vs eager, side by side in one run (issue 16's "evaluate torch.compile").

Measures the plain transformers forward of the default model (SmolLM2-135M via
minicore.model.loader.load_model, sdpa attention) on two batch shapes:
  decode   64 sequences x 1 new token, each with a KV cache of --context (170) tokens
           (a DynamicCache rebuilt from the same K/V tensors every call, as one decode step)
  prefill  8 sequences x 128 tokens, no cache
each eager and through torch.compile(backend="inductor", dynamic=False) with
torch._inductor.config.freezing = True (what vLLM's CPU backend uses: weights become constants, so
inductor can prepack the linear layers). The compile time is the first call's wall time (minus one
eager call); the step time is the median of --steps calls after warm-up. A compile failure is
reported as the result (its exact error), not raised. --no-freezing also runs inductor without
freezing. Greedy next-token argmax of compiled vs eager is checked equal.

    python benchmarks/compile_eval.py [--steps 10] [--context 170] [--no-freezing] \
        [--json benchmarks/results/compile_eval.json]
"""

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from minicore.model.attention import attn_implementation  # noqa: E402
from minicore.model.loader import load_model  # noqa: E402


def make_inputs(model, shape: str, context: int):
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    if shape == "decode":
        batch, new = 64, 1
    else:
        batch, new, context = 8, 128, 0
    ids = torch.randint(100, cfg.vocab_size, (batch, new), generator=g)
    pos = torch.arange(context, context + new).expand(batch, new).contiguous()
    kv = None
    if context:
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv = [(torch.randn(batch, cfg.num_key_value_heads, context, head_dim, generator=g),
               torch.randn(batch, cfg.num_key_value_heads, context, head_dim, generator=g))
              for _ in range(cfg.num_hidden_layers)]
    return ids, pos, kv


def make_step(model, context: int):
    from transformers import DynamicCache

    def step(ids, pos, kv):
        if kv is None:
            return model(input_ids=ids, position_ids=pos, use_cache=False).logits
        cache = DynamicCache(config=model.config)
        for i, (k, v) in enumerate(kv):
            cache.update(k, v, i)
        mask = torch.ones(ids.shape[0], context + ids.shape[1], dtype=torch.long)
        return model(input_ids=ids, position_ids=pos, past_key_values=cache,
                     attention_mask=mask, use_cache=True).logits
    return step


def time_calls(fn, args, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - t)
    return times


def run_variant(model, shape, context, variant, steps, eager_first_s, eager_logits):
    import torch._dynamo
    import torch._inductor.config as ind

    torch._dynamo.reset()
    ind.freezing = variant == "inductor+freezing"
    ids, pos, kv = make_inputs(model, shape, context)
    row = {"shape": shape, "variant": variant}
    try:
        fn = torch.compile(make_step(model, context), backend="inductor", dynamic=False)
        t = time.perf_counter()
        out = fn(ids, pos, kv)
        row["first_call_s"] = time.perf_counter() - t
        row["compile_s"] = max(0.0, row["first_call_s"] - eager_first_s)
        time_calls(fn, (ids, pos, kv), 2)  # warm-up (a recompile would show here)
        times = time_calls(fn, (ids, pos, kv), steps)
        row["step_ms"] = 1e3 * statistics.median(times)
        row["argmax_equal"] = bool(torch.equal(out[:, -1].argmax(-1),
                                               eager_logits[:, -1].argmax(-1)))
        row["max_abs_diff"] = float((out - eager_logits).abs().max())
    except Exception as exc:  # a failure is the finding
        row["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
        row["traceback_tail"] = traceback.format_exc()[-2000:]
    finally:
        ind.freezing = False
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--context", type=int, default=170)
    ap.add_argument("--shapes", nargs="+", default=["decode", "prefill"])
    ap.add_argument("--no-freezing", action="store_true", help="also run inductor without freezing")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" / "compile_eval.json"))
    args = ap.parse_args()

    t = time.perf_counter()
    model, _ = load_model(dtype="float32", device="cpu")
    load_s = time.perf_counter() - t
    variants = ["inductor+freezing"] + (["inductor"] if args.no_freezing else [])
    rows = []
    with attn_implementation(model, "sdpa"), torch.inference_mode():
        for shape in args.shapes:
            ids, pos, kv = make_inputs(model, shape, args.context)
            step = make_step(model, args.context)
            t = time.perf_counter()
            logits = step(ids, pos, kv)
            eager_first = time.perf_counter() - t
            time_calls(step, (ids, pos, kv), 2)
            eager_ms = 1e3 * statistics.median(time_calls(step, (ids, pos, kv), args.steps))
            rows.append({"shape": shape, "variant": "eager", "first_call_s": eager_first,
                         "step_ms": eager_ms})
            for v in variants:
                row = run_variant(model, shape, args.context, v, args.steps, eager_first, logits)
                if "step_ms" in row:
                    row["speedup"] = eager_ms / row["step_ms"]
                rows.append(row)
                print(row.get("error", ""), flush=True)

    print(f"cpu, float32, torch {torch.__version__}, threads {torch.get_num_threads()}, "
          f"load {load_s:.1f} s, decode = 64 x 1 over {args.context} cached tokens, "
          f"prefill = 8 x 128")
    print(f"{'shape':8} {'variant':18} {'compile s':>9} {'step ms':>8} {'speedup':>7} "
          f"{'argmax =':>8}")
    for r in rows:
        if "error" in r:
            print(f"{r['shape']:8} {r['variant']:18} FAILED: {r['error']}")
            continue
        comp = f"{r['compile_s']:.1f}" if "compile_s" in r else "-"
        sp = f"{r['speedup']:.2f}x" if "speedup" in r else "-"
        eq = str(r.get("argmax_equal", "-"))
        print(f"{r['shape']:8} {r['variant']:18} {comp:>9} {r['step_ms']:>8.1f} {sp:>7} {eq:>8}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({
        "device": "cpu", "dtype": "float32", "torch": torch.__version__,
        "threads": torch.get_num_threads(), "context": args.context, "steps": args.steps,
        "load_s": load_s, "results": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
