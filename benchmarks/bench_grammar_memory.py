"""The engine's memory over many distinct grammars (issue 39): xgrammar's own compile cache against
minicore's (minicore/structured_output/manager.py, CompiledGrammarCache), at the same limit.

Each variant runs in a fresh process: the default model's tokenizer, xgrammar's compiler, then
--grammars distinct JSON schemas, each a 10-property object of enums of --enum strings in all (as
the issue's probe sent), compiled one after the other and a matcher made for each; the process's
RSS after the compiler and after every tenth grammar, and the seconds per compile. Variants:
  xgrammar    GrammarCompiler(cache_enabled=True, cache_limit_bytes=limit) (minicore before)
  minicore    GrammarCompiler(cache_enabled=False) and CompiledGrammarCache(limit) (minicore now)
  none        no cache at all

    python benchmarks/bench_grammar_memory.py [--grammars 100] [--enum 3000] [--limit-mb 64]
"""

import argparse
import json
import random
import subprocess
import sys
import time
from pathlib import Path

MIB = 1 << 20
VARIANTS = ("xgrammar", "minicore", "none")


def measure(variant: str, grammars: int, enum: int, limit_mb: int) -> dict:
    import psutil
    import xgrammar as xgr

    from minicore.model.loader import load_tokenizer, resolve_model_dir
    from minicore.structured_output.manager import CompiledGrammarCache

    tokenizer, vocab_size = load_tokenizer(resolve_model_dir(None))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=variant == "xgrammar",
                                   cache_limit_bytes=limit_mb * MIB)
    cache = CompiledGrammarCache(limit_mb * MIB if variant == "minicore" else 0)
    process, rng = psutil.Process(), random.Random(0)
    base, rss, seconds = process.memory_info().rss, [], 0.0
    for i in range(grammars):
        words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(12))
                 for _ in range(enum)]
        schema = json.dumps({"type": "object", "required": [f"k{j}" for j in range(10)],
                             "properties": {f"k{j}": {"enum": words[j::10]} for j in range(10)}})
        start = time.perf_counter()
        if (compiled := cache.get(schema)) is None:
            compiled = compiler.compile_json_schema(schema)
            cache.put(schema, compiled)
        seconds += time.perf_counter() - start
        xgr.GrammarMatcher(compiled)
        if i % 10 == 9:
            rss.append(process.memory_info().rss)
    return {"variant": variant, "rss_after_compiler": base, "rss_every_10": rss,
            "growth": rss[-1] - base, "growth_last_half": rss[-1] - rss[len(rss) // 2 - 1],
            "compile_s": seconds / grammars}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grammars", type=int, default=100)
    ap.add_argument("--enum", type=int, default=3000, help="enum strings per schema, in all")
    ap.add_argument("--limit-mb", type=int, default=64, help="the cache limit of both caches")
    ap.add_argument("--json", default=str(Path(__file__).parent / "results" /
                                          "bench_grammar_memory.json"))
    ap.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.variant:
        print(json.dumps(measure(args.variant, args.grammars, args.enum, args.limit_mb)))
        return
    from machine import cpu_description

    rows = []
    for variant in VARIANTS:
        out = subprocess.run([sys.executable, __file__, "--variant", variant, "--grammars",
                              str(args.grammars), "--enum", str(args.enum), "--limit-mb",
                              str(args.limit_mb)], capture_output=True, text=True, check=True)
        rows.append(json.loads(out.stdout.splitlines()[-1]))
    print(f"CPU: {cpu_description()}")
    print(f"{args.grammars} distinct schemas of {args.enum} enum strings, cache limit "
          f"{args.limit_mb} MiB")
    print(f"{'cache':>9} {'RSS after compiler MiB':>22} {'growth MiB':>10} "
          f"{'growth, 2nd half MiB':>20} {'compile s':>9}")
    for r in rows:
        print(f"{r['variant']:>9} {r['rss_after_compiler'] / MIB:>22.0f} {r['growth'] / MIB:>10.0f}"
              f" {r['growth_last_half'] / MIB:>20.0f} {r['compile_s']:>9.3f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(), **vars(args),
                                           "results": rows}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
