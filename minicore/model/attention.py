"""Paged attention for transformers models, plugged in through ``transformers.AttentionInterface``.

Mirrors vLLM v1's attention backend layer, reduced to a torch implementation:
- ``AttentionMetadata`` follows ``CommonAttentionMetadata`` of
  ``vllm/v1/attention/backends/utils.py`` (``query_start_loc``, ``seq_lens``,
  ``block_table_tensor``, ``slot_mapping``), plus the decode / prefill split of
  ``split_decodes_and_prefills`` and host-side copies so that a step needs no device syncs;
- the cache layout ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` is that of
  ``FlashAttentionBackend.get_kv_cache_shape`` (``vllm/v1/attention/backends/flash_attn.py``), and
  the cache write is ``reshape_and_cache_flash``;
- the attention itself follows the torch SDPA path of ``vllm/v1/attention/backends/cpu_attn.py``:
  one batched SDPA call for all single-token (decode) sequences, one call per prefill sequence;
- how the decode sequences read their keys is a ``DecodeAttention`` the runner chooses once, as
  vLLM picks an attention backend by platform: ``GatheredDecode``, the padded gather of their
  blocks, by default; on CPU per-request rows read in place (``minicore/model/decode_kv.py``);
- sliding windows and attention-logit soft-capping as ``FlashAttentionImpl`` takes them
  (``sliding_window``, ``logits_soft_cap``; Gemma2 / Gemma3, Mistral, ...): a key is seen from
  ``sliding_window - 1`` positions back, and capped scores are ``cap * tanh(score / cap)``, computed
  in plain torch since SDPA has no soft-cap. The cache still keeps every position of a sequence.
``compute_logits`` is the matching piece of ``LogitsProcessor`` (``vllm/model_executor/layers/
logits_processor.py``): the per-family scale and final soft-cap that transformers applies in its
``*ForCausalLM.forward``, which minicore bypasses to run the LM head on sampling rows only.
DeepSeek's multi-head latent attention reads a cache of its own through these pieces
(minicore/model/mla.py). Left out: flash-attn / other CUDA kernels, ALiBi, sinks (the loader
refuses those models), cascade attention, fp8 KV caches and padded slots (``-1``) for CUDA graphs.

The model is fed one packed batch: ``input_ids`` and ``position_ids`` of shape ``[1, T]``, with
``use_cache=False`` and the metadata as the ``minicore_meta`` keyword argument, which transformers
hands through every layer to the attention function.
"""

from __future__ import annotations

from collections.abc import Callable, Container
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, AttentionMaskInterface, PreTrainedModel

from minicore.model.loader import check_attention_supported

ATTN_IMPLEMENTATION = "minicore_paged"
META_KWARG = "minicore_meta"
# Attention arguments of transformers models that this implementation does not apply; the loader
# refuses the models that pass them, and a model its check missed fails here, never runs wrong.
_UNSUPPORTED_KWARGS = {"s_aux": "attention sinks", "sinks": "attention sinks",
                       "position_bias": "relative position bias",
                       "indices": "sparse attention (top-k indices)",
                       "block_indices": "block-sparse attention"}


class DecodeAttention(Protocol):
    """How one step's decode sequences (one new token each) read their keys and values. The
    default, GatheredDecode, reads the paged cache; a runner may plug in another once, at
    construction (on CPU, per-request rows: minicore/model/decode_kv.py)."""

    def update_kv(self, layer: int, key: torch.Tensor, value: torch.Tensor,
                  kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        """After the step's K/V of ``layer`` are in the paged cache: keep whatever else it reads
        (``key``, ``value``: ``[T, kv_heads, head_dim]``)."""

    def attend(self, q: torch.Tensor, kv_cache: torch.Tensor, layer: int,
               meta: AttentionMetadata, scaling: float, window: int | None,
               softcap: float | None) -> torch.Tensor:
        """Attention of ``q`` (``[Bd, kv_heads, group, head_dim]``: the decode sequences in
        order, GQA's query heads grouped by KV head) over each one's ``meta.decode_seq_lens``
        keys; the same shape back."""


class GatheredDecode:
    """Decode attention on the paged cache alone: every decode sequence's blocks gathered into
    one padded batch, one masked SDPA call (the torch path of ``cpu_attn.py``). The planner too:
    it keeps no state, so each step's plan is itself."""

    def plan(self, req_ids: list[str], computed: list[int], num_new: list[int],
             live: Container[str]) -> GatheredDecode:
        return self

    def update_kv(self, layer, key, value, kv_cache, meta) -> None:
        pass  # it reads the paged cache only

    def attend(self, q, kv_cache, layer, meta, scaling, window, softcap) -> torch.Tensor:
        """Masked by length (and by the window: the last ``window`` keys). GQA: the query heads
        sharing a KV head are that head's query rows (no KV repeat)."""
        kv = _gather_kv(kv_cache, meta.decode_block_tables)
        k, v = kv[0], kv[-1]  # a one-entry cache (MLA's) is its own value
        mask = meta.decode_mask
        if window is not None:
            kv_pos = torch.arange(mask.shape[-1], device=mask.device)
            mask = mask & (kv_pos >= meta.decode_seq_lens - window)
        if softcap is None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling)
        return _softcapped_attention(q, k, v, mask, scaling, softcap)


GATHERED_DECODE = GatheredDecode()


@dataclass(slots=True)
class AttentionMetadata:
    """Where a packed batch's tokens sit in the paged KV cache. ``T`` tokens, ``B`` sequences."""

    positions: torch.Tensor  # [T] int64, absolute position of each token in its sequence
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with block 0
    seq_lens: torch.Tensor  # [B] int64, KV length of each sequence after this step
    query_start_loc: torch.Tensor  # [B + 1] int64, token rows of sequence i: [qsl[i], qsl[i+1])
    kv_caches: list[torch.Tensor]  # per layer, shape kv_cache_shape(...)
    # Host-side copies, so the attention needs no device-to-host syncs.
    seq_lens_cpu: list[int]
    query_start_loc_cpu: list[int]
    # The decode queries, attended in one batched call: sequences with one new token ("decodes",
    # in any order), or with token_queries every token:
    decode_tokens: torch.Tensor  # [Bd] int64, their token rows
    decode_block_tables: torch.Tensor  # [Bd, blocks of the longest] int64
    decode_mask: torch.Tensor  # [Bd, 1, 1, blocks * block_size] bool, True below seq_len
    decode_seq_lens: torch.Tensor  # [Bd, 1, 1, 1] int64, their seq_lens (for sliding windows)
    prefill_seqs: list[int]  # the other sequences, attended one by one
    # How the decodes read their keys this step: the runner's plugged-in way, or the gather.
    decode_attention: DecodeAttention = GATHERED_DECODE

    @classmethod
    def build(
        cls,
        block_tables: list[list[int]],
        num_computed_tokens: list[int],
        num_new_tokens: list[int],
        kv_caches: list[torch.Tensor],
        decode_attention: DecodeAttention = GATHERED_DECODE,
        token_queries: bool = False,
    ) -> AttentionMetadata:
        """Metadata for sequences whose first ``num_computed_tokens[i]`` tokens are already cached
        and whose next ``num_new_tokens[i]`` tokens are in this batch, in that order. With
        ``token_queries`` every token is a decode query over its own prefix, so that a token's
        attention is computed the same way whether it is decoded, verified as a draft or in a
        prefill chunk of any size (batch invariance)."""
        block_size = kv_caches[0].shape[2]
        new, computed = torch.tensor(num_new_tokens), torch.tensor(num_computed_tokens)
        seq_lens = computed + new
        tables = _pad_tables(block_tables, seq_lens, block_size)
        qsl = F.pad(new.cumsum(0), (1, 0))
        seq_of_token = torch.repeat_interleave(torch.arange(len(new)), new)
        positions = torch.arange(int(qsl[-1])) - qsl[seq_of_token] + computed[seq_of_token]
        slots = tables[seq_of_token, positions // block_size] * block_size + positions % block_size
        if token_queries:  # each token a query of its sequence, over its position + 1 keys
            query_rows, decodes = torch.arange(len(positions)), seq_of_token
            query_lens = positions + 1
        else:
            decodes = (new == 1).nonzero().flatten()
            query_rows, query_lens = qsl[decodes], seq_lens[decodes]
        decode_blocks = -(-int(query_lens.max()) // block_size) if len(decodes) else 0
        decode_mask = torch.arange(decode_blocks * block_size) < query_lens[:, None]
        device = kv_caches[0].device
        return cls(
            positions=positions.to(device),
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            seq_lens=seq_lens.to(device),
            query_start_loc=qsl.to(device),
            kv_caches=kv_caches,
            seq_lens_cpu=seq_lens.tolist(),
            query_start_loc_cpu=qsl.tolist(),
            decode_tokens=query_rows.to(device),
            decode_block_tables=tables[decodes, :decode_blocks].to(device),
            decode_mask=decode_mask[:, None, None, :].to(device),
            decode_seq_lens=query_lens.view(-1, 1, 1, 1).to(device),
            prefill_seqs=[] if token_queries else (new > 1).nonzero().flatten().tolist(),
            decode_attention=decode_attention,
        )


def use_paged_attention(model: PreTrainedModel) -> None:
    """Register the paged attention with transformers and switch ``model`` to it.

    The mask function returns None, so transformers builds no dense mask for the packed batch.
    ``model.set_attn_implementation("sdpa")`` switches back for a plain forward or ``generate``.
    A model whose attention this would compute wrong is refused (also when loaded by the caller).
    """
    check_attention_supported(model)
    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _no_mask)
    model.set_attn_implementation(ATTN_IMPLEMENTATION)


@contextmanager
def attn_implementation(model: PreTrainedModel, name: str):
    """Run the model with another attention for a while, e.g. "sdpa" for transformers' own
    generate on a model minicore serves (the paged attention needs minicore's metadata)."""
    old = model.config._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(old)


def compute_logits(config, logits: torch.Tensor) -> torch.Tensor:
    """float32 logits from the LM head's output, as transformers' causal LM heads finish them:
    Cohere's ``logit_scale`` multiplies, Granite's ``logits_scaling`` divides, Gemma2/3's
    ``final_logit_softcapping`` caps (``cap * tanh(logits / cap)``)."""
    logits = logits.float()
    if (scale := getattr(config, "logit_scale", None)) is not None:
        logits = logits * scale
    if (divisor := getattr(config, "logits_scaling", None)) is not None:
        logits = logits / divisor
    if (cap := getattr(config, "final_logit_softcapping", None)) is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _no_mask(**kwargs) -> None:
    return None


def paged_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` is ``[1, heads, T, head_dim]``, ``key`` and
    ``value`` are ``[1, kv_heads, T, head_dim]``; returns ``([1, T, heads, head_dim], None)``.
    ``sliding_window`` and ``softcap`` come as transformers passes them (Qwen2-MoE sets the window
    on the module only, so that is the fallback)."""
    meta: AttentionMetadata | None = kwargs.get(META_KWARG)
    if meta is None:
        raise ValueError(
            f"{ATTN_IMPLEMENTATION!r} attention needs the {META_KWARG}= forward argument; "
            "use model.set_attn_implementation('sdpa') for a plain forward"
        )
    _refuse_unsupported(kwargs)
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    softcap = kwargs.get("softcap")
    kv_cache = meta.kv_caches[module.layer_idx]
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, heads, head_dim]
    write_kv_cache(kv_cache, k, v, meta.slot_mapping)
    layer = module.layer_idx
    meta.decode_attention.update_kv(layer, k, v, kv_cache, meta)

    def decode(rows: torch.Tensor | None) -> torch.Tensor:
        q_decode = q if rows is None else q[rows]
        return batched_decode_attention(q_decode, kv_cache, layer, meta, scaling, window,
                                        softcap)

    def prefill(seq: int, start: int, end: int) -> torch.Tensor:
        k_seq, v_seq = sequence_kv(k[start:end], v[start:end], kv_cache, meta, seq)
        return prefill_attention(q[start:end], k_seq, v_seq, scaling, window, softcap)

    return attend_by_kind(meta, decode, prefill).unsqueeze(0), None


def attend_by_kind(meta: AttentionMetadata, decode: Callable[[torch.Tensor | None], torch.Tensor],
                   prefill: Callable[[int, int, int], torch.Tensor]) -> torch.Tensor:
    """The attention output of every token (``[T, heads, dim]``): the decode queries' in one call,
    ``decode(rows)`` (their token rows; None when every token is one, the steady state, where
    token i is sequence i), each prefill sequence's by ``prefill(seq, start, end)``."""
    if not meta.prefill_seqs:
        return decode(None)
    out = None
    for seq in meta.prefill_seqs:
        start, end = meta.query_start_loc_cpu[seq], meta.query_start_loc_cpu[seq + 1]
        part = prefill(seq, start, end)
        if out is None:
            out = part.new_empty(meta.query_start_loc_cpu[-1], *part.shape[1:])
        out[start:end] = part
    if meta.decode_tokens.numel():
        out.index_copy_(0, meta.decode_tokens, decode(meta.decode_tokens))
    return out


def _refuse_unsupported(kwargs: dict) -> None:
    unsupported = [feature for name, feature in _UNSUPPORTED_KWARGS.items()
                   if kwargs.get(name) is not None]
    if kwargs.get("is_causal") is False:
        unsupported.append("non-causal attention")
    if unsupported:
        raise ValueError(f"{ATTN_IMPLEMENTATION!r} attention does not support {unsupported[0]}")


def write_kv_cache(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store ``key``/``value`` rows (``[T, kv_heads, head_dim]``) at their slots; a one-entry
    cache (MLA's latent rows, minicore/model/kv_cache_interface.py) stores the keys alone."""
    _, _, _, num_kv_heads, head_dim = kv_cache.shape
    for entry, rows in zip(kv_cache, (key, value)):
        entry.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, rows)


def _gather_kv(kv_cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """Keys and values of the blocks of each row of ``block_tables`` (``[rows, blocks]``):
    ``[entries, rows, kv_heads, blocks * block_size, head_dim]``."""
    entries, _, _, num_kv_heads, head_dim = kv_cache.shape
    # index_select on whole blocks is faster on CPU than kv_cache[:, block_tables].
    kv = kv_cache.flatten(2).index_select(1, block_tables.flatten())
    kv = kv.view(entries, block_tables.shape[0], -1, num_kv_heads, head_dim)
    return kv.transpose(2, 3)


def batched_decode_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """All single-query sequences at once, as the step's decode attention reads them
    (GatheredDecode's gather by default), with GQA's query heads grouped by their KV head."""
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    q = q.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = meta.decode_attention.attend(q, kv_cache, layer, meta, scaling, window, softcap)
    return out.reshape(num_seqs, num_heads, head_dim)


def sequence_kv(
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    seq: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All keys and values of sequence ``seq`` as ``[1, kv_heads, seq_len, head_dim]``: the new
    ones when the whole sequence is in this batch, else read from the cache (a later chunk of a
    chunked prefill, or a prefix-cache hit)."""
    seq_len = meta.seq_lens_cpu[seq]
    if new_k.shape[0] == seq_len:
        return new_k.transpose(0, 1).unsqueeze(0), new_v.transpose(0, 1).unsqueeze(0)
    num_blocks = -(-seq_len // kv_cache.shape[2])
    kv = _gather_kv(kv_cache, meta.block_tables[seq : seq + 1, :num_blocks])
    return kv[0, ..., :seq_len, :], kv[-1, ..., :seq_len, :]


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scaling: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Causal attention of one sequence's last ``Lq`` positions (``q``: ``[Lq, heads, head_dim]``)
    over its ``Lk`` keys: query ``i`` sees key positions ``<= Lk - Lq + i`` (and, with a window,
    ``> Lk - Lq + i - window``)."""
    num_queries, num_heads, head_dim = q.shape
    num_kv_heads, num_keys = k.shape[1], k.shape[2]
    mask = None
    if num_queries != num_keys or window is not None or softcap is not None:
        kv_pos = torch.arange(num_keys, device=q.device)
        q_pos = kv_pos[num_keys - num_queries :, None]
        mask = kv_pos[None, :] <= q_pos
        if window is not None:
            mask = mask & (kv_pos[None, :] > q_pos - window)
    if softcap is None:
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0), k, v, attn_mask=mask, is_causal=mask is None,
            scale=scaling, enable_gqa=True,
        )
        return out[0].transpose(0, 1)
    # GQA as in batched_decode_attention: q [kv_heads, group, Lq, dim], k, v [kv_heads, 1, Lk, dim]
    q = q.transpose(0, 1).reshape(num_kv_heads, num_heads // num_kv_heads, num_queries, head_dim)
    out = _softcapped_attention(q, k[0].unsqueeze(1), v[0].unsqueeze(1), mask, scaling, softcap)
    return out.reshape(num_heads, num_queries, head_dim).transpose(0, 1)


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
    softcap: float,
) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scaling / cap)) v under a boolean ``mask``, in plain torch as
    transformers' eager attention computes it (SDPA has no soft-cap)."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * scaling
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _pad_tables(
    block_tables: list[list[int]], seq_lens: torch.Tensor, block_size: int
) -> torch.Tensor:
    """``[B, max_blocks]`` block ids padded with block 0; each table must cover its sequence."""
    needed = (-(-seq_lens // block_size)).tolist()
    short = [i for i, (t, n) in enumerate(zip(block_tables, needed)) if len(t) < n]
    if short:
        raise ValueError(f"block tables of sequences {short} are too short for their seq_lens")
    width = max([len(t) for t in block_tables] + [1])
    return torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
