"""Sampler: one token per row of a batch of logits, with vLLM v1's logits processing, and logprobs.

Mirrors vllm/v1/sample/sampler.py (Sampler.forward, apply_logits_processors, sample,
gather_logprobs) with the stages it calls: the allowed_token_ids mask
(vllm/v1/worker/gpu_input_batch.py), bad words (vllm/v1/sample/ops/bad_words.py), min_tokens and
logit_bias (vllm/v1/sample/logits_processor/builtin.py), penalties (vllm/v1/sample/ops/penalties.py
and apply_penalties in vllm/model_executor/layers/utils.py), temperature, min_p, then top-k/top-p
(ops/topk_topp_sampler.py). The order is vLLM's: raw logprobs (log_softmax of the raw logits, its
default logprobs_mode) -> allowed ids -> bad words -> min_tokens -> logit_bias -> penalties ->
greedy argmax | temperature -> min_p -> top-k/top-p -> draw. Each stage runs on the whole [B, V]
batch and is skipped when no row uses it. Random rows are sampled with the exponential race (argmax
of probs / Exp(1) noise), which draws exactly from probs without a multinomial; a seeded request
draws its noise from its own generator, so its tokens do not depend on the rest of the batch.
SamplingMetadata.from_states builds a step's tensors from the request states (as mini-sglang's
Sampler.prepare; vLLM keeps them in its persistent InputBatch, vllm/v1/worker/gpu_input_batch.py).
Speculative decoding's verification (minicore/model/rejection_sampler.py) reuses the stages and
processed_probs. Left out: logprobs modes other than raw_logprobs, logprob_token_ids, custom logits
processors, FlashInfer kernels.
"""

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from minicore.model.runner_base import CachedRequestState
from minicore.protocol import LogprobsLists
from minicore.scheduler.output import SchedulerOutput

_NEG_INF = float("-inf")


@dataclass(slots=True)
class Penalties:
    """Per-row penalties with the token ids they count (padded with vocab_size, which no token
    has): repetition over the prompt and the output, frequency and presence over the output."""
    prompt_token_ids: torch.Tensor  # [B, P] long
    output_token_ids: torch.Tensor  # [B, O] long
    presence: torch.Tensor  # [B] float
    frequency: torch.Tensor  # [B] float
    repetition: torch.Tensor  # [B] float


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float; 0 means greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float, 1 = off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator, for seeded rows
    all_greedy: bool
    # row -> token ids it may not sample yet (min_tokens); only rows that have some.
    blocked_token_ids: dict[int, list[int]] = field(default_factory=dict)
    min_p: torch.Tensor | None = None  # [B] float, 0 = off
    # (rows, token ids, biases) of every row's logit_bias entries.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # [B, V] bool, True where a row with allowed_token_ids may not sample.
    allowed_token_ids_mask: torch.Tensor | None = None
    # row -> (its bad words as token ids, its output token ids so far).
    bad_words: dict[int, tuple[list[list[int]], list[int]]] = field(default_factory=dict)
    penalties: Penalties | None = None
    # The most top logprobs a row asked for (the vocabulary for -1); None: no row asked.
    max_num_logprobs: int | None = None

    @classmethod
    def from_states(cls, states: Sequence[CachedRequestState], vocab_size: int,
                    device: torch.device | str) -> "SamplingMetadata":
        """The batch's sampling tensors, one row per state (the requests that sample this step,
        in order), each stage's left None (or empty) when no row uses it."""
        params = [s.sampling_params for s in states]
        temperature = torch.tensor([p.temperature for p in params], device=device)
        all_greedy = all(p.temperature == 0 or p.top_k == 1 for p in params)
        top_k = top_p = min_p = None
        if not all_greedy and any(p.top_k > 0 for p in params):
            # A top_k past the vocabulary keeps every token (and may not fit a tensor).
            top_k = torch.tensor([min(p.top_k, vocab_size) for p in params], device=device)
        if not all_greedy and any(p.top_p < 1 for p in params):
            top_p = torch.tensor([p.top_p for p in params], device=device)
        if not all_greedy and any(p.min_p > 0 and p.temperature > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        # A stop id past the vocabulary can never be sampled: nothing to mask (nor to index).
        blocked = {i: ids for i, s in enumerate(states)
                   if (ids := [t for t in s.min_tokens_blocked_ids() if t < vocab_size])}
        bad_words = {i: (s.sampling_params.bad_words_token_ids, s.token_ids[s.num_prompt_tokens:])
                     for i, s in enumerate(states) if s.sampling_params.bad_words_token_ids}
        asked = [num_logprobs(p.logprobs, vocab_size) for p in params if p.logprobs is not None]
        return cls(temperature, top_k, top_p, generators, all_greedy, blocked, min_p,
                   _logit_bias(params, device), _allowed_token_ids_mask(params, vocab_size, device),
                   bad_words, _penalties(states, vocab_size, device), max(asked, default=None))


def num_logprobs(num: int, vocab_size: int) -> int:
    """How many top logprobs a request's logprobs or prompt_logprobs asks for: vLLM's -1 is the
    whole vocabulary."""
    return vocab_size if num == -1 else num


def _logit_bias(params, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    entries = [(row, token_id, bias) for row, p in enumerate(params) if p.logit_bias
               for token_id, bias in p.logit_bias.items()]
    if not entries:
        return None
    rows, token_ids, biases = zip(*entries)
    return (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device),
            torch.tensor(biases, dtype=torch.float32, device=device))


def _allowed_token_ids_mask(params, vocab_size: int, device) -> torch.Tensor | None:
    """[B, V], True where a row with allowed_token_ids may not sample (gpu_input_batch.py)."""
    rows = [row for row, p in enumerate(params) if p.allowed_token_ids]
    if not rows:
        return None
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    mask[rows] = True
    allowed_rows = [row for row in rows for _ in params[row].allowed_token_ids]
    allowed_ids = [t for row in rows for t in params[row].allowed_token_ids]
    mask[torch.tensor(allowed_rows, device=device),
         torch.tensor(allowed_ids, device=device)] = False
    return mask


def _penalties(states: Sequence[CachedRequestState], vocab_size: int,
               device) -> Penalties | None:
    params = [s.sampling_params for s in states]
    if all(p.presence_penalty == 0 and p.frequency_penalty == 0
           and p.repetition_penalty == 1 for p in params):
        return None
    prompts = [s.token_ids[:s.num_prompt_tokens] for s in states]
    outputs = [s.token_ids[s.num_prompt_tokens:] for s in states]

    def padded(rows: list[list[int]]) -> torch.Tensor:
        width = max(map(len, rows), default=0)
        return torch.tensor([row + [vocab_size] * (width - len(row)) for row in rows],
                            dtype=torch.long, device=device).reshape(len(rows), width)

    def per_row(name: str) -> torch.Tensor:
        return torch.tensor([getattr(p, name) for p in params], dtype=torch.float32,
                            device=device)

    return Penalties(padded(prompts), padded(outputs), per_row("presence_penalty"),
                     per_row("frequency_penalty"), per_row("repetition_penalty"))


@dataclass(slots=True)
class LogprobsTensors:
    """vLLM's LogprobsTensors: per row, [token, top-1, ..., top-K] ids and logprobs, and the
    token's rank."""
    token_ids: torch.Tensor  # [N, K + 1] long
    logprobs: torch.Tensor  # [N, K + 1] float
    ranks: torch.Tensor  # [N] long

    def tolists(self, rows: range | list[int], num_logprobs: int) -> LogprobsLists:
        """The given rows as LogprobsLists, keeping the token and its own top num_logprobs."""
        rows = list(rows)
        width = 1 + num_logprobs
        return LogprobsLists(self.token_ids[rows, :width].tolist(),
                             self.logprobs[rows, :width].tolist(), self.ranks[rows].tolist())


@dataclass(slots=True)
class SamplerOutput:
    sampled: torch.Tensor  # [B] long
    logprobs: LogprobsTensors | None = None


def compute_logprobs(logits: torch.Tensor) -> torch.Tensor:
    return logits.log_softmax(dim=-1, dtype=torch.float32)


def gather_logprobs(logprobs: torch.Tensor, num_logprobs: int,
                    token_ids: torch.Tensor) -> LogprobsTensors:
    """Each row's token and top num_logprobs logprobs, and the token's rank: how many logprobs of
    its row are >= its own (vLLM's batched_count_greater_than), so the most likely is rank 1."""
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    token_ids = token_ids.unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs >= token_logprobs).sum(-1)
    return LogprobsTensors(torch.cat((token_ids, top_ids), dim=1),
                           torch.cat((token_logprobs, top_logprobs), dim=1), ranks)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and nucleus; at least one survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, _NEG_INF)
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, _NEG_INF)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask the tokens whose probability is below min_p times their row's highest (vLLM's
    MinPLogitsProcessor; after temperature)."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill_(probs < threshold, _NEG_INF)


def _bin_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[B, V] how often each token occurs in each row of token_ids (padding vocab_size dropped)."""
    counts = torch.zeros(token_ids.shape[0], vocab_size + 1, dtype=torch.long,
                         device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids))
    return counts[:, :vocab_size]


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's apply_penalties: repetition divides a positive logit (multiplies a negative one) of a
    token seen in the prompt or the output; frequency subtracts per output occurrence, presence
    once per token in the output (OpenAI's definitions)."""
    vocab = logits.shape[-1]
    output_counts = _bin_counts(p.output_token_ids, vocab)
    output_mask = output_counts > 0
    seen = output_mask | (_bin_counts(p.prompt_token_ids, vocab) > 0)
    penalty = torch.where(seen, p.repetition.unsqueeze(1), 1.0)
    logits *= torch.where(logits > 0, 1.0 / penalty, penalty)
    logits -= p.frequency.unsqueeze(1) * output_counts
    logits -= p.presence.unsqueeze(1) * output_mask
    return logits


def _bad_word_hits(bad_words: dict[int, tuple[list[list[int]], list[int]]]
                   ) -> tuple[list[int], list[int]]:
    """(rows, token ids) to mask: a bad word's last token, where the row's output ends with the
    word's other tokens (vLLM's _apply_bad_words_single_batch)."""
    rows, token_ids = [], []
    for row, (words, past) in bad_words.items():
        for word in words:
            prefix = len(word) - 1
            if prefix <= len(past) and (prefix == 0 or past[-prefix:] == word[:-1]):
                rows.append(row)
                token_ids.append(word[-1])
    return rows, token_ids


def _mask_pairs(logits: torch.Tensor, rows: list[int], token_ids: list[int]) -> None:
    if rows:
        logits[torch.tensor(rows, device=logits.device),
               torch.tensor(token_ids, device=logits.device)] = _NEG_INF


@dataclass(slots=True, frozen=True)
class GrammarRow:
    """A position's row of a step's grammar bitmask, which the scheduler may fill after the
    forward started (SchedulerOutput.grammar_filled: async scheduling, a token in flight)."""
    bitmask: torch.Tensor  # [rows, ceil(V / 32)] int32, the step's
    index: int
    filled: threading.Event | None = None

    def allowed(self) -> torch.Tensor:
        if self.filled is not None:
            self.filled.wait()
        return self.bitmask[self.index]

    def before(self, positions: int) -> "GrammarRow":
        """The row of the position ``positions`` before this one (a draft's)."""
        return GrammarRow(self.bitmask, self.index - positions, self.filled)


def take_grammar_rows(so: SchedulerOutput, requests: dict[str, CachedRequestState]) -> None:
    """Before the forward: each structured request's row of the step's grammar bitmask for the
    token it samples, after one per draft it verifies (apply_grammar_bitmask reads them): the
    drafts it runs, which can be fewer than the placeholders scheduled (async_spec_decode.py)."""
    for req_id, first in so.structured_output_request_ids.items():
        state = requests[req_id]
        state.grammar_bitmask = GrammarRow(so.grammar_bitmask, first + len(state.spec_token_ids),
                                           so.grammar_filled)


def apply_grammar_bitmask(logits: torch.Tensor, states: Sequence[CachedRequestState]) -> None:
    """Mask in place what each structured row's grammar forbids: bit j of word i of its bitmask
    row allows token 32 i + j (xgrammar's layout). Before sampling and logprobs, as vLLM's runner
    applies it (apply_grammar_bitmask in vllm/v1/structured_output/utils.py)."""
    rows = [(row, s.grammar_bitmask) for row, s in enumerate(states)
            if s.grammar_bitmask is not None]
    if not rows:
        return
    index = torch.tensor([row for row, _ in rows], device=logits.device)
    bits = torch.stack([grammar.allowed() for _, grammar in rows]).to(logits.device)
    allowed = ((bits.unsqueeze(-1) >> _BIT_SHIFTS.to(logits.device)) & 1).reshape(len(rows), -1)
    forbidden = allowed[:, :logits.shape[-1]] == 0
    logits[index] = logits[index].masked_fill(forbidden, _NEG_INF)


_BIT_SHIFTS = torch.arange(32, dtype=torch.int32)


def apply_logits_processors(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """What may change even a greedy row's choice, in vLLM's order: allowed ids, bad words,
    min_tokens, logit_bias, penalties."""
    if meta.allowed_token_ids_mask is not None:
        logits.masked_fill_(meta.allowed_token_ids_mask, _NEG_INF)
    if meta.bad_words:
        _mask_pairs(logits, *_bad_word_hits(meta.bad_words))
    if meta.blocked_token_ids:
        blocked = meta.blocked_token_ids
        _mask_pairs(logits, [row for row, ids in blocked.items() for _ in ids],
                    [token_id for ids in blocked.values() for token_id in ids])
    if meta.logit_bias is not None:
        rows, token_ids, biases = meta.logit_bias
        logits[rows, token_ids] += biases
    if meta.penalties is not None:
        logits = apply_penalties(logits, meta.penalties)
    return logits


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
    """Sample one token per row of logits [B, V] (float32, changed in place), with the top
    logprobs of the raw logits when a row asked for them."""
    raw_logprobs = None if meta.max_num_logprobs is None else compute_logprobs(logits)
    logits = apply_logits_processors(logits, meta)
    sampled = logits.argmax(dim=-1)
    if not meta.all_greedy:
        sampled = torch.where(meta.temperature == 0, sampled, _sample_random(logits, meta))
    if raw_logprobs is None:
        return SamplerOutput(sampled)
    return SamplerOutput(sampled, gather_logprobs(raw_logprobs, meta.max_num_logprobs, sampled))


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row samples from, given its processed logits: temperature,
    min_p, top-k/top-p, softmax. The rejection sampler (rejection_sampler.py) verifies drafts
    against the same probabilities."""
    temperature = meta.temperature.clamp(min=1e-5).unsqueeze(1)
    logits = logits / temperature
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def _sample_random(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    probs = processed_probs(logits, meta)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    return probs.div_(noise).argmax(dim=-1)
