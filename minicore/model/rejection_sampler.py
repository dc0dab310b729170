"""Speculative decoding's verification: each request's draft tokens checked in the step's one
forward by rejection sampling, so that what it emits has exactly the target model's distribution.

Mirrors vllm/v1/sample/rejection_sampler.py (RejectionSampler for drafts without probabilities,
the ngram case: a draft is certain, q(x) = 1) with the parts of vllm/v1/worker/gpu_model_runner.py
that feed it (the logits at each request's last k + 1 positions). At position j of a request with
drafts d0..dk-1 the target distribution p_j is its logits after all of minicore/model/sampler.py's
processing, with d0..dj-1 counted as outputs (vLLM combines the outputs with the spec tokens
before penalties, min_tokens and bad words). A greedy row accepts dj while it is the argmax; a
random row accepts dj with probability min(1, p_j(dj) / q(dj)) = p_j(dj). At the first rejection
the row emits a recovered token from the normalised residual max(p_j - q, 0), which is p_j without
dj; after k acceptances, a bonus token from p_k. A row draws from one distribution only, so one
row of exponential noise per request serves whichever (vLLM draws one per request for its
recovered tokens); a seeded request draws its uniforms and its noise from its own generator.
Logprobs are one row per emitted token, from the raw logits at its position (vLLM's default
logprobs mode). Left out: draft probabilities (draft models, EAGLE), the Triton kernels.
"""

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from minicore.model.logprobs import LogprobsOutput
from minicore.model.runner_base import CachedRequestState
from minicore.model.sampler import (
    LogprobsTensors,
    SamplingMetadata,
    apply_grammar_bitmask,
    apply_logits_processors,
    compute_logprobs,
    gather_logprobs,
    processed_probs,
    take_grammar_rows,
)
from minicore.scheduler.output import ModelRunnerOutput, SchedulerOutput


@dataclass(slots=True)
class RejectionOutput:
    # Per request, its accepted drafts and then one token (recovered or bonus).
    token_ids: list[list[int]]
    # One row per emitted token, requests in order; None when no request asked.
    logprobs: LogprobsTensors | None = None


def position_states(state: CachedRequestState) -> list[CachedRequestState]:
    """One state per position of a request whose token_ids end with its k drafts: at position j
    its token ids end with d0..dj-1, so the logits processors count them as outputs. The last
    (the bonus position, the only one without drafts) is the state itself: nothing copied."""
    known, k = len(state.token_ids) - len(state.spec_token_ids), len(state.spec_token_ids)
    grammar = state.grammar_bitmask
    return [CachedRequestState(state.token_ids[:known + j], state.block_ids,
                               state.num_computed_tokens, state.sampling_params,
                               state.num_prompt_tokens, state.eos_token_id,
                               grammar_bitmask=grammar and grammar.before(k - j))
            for j in range(k)] + [state]


def rejection_sample(logits: torch.Tensor, meta: SamplingMetadata, drafts: list[list[int]],
                     generators: dict[int, torch.Generator]) -> RejectionOutput:
    """Verify each request's drafts. logits: [sum(k + 1), V] float32, each request's k + 1
    positions in order (changed in place); meta: one row per position (position_states), its
    generators unused; drafts: per request its k drafts; generators: request index -> its
    generator, which draws for all of the request's positions."""
    device = logits.device
    raw_logprobs = None if meta.max_num_logprobs is None else compute_logprobs(logits)
    logits = apply_logits_processors(logits, meta)
    # Each request's positions hold its drafts, then a 0 at the bonus position, which no draft
    # is at (is_draft False there, so it is never accepted).
    draft_ids = torch.tensor([t for d in drafts for t in d + [0]], device=device)
    is_draft = torch.tensor([j < len(d) for d in drafts for j in range(len(d) + 1)],
                            device=device)
    starts = list(itertools.accumulate((len(d) + 1 for d in drafts[:-1]), initial=0))
    target = logits.argmax(dim=-1)
    accepted = is_draft & (draft_ids == target)
    probs = None
    if not meta.all_greedy:
        probs = processed_probs(logits, meta)
        uniform = _uniforms(len(draft_ids), starts, drafts, generators, device)
        # u < p accepts with probability p and never a token p excludes (p = 0).
        random_accept = is_draft & (uniform < probs.gather(1, draft_ids[:, None]).squeeze(1))
        accepted = torch.where(meta.temperature == 0, accepted, random_accept)
    first = torch.tensor(starts, device=device)
    num_accepted = _leading(accepted, first, max(map(len, drafts)))
    final = first + num_accepted
    tokens = target[final]
    if probs is not None:
        rejected = is_draft[final]
        recovered = _recover(probs[final], draft_ids[final], rejected, generators)
        tokens = torch.where(meta.temperature[final] == 0, tokens, recovered)
    token_ids = [d[:n] + [t] for d, n, t in zip(drafts, num_accepted.tolist(), tokens.tolist())]
    if raw_logprobs is None:
        return RejectionOutput(token_ids)
    positions = [start + j for start, out in zip(starts, token_ids) for j in range(len(out))]
    emitted = torch.tensor([t for out in token_ids for t in out], device=device)
    return RejectionOutput(token_ids, gather_logprobs(raw_logprobs[positions],
                                                      meta.max_num_logprobs, emitted))


def _uniforms(num_positions: int, starts: list[int], drafts: list[list[int]],
              generators: dict[int, torch.Generator], device) -> torch.Tensor:
    """[positions] uniforms in [0, 1), a seeded request's drafts' from its generator."""
    uniform = torch.rand(num_positions, device=device)
    for i, generator in generators.items():
        uniform[starts[i]:starts[i] + len(drafts[i])].uniform_(generator=generator)
    return uniform


def _leading(accepted: torch.Tensor, starts: torch.Tensor, max_drafts: int) -> torch.Tensor:
    """[requests] how many of each request's drafts are accepted before its first rejection.
    The bonus position is never accepted, so the run stops there at the latest: the columns past
    it (the next request's positions, clamped at the end) never count."""
    columns = starts[:, None] + torch.arange(max_drafts + 1, device=starts.device)
    run = accepted[columns.clamp(max=len(accepted) - 1)]
    return run.int().cumprod(dim=1).sum(dim=1)


def _recover(probs: torch.Tensor, draft_ids: torch.Tensor, rejected: torch.Tensor,
             generators: dict[int, torch.Generator]) -> torch.Tensor:
    """[requests] the token each random request emits at its final position: from the residual
    (probs without the rejected draft) after a rejection, else the bonus from probs; drawn by the
    exponential race, which needs no normalising."""
    rows = rejected.nonzero().flatten()
    residual = probs.index_put((rows, draft_ids[rows]), probs.new_zeros(()))
    noise = torch.empty_like(residual).exponential_()
    for i, generator in generators.items():
        noise[i].exponential_(generator=generator)
    return residual.div_(noise).argmax(dim=-1)


class SpecDecodeSampler:
    """The runner's sampling step with speculative decoding, bound once in its __init__: the
    sampling rows' logits at their last k + 1 positions (k = 0 without drafts), rejection
    sampling, then in each state the drafts replaced by what it emitted."""

    def __init__(self, vocab_size: int, device: torch.device,
                 logits: Callable[[torch.Tensor], torch.Tensor], logprobs: LogprobsOutput):
        self.vocab_size = vocab_size
        self.device = device
        # Hidden states -> float32 logits, finished as the model's head does.
        self.logits = logits
        self.logprobs = logprobs

    def take_drafts(self, so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
        """Before the forward: a request's drafts follow its newest token in the scheduled run,
        as known tokens until __call__ replaces them with what it accepted."""
        for req_id, draft_token_ids in so.scheduled_spec_decode_tokens.items():
            state = requests[req_id]
            state.token_ids.extend(draft_token_ids)
            state.spec_token_ids = draft_token_ids
        take_grammar_rows(so, requests)

    def __call__(self, hidden: torch.Tensor, query_start_loc: list[int],
                 states: list[CachedRequestState], rows: list[int],
                 output: ModelRunnerOutput) -> None:
        sampling = [states[row] for row in rows]
        positions = [pos for row, state in zip(rows, sampling)
                     for pos in range(query_start_loc[row + 1] - 1 - len(state.spec_token_ids),
                                      query_start_loc[row + 1])]
        per_position = [s for state in sampling for s in position_states(state)]
        meta = SamplingMetadata.from_states(per_position, self.vocab_size, self.device)
        generators = {i: s.generator for i, s in enumerate(sampling) if s.generator is not None}
        logits = self.logits(hidden[positions])
        apply_grammar_bitmask(logits, per_position)
        result = rejection_sample(logits, meta, [s.spec_token_ids for s in sampling], generators)
        for row, state, token_ids in zip(rows, sampling, result.token_ids):
            del state.token_ids[len(state.token_ids) - len(state.spec_token_ids):]
            state.token_ids.extend(token_ids)
            state.spec_token_ids = []
            output.sampled_token_ids[row] = token_ids
        self.logprobs.add_sampled(result.logprobs, rows, output, list(map(len, result.token_ids)))
