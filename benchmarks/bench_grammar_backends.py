"""xgrammar against llguidance (vLLM's "guidance" backend), the two self-contained grammar engines
vLLM offers, on what minicore's StructuredOutputManager asks of one; the measurement behind
minicore's choice of xgrammar (docs/BENCHMARKS.md).

With the default model's tokenizer (SmolLM2-135M-Instruct, 49,152 tokens), side by side in one run:
  setup     building the tokenizer's table once (xgrammar TokenizerInfo + GrammarCompiler;
            llguidance LLTokenizer), best of --repeat
  compile   one JSON schema (bench_structured_outputs.COST_SCHEMA: nested objects, arrays, enums,
            bounded numbers and strings) compiled anew (no cache), median of --repeat
  fill      one bitmask row per token while a valid document of that schema is replayed through a
            matcher (fill, then accept the token), mean and p99 us
The bitmask is the same [rows, ceil(V / 32)] int32 layout for both, applied by minicore's sampler,
so applying it costs the same whichever fills it. llguidance is not installed by setup:
`--setup` pip-installs it (no dependencies) into this interpreter's environment. The CPU model and
flags are printed; results go to benchmarks/results/bench_grammar_backends.json.

    python benchmarks/bench_grammar_backends.py [--setup] [--repeat 5]
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_structured_outputs import COST_SCHEMA  # noqa: E402
from machine import cpu_description  # noqa: E402

LLGUIDANCE = "llguidance==1.9.1"
DOCUMENT = {"customer": "Ada Lovelace", "items": [
    {"product": f"notebook {i}", "quantity": i + 1, "unit_price": 3.5 * (i + 1),
     "category": ["books", "tools", "food"][i % 3]} for i in range(7)]}


def timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int):
        import xgrammar as xgr

        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        compiler = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        return compiler.compile_json_schema(schema)

    def replay(self, compiled, token_ids: list[int]) -> list[float]:
        matcher = self.xgr.GrammarMatcher(compiled)
        bitmask = self.xgr.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token_id in token_ids:
            start = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.accept_token(token_id), f"xgrammar refused token {token_id}"
        return times


class Guidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, vocab_size)
        self.vocab_size = vocab_size

    def compile(self, schema: str):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return grammar

    def replay(self, grammar, token_ids: list[int]) -> list[float]:
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)
        bitmask = self.llg.torch.allocate_token_bitmask(1, self.vocab_size)
        times = []
        for token_id in token_ids:
            start = time.perf_counter()
            self.llg.torch.fill_next_token_bitmask(matcher, bitmask, 0)
            times.append(time.perf_counter() - start)
            assert matcher.consume_token(token_id), f"llguidance refused token {token_id}"
        return times


def measure(backend_cls, tokenizer, vocab_size: int, token_ids: list[int], repeat: int) -> dict:
    setups = [timed(lambda: backend_cls(tokenizer, vocab_size)) for _ in range(repeat)]
    backend = setups[-1][1]
    schema = json.dumps(COST_SCHEMA)
    compiles = [timed(lambda: backend.compile(schema)) for _ in range(repeat)]
    fills = backend.replay(compiles[-1][1], token_ids)
    ordered = sorted(fills)
    return {"setup_ms": 1e3 * min(t for t, _ in setups),
            "compile_ms": 1e3 * statistics.median(t for t, _ in compiles),
            "fill_us_mean": 1e6 * statistics.fmean(fills),
            "fill_us_p99": 1e6 * ordered[int(0.99 * (len(ordered) - 1))],
            "tokens": len(token_ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--setup", action="store_true", help=f"pip install {LLGUIDANCE} first")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=str(Path(__file__).parent / "results"
                                          / "bench_grammar_backends.json"))
    args = ap.parse_args()
    if args.setup:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", LLGUIDANCE],
                       check=True)
    from minicore.model.loader import load_tokenizer, resolve_model_dir

    # The model's vocabulary (its logits' width), which the bitmask covers, as in the engine.
    tokenizer, vocab_size = load_tokenizer(resolve_model_dir())
    token_ids = tokenizer.encode(json.dumps(DOCUMENT, indent=2), add_special_tokens=False)
    token_ids.append(tokenizer.eos_token_id)
    backends = [Xgrammar]
    try:
        import llguidance  # noqa: F401

        backends.append(Guidance)
    except ImportError:
        print(f"llguidance is not installed: --setup installs {LLGUIDANCE}; xgrammar only")
    result = {"cpu": cpu_description(), "vocab_size": vocab_size,
              **{b.name: measure(b, tokenizer, vocab_size, token_ids, args.repeat)
                 for b in backends}}
    print(f"CPU: {result['cpu']}; vocabulary {vocab_size}; document {len(token_ids)} tokens")
    print(f"{'backend':11} {'setup ms':>9} {'compile ms':>10} {'fill us mean':>12} {'p99':>7}")
    for b in backends:
        r = result[b.name]
        print(f"{b.name:11} {r['setup_ms']:>9.1f} {r['compile_ms']:>10.2f} "
              f"{r['fill_us_mean']:>12.1f} {r['fill_us_p99']:>7.1f}")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
