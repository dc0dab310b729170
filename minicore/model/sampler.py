"""Sampler: greedy, temperature, top-k and top-p, with per-request seeds, for a batch of logits.

Mirrors vllm/v1/sample/sampler.py and ops/topk_topp_sampler.py. Random rows are sampled with the
exponential race (argmax of probs / Exp(1) noise), which draws exactly from probs without a
multinomial. A seeded request draws its noise from its own generator, so its tokens do not depend
on what else is in the batch. Until a request has min_tokens outputs, its EOS and stop ids are
masked (vLLM's MinTokensLogitsProcessor), greedy rows included. Left out: logprobs, penalties,
min-p, logit bias, bad words.
"""

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingMetadata:
    temperature: torch.Tensor  # [B] float; 0 means greedy
    top_k: torch.Tensor | None  # [B] long, 0 = off; None when no row uses it
    top_p: torch.Tensor | None  # [B] float, 1 = off; None when no row uses it
    generators: dict[int, torch.Generator]  # row -> generator, for seeded rows
    all_greedy: bool
    # row -> token ids it may not sample yet (min_tokens); only rows that have some.
    blocked_token_ids: dict[int, list[int]] = field(default_factory=dict)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask (to -inf) the logits outside each row's top-k and nucleus; at least one survives."""
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
        kth = sorted_logits.gather(-1, (vocab - k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    if top_p is not None:
        cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cum <= (1 - top_p).unsqueeze(1)
        drop[:, -1] = False
        sorted_logits.masked_fill_(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Sample one token per row of logits [B, V] (float32); returns [B] token ids."""
    for row, token_ids in meta.blocked_token_ids.items():
        logits[row, token_ids] = float("-inf")
    greedy = logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy
    temperature = meta.temperature.clamp(min=1e-5).unsqueeze(1)
    logits = apply_top_k_top_p(logits / temperature, meta.top_k, meta.top_p)
    probs = logits.softmax(dim=-1)
    noise = torch.empty_like(probs).exponential_()
    for row, generator in meta.generators.items():
        noise[row].exponential_(generator=generator)
    sampled = probs.div_(noise).argmax(dim=-1)
    return torch.where(meta.temperature == 0, greedy, sampled)
