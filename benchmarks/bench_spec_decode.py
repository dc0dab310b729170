"""Speculative decoding with ngram drafts against none, side by side in one run, offline (LLM).

Workloads (greedy, chat-formatted prompts, the default model unless --model):
  repetitive  prompts that ask to repeat, or lightly edit, a passage of prose or code given in the
              prompt: what prompt lookup is for. Run at batch 1 (one request at a time) and at
              concurrency 4 (four at a time).
  open        open-ended questions (nothing to copy) at concurrency 16: what drafts must not slow.
For each workload and concurrency, the same requests run on an engine without drafts and on one
with --speculative-config (after an untimed warm-up of each; in that order, then again in the
other order, --repeat 2 by default, to even out a drifting machine); reported: output tok/s of
each, the ratio, whether the greedy tokens are equal request by request, the mean acceptance
length (1 + accepted drafts per verifying step, as vLLM's log line) and the acceptance rate at each
draft position. --moe also checks greedy equality
on a tiny random MoE model (tests/model/moe_models.py). The CPU model and flags are printed.

    python benchmarks/bench_spec_decode.py [--num-speculative-tokens 3] [--max-tokens 192] \
        [--disable-by-batch-size 8] [--moe]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import cpu_description  # noqa: E402

from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk. He wound the clock, "
    "trimmed the wick, and polished the great lens until it shone. Ships passing in the night "
    "never saw him, but they saw his light, and that was enough for him. In the winter storms "
    "he stayed awake until dawn, listening to the waves break against the rocks below.",
    "To make bread, mix four cups of flour with a spoon of salt and a packet of yeast. Add two "
    "cups of warm water and stir until a rough dough forms. Knead it for ten minutes, then let "
    "it rise in a warm place for an hour. Shape the loaf, let it rise again, and bake it at two "
    "hundred degrees for forty minutes, until the crust is brown and sounds hollow.",
    "Mercury is the smallest planet and the closest to the sun. Venus is the hottest, wrapped in "
    "thick clouds of acid. Earth is the only planet known to hold life. Mars is cold and red, "
    "with the tallest volcano in the solar system. Jupiter is the largest planet, and Saturn is "
    "famous for its bright rings of ice and rock.",
]

CODE = [
    "def total_price(items, tax_rate):\n    subtotal = 0\n    for item in items:\n"
    "        subtotal += item.price * item.quantity\n    tax = subtotal * tax_rate\n"
    "    return subtotal + tax\n\n\ndef cheapest(items):\n    best = None\n"
    "    for item in items:\n        if best is None or item.price < best.price:\n"
    "            best = item\n    return best\n",
    "class Counter:\n    def __init__(self):\n        self.counts = {}\n\n"
    "    def add(self, word):\n        self.counts[word] = self.counts.get(word, 0) + 1\n\n"
    "    def most_common(self, n):\n        ranked = sorted(self.counts.items(), key=lambda kv: "
    "-kv[1])\n        return ranked[:n]\n",
]

OPEN = ["Why is the sky blue?", "Give me three ideas for a birthday party.",
        "What should I pack for a week of hiking?", "How do vaccines work?",
        "Describe a city you would like to visit.", "What makes a good friend?",
        "Explain how a bicycle stays upright.", "Write a short poem about the sea.",
        "What are the benefits of reading every day?", "How do plants grow from seeds?",
        "Tell me about the history of chess.", "What is the best way to learn a language?",
        "Why do cats purr?", "Suggest a plan for a rainy Sunday.",
        "How does a refrigerator keep food cold?", "What would you do with a free afternoon?"]


def repetitive_prompts() -> list[list[dict]]:
    asks = [f"Repeat the following text exactly, word for word:\n\n{p}" for p in PASSAGES]
    asks += [f"Rewrite this Python code exactly as it is, but with 4 spaces replaced by 2 "
             f"spaces:\n\n{c}" for c in CODE]
    asks += [f"Copy this paragraph, changing only the first word to 'A':\n\n{PASSAGES[2]}",
             f"Repeat this code unchanged:\n\n{CODE[0]}"]
    return [[{"role": "user", "content": a}] for a in asks]


def open_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": q}] for q in OPEN]


def spec_stats(llm: LLM):
    stats = llm.llm_engine.scheduler.spec_decode.stats
    return (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
            list(stats.num_accepted_tokens_per_pos))


def run(llm: LLM, conversations: list[list[dict]], concurrency: int,
        params: SamplingParams) -> tuple[float, list[list[int]], int]:
    """Seconds, every request's tokens, output tokens: concurrency requests at a time."""
    tokens: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(conversations), concurrency):
        outputs = llm.chat(conversations[i:i + concurrency], params, use_tqdm=False)
        tokens += [list(o.outputs[0].token_ids) for o in outputs]
    return time.perf_counter() - start, tokens, sum(map(len, tokens))


def measure(plain: LLM, spec: LLM, name: str, conversations, concurrency: int,
            params: SamplingParams, repeat: int) -> dict:
    seconds = {"plain": 0.0, "spec": 0.0}
    before = spec_stats(spec)
    for r in range(repeat):
        order = [("plain", plain), ("spec", spec)] if r % 2 == 0 else [("spec", spec),
                                                                          ("plain", plain)]
        got = {}
        for label, llm in order:
            elapsed, tokens, num_tokens = run(llm, conversations, concurrency, params)
            seconds[label] += elapsed
            got[label] = tokens
    after = spec_stats(spec)
    drafts, draft_tokens, accepted = (a - b for a, b in zip(after[:3], before[:3]))
    per_pos = [a - b for a, b in zip(after[3], before[3])]
    plain_tok_s, spec_tok_s = (repeat * num_tokens / seconds[k] for k in ("plain", "spec"))
    return {"workload": name, "concurrency": concurrency, "requests": len(conversations),
            "output_tokens": num_tokens, "plain_tok_s": plain_tok_s, "spec_tok_s": spec_tok_s,
            "speedup": spec_tok_s / plain_tok_s,
            "greedy_equal": got["plain"] == got["spec"],
            "drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "mean_acceptance_length": 1 + accepted / drafts if drafts else 1.0,
            "acceptance_per_position": [n / drafts if drafts else 0.0 for n in per_pos]}


def moe_equality(args) -> dict:
    """Greedy tokens of a tiny random MoE model with and without drafts (repeating prompts)."""
    import random
    import tempfile

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "model"))
    from moe_models import build_served_moe

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(build_served_moe("qwen3_moe", Path(tmp)))
        engine_args = dict(max_model_len=512, kv_cache_memory=64 << 20)
        rng = random.Random(25)
        prompts = [[rng.randrange(3, 1000) for _ in range(n)] * 4 for n in (3, 5, 8, 13)]
        params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        outputs = {}
        for label, extra in (("plain", {}), ("spec", {"speculative_config": spec_config(args)})):
            llm = LLM(model_dir, **engine_args, **extra)
            outputs[label] = [list(o.outputs[0].token_ids)
                              for o in llm.generate(prompts, params, use_tqdm=False)]
            stats = spec_stats(llm) if extra else None
            del llm
    return {"model": "tiny qwen3_moe", "greedy_equal": outputs["plain"] == outputs["spec"],
            "drafts": stats[0], "accepted_tokens": stats[2]}


def spec_config(args) -> dict:
    """The speculative_config of add_spec_args' flags."""
    config = {"method": "ngram", "num_speculative_tokens": args.num_speculative_tokens,
              "prompt_lookup_max": args.prompt_lookup_max,
              "prompt_lookup_min": args.prompt_lookup_min}
    if getattr(args, "disable_by_batch_size", 0):
        config["disable_by_batch_size"] = args.disable_by_batch_size
    return config


def add_spec_args(ap: argparse.ArgumentParser) -> None:
    """The model and the ngram drafter's flags (also benchmarks/spec_acceptance.py's)."""
    ap.add_argument("--model", default=None, help="model directory or .gguf (default: SmolLM2)")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument("--prompt-lookup-max", type=int, default=4)
    ap.add_argument("--prompt-lookup-min", type=int, default=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_spec_args(ap)
    ap.add_argument("--disable-by-batch-size", type=int, default=8,
                    help="the drafts' batch-size cut-off (0: drafts at every batch size)")
    ap.add_argument("--max-tokens", type=int, default=192)
    ap.add_argument("--repeat", type=int, default=2, help="runs of each side, order alternated")
    ap.add_argument("--moe", action="store_true", help="also check greedy equality on a tiny MoE")
    ap.add_argument("--json",
                    default=str(Path(__file__).parent / "results" / "bench_spec_decode.json"))
    args = ap.parse_args()

    engine_args = dict(max_model_len=2048, kv_cache_memory=256 << 20, max_num_seqs=16)
    plain = LLM(args.model, **engine_args)
    spec = LLM(args.model, **engine_args, speculative_config=spec_config(args))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    # A first generate of each engine pays for its first allocations and kernel setup: untimed.
    for llm in (plain, spec):
        run(llm, open_prompts(), 16, SamplingParams(max_tokens=16, temperature=0))
    rows = [measure(plain, spec, "repetitive", repetitive_prompts(), 1, params, args.repeat),
            measure(plain, spec, "repetitive", repetitive_prompts(), 4, params, args.repeat),
            measure(plain, spec, "open", open_prompts(), 16, params, args.repeat)]
    moe = moe_equality(args) if args.moe else None

    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"--speculative-config {json.dumps(spec_config(args))}")
    print(f"{'workload':11} {'conc':>4} {'out tok':>7} {'no drafts tok/s':>15} "
          f"{'ngram tok/s':>11} {'ratio':>6} {'equal':>5} {'accept len':>10}  per-position")
    for r in rows:
        per_pos = ", ".join(f"{p:.2f}" for p in r["acceptance_per_position"])
        print(f"{r['workload']:11} {r['concurrency']:>4} {r['output_tokens']:>7} "
              f"{r['plain_tok_s']:>15.1f} {r['spec_tok_s']:>11.1f} {r['speedup']:>5.2f}x "
              f"{'yes' if r['greedy_equal'] else 'NO':>5} {r['mean_acceptance_length']:>10.2f}"
              f"  {per_pos}")
    if moe:
        print(f"tiny MoE greedy equal: {'yes' if moe['greedy_equal'] else 'NO'} "
              f"({moe['drafts']} drafts, {moe['accepted_tokens']} accepted)")
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps({"cpu": cpu_description(),
                                           "speculative_config": spec_config(args),
                                           "results": rows, "moe": moe}, indent=2))
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
