"""Draft acceptance measured on the real engine, against what `python -m minicore simulate` assumes.

Runs the offline LLM (the default model unless --model; greedy) with ngram drafts (K = 3,
prompt_lookup_max 4, prompt_lookup_min 2, no disable_by_batch_size) on two workloads:
  repetitive  bench_spec_decode.py's prompts that ask to repeat or lightly edit a passage given in
              the prompt (7 chats, up to 192 output tokens, all at once)
  random      16 prompts of 128 random token ids (bench_throughput.py's uniform workload, fewer),
              64 output tokens, EOS ignored
The scheduler's counters (vLLM's: drafts, draft tokens, accepted tokens, accepted per position;
minicore/scheduler/spec_decode.py) give the mean acceptance length and, as the accepted tokens of a
draft are always a prefix of it, the distribution of accepted counts per verifying step. A subclass
of that component, put in its place, records what the counters lose: each draft's length with its
accepted count (ngram proposes fewer than K tokens, or none, when the match runs short) and the
decode steps without a draft. Then what `simulate --acceptance-rate` gives with K drafts every
decode step, each from a run of the simulator itself (minicore/dp/simulator.py, DP 1, its
schedulers' counters): the scalar P with the measured mean accepted per draft (Binomial counts), and
the measured per-position rates fed to the prefix model (rate i = a_i / a_(i-1)). Prints markdown
tables and the CPU model, writes JSON under benchmarks/results/. Acceptance only, no timing, so
machine load does not matter. Left out: sampling with temperature > 0 (acceptance then also depends
on the two distributions).

    python benchmarks/spec_acceptance.py [--num-speculative-tokens 3] [--model DIR]
"""

import argparse
import json
import statistics
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_spec_decode import add_spec_args, repetitive_prompts, spec_config  # noqa: E402
from bench_throughput import make_workload  # noqa: E402
from machine import cpu_description  # noqa: E402

from minicore.config import CacheConfig, SchedulerConfig  # noqa: E402
from minicore.dp.simulator import (  # noqa: E402
    CostModel,
    DPSimulator,
    SimConfig,
    make_random_workload,
)
from minicore.llm import LLM  # noqa: E402
from minicore.sampling_params import SamplingParams  # noqa: E402
from minicore.scheduler.spec_decode import SpecDecode  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results" / "spec_acceptance.json"


class RecordingSpecDecode(SpecDecode):
    """The scheduler's draft bookkeeping, also keeping each verified draft's length and accepted
    count, and counting each request's steps that emitted tokens (vLLM's counters keep none)."""

    def __init__(self, num_spec_tokens: int):
        super().__init__(num_spec_tokens)
        self.drafts: list[tuple[int, int]] = []
        self.emitting_steps: Counter[str] = Counter()

    def take_back_rejected(self, scheduler_output, runner_output, requests) -> None:
        index, sampled = runner_output.req_id_to_index, runner_output.sampled_token_ids
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            if req_id in requests and req_id in index:
                self.drafts.append((len(drafts), len(sampled[index[req_id]]) - 1))
        self.emitting_steps.update(req_id for req_id, row in index.items() if sampled[row])
        super().take_back_rejected(scheduler_output, runner_output, requests)


@dataclass(slots=True)
class Acceptance:
    """Accepted drafts as vLLM's metrics give them, and the figures derived from them."""
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    # Drafts whose token at position i was accepted: vLLM's num_accepted_tokens_per_pos.
    accepted_per_pos: list[int]

    @property
    def mean_acceptance_length(self) -> float:
        """vLLM's: 1 + accepted tokens per verifying step (the tokens such a step emits)."""
        return 1 + self.num_accepted_tokens / self.num_drafts

    @property
    def per_position(self) -> list[float]:
        """vLLM's per-position acceptance a_i: the share of drafts with position i accepted."""
        return [n / self.num_drafts for n in self.accepted_per_pos]

    @property
    def conditional(self) -> list[float]:
        """Rate i given positions 0..i-1 were accepted, a_i / a_(i-1): the prefix model's."""
        rates, before = [], 1.0
        for a in self.per_position:
            rates.append(a / before if before else 0.0)
            before = a
        return rates

    @property
    def count_distribution(self) -> list[float]:
        """P(j drafts accepted in a verifying step), j = 0..K: a_(j-1) - a_j, since the accepted
        tokens are a prefix of the draft."""
        a = [1.0, *self.per_position, 0.0]
        return [a[j] - a[j + 1] for j in range(len(a) - 1)]

    @property
    def count_sd(self) -> float:
        """The standard deviation of the accepted count per verifying step."""
        dist = self.count_distribution
        mean = sum(j * p for j, p in enumerate(dist))
        return sum((j - mean) ** 2 * p for j, p in enumerate(dist)) ** 0.5

    def row(self) -> dict:
        return {**asdict(self), "mean_acceptance_length": self.mean_acceptance_length,
                "count_sd": self.count_sd,
                "per_position": self.per_position, "conditional": self.conditional,
                "count_distribution": self.count_distribution}


def acceptance_of(stats) -> Acceptance:
    return Acceptance(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                      list(stats.num_accepted_tokens_per_pos))


def measure(llm: LLM, k: int, run) -> dict:
    """One workload on the engine with a fresh recorder: run(llm) returns the RequestOutputs."""
    recorder = RecordingSpecDecode(k)
    # A measurement hook: the scheduler calls its component through this attribute.
    llm.llm_engine.scheduler.spec_decode = recorder
    outputs = run(llm)
    # A request's first emitting step completes its prompt; every later one is a decode step.
    steps = [recorder.emitting_steps[o.request_id] - 1 for o in outputs]
    tokens = [len(o.outputs[0].token_ids) - 1 for o in outputs]
    lens = [n for n, _ in recorder.drafts]
    return {"requests": len(outputs), "output_tokens": sum(tokens) + len(outputs),
            "decode_steps": sum(steps), "draft_coverage": len(lens) / sum(steps),
            "draft_len_share": [lens.count(n) / len(lens) for n in range(1, k + 1)],
            "rate_where_drafted": rate_where_drafted(recorder.drafts, k),
            "tokens_per_decode_step": sum(tokens) / sum(steps),
            # How far requests differ: the simulator draws every step alike for every request.
            "tokens_per_decode_step_by_request": [t / s for t, s in zip(tokens, steps) if s],
            "measured": acceptance_of(recorder.stats).row()}


def rate_where_drafted(drafts: list[tuple[int, int]], k: int) -> list[float]:
    """Rate i given positions 0..i-1 were accepted, among the drafts that have a position i: the
    target's rejections alone, without the drafts that ngram cut short."""
    rates = []
    for i in range(k):
        reached = sum(n > i and a >= i for n, a in drafts)
        rates.append(sum(a > i for _, a in drafts) / reached if reached else 0.0)
    return rates


def simulated(k: int, rate: float | tuple[float, ...]) -> dict:
    """What `simulate --num-speculative-tokens k --acceptance-rate rate` gives: DP 1, 256
    requests of 32 prompt and 256 output tokens all at once (about 20,000 drafts)."""
    workload = make_random_workload(256, 32, 256, seed=0)
    max_model_len = 288 + k
    scheduler = SchedulerConfig(max_num_seqs=256, max_num_batched_tokens=8192,
                                max_model_len=max_model_len)
    # Room for every request at once: nothing is preempted.
    cache = CacheConfig(block_size=16, num_blocks=1 + 256 * -(-max_model_len // 16),
                        enable_prefix_caching=False)
    simulator = DPSimulator(SimConfig(1, scheduler, cache, CostModel(), k, rate), workload)
    simulator.run()
    return acceptance_of(simulator.spec_decoding_stats()).row()


def compare(result: dict, k: int) -> dict:
    """The measured workload's two `simulate` counterparts, rates rounded as a flag gives them."""
    measured = result["measured"]
    p = round((measured["mean_acceptance_length"] - 1) / k, 3)
    prefix = tuple(round(r, 3) for r in measured["conditional"])
    # With the draftless decode steps: the P whose 1 + K P is the measured tokens a decode step.
    p_step = round((result["tokens_per_decode_step"] - 1) / k, 3)
    return {"binomial": {"acceptance_rate": p, **simulated(k, p)},
            "prefix": {"acceptance_rate": ",".join(map(str, prefix)), **simulated(k, prefix)},
            "acceptance_rate_per_decode_step": p_step}


def print_tables(results: dict, k: int) -> None:
    print("\n| workload | requests | output tokens | decode steps | with a draft | draft length "
          + " / ".join(map(str, range(1, k + 1))) + " | tokens a decode step | by request: "
          "min / median / max |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        lens = " / ".join(f"{s:.2f}" for s in r["draft_len_share"])
        by_request = r["tokens_per_decode_step_by_request"]
        spread = " / ".join(f"{x:.2f}" for x in (min(by_request), statistics.median(by_request),
                                                  max(by_request)))
        print(f"| {name} | {r['requests']} | {r['output_tokens']} | {r['decode_steps']} | "
              f"{r['draft_coverage']:.2f} | {lens} | {r['tokens_per_decode_step']:.2f} | "
              f"{spread} |")
    for name, r in results.items():
        print(f"\n{name}: per verifying step (K = {k})\n")
        print("| | drafts | mean acceptance length | accepted per position a_i | rate i given "
              "0..i-1 | P(accepted = " + ", ".join(map(str, range(k + 1))) + ") | sd |")
        print("|---|---:|---:|---|---|---|---:|")
        rows = [("measured", r["measured"]),
                (f"simulate --acceptance-rate {r['binomial']['acceptance_rate']} (Binomial)",
                 r["binomial"]),
                (f"simulate --acceptance-rate {r['prefix']['acceptance_rate']} (prefix)",
                 r["prefix"])]
        for label, a in rows:
            print(f"| {label} | {a['num_drafts']} | {a['mean_acceptance_length']:.2f} | "
                  + " | ".join(", ".join(f"{x:.3f}" for x in a[key])
                               for key in ("per_position", "conditional", "count_distribution"))
                  + f" | {a['count_sd']:.2f} |")
        print(f"\nRate i given 0..i-1, among the drafts with a position i (short drafts left "
              f"out): {', '.join(f'{x:.3f}' for x in r['rate_where_drafted'])}. With the decode "
              f"steps that had no draft: --acceptance-rate {r['acceptance_rate_per_decode_step']}"
              f" gives the measured {r['tokens_per_decode_step']:.2f} tokens a decode step "
              "(1 + K P).")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_spec_args(ap)
    ap.add_argument("--json", default=str(RESULTS))
    args = ap.parse_args()
    k = args.num_speculative_tokens
    spec = spec_config(args)
    llm = LLM(args.model, max_model_len=2048, kv_cache_memory=256 << 20, max_num_seqs=16,
              speculative_config=spec)
    vocab = llm.llm_engine.model_runner.model.config.vocab_size
    random_prompts = [prompt for prompt, _ in make_workload("uniform", 16, vocab)]
    workloads = {
        "repetitive": lambda llm: llm.chat(repetitive_prompts(), SamplingParams(
            max_tokens=192, temperature=0), use_tqdm=False),
        "random": lambda llm: llm.generate(random_prompts, SamplingParams(
            max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)}
    results = {}
    for name, run in workloads.items():
        results[name] = measure(llm, k, run)
        results[name].update(compare(results[name], k))
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"LLM(speculative_config={json.dumps(spec)}), greedy")
    print_tables(results, k)
    path = Path(args.json)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_description(), "speculative_config": spec,
                                "results": results}, indent=1))
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
