"""Multi-head latent attention (DeepSeek-V2/V3) over the paged KV cache.

Mirrors vLLM's MLA backends (``MLACommonImpl`` in ``vllm/v1/attention/backends/mla/common.py``
and ``MLAAttention`` in ``vllm/model_executor/layers/attention/mla_attention.py``), in torch, as
the forward of transformers' own attention modules (``DeepseekV3Attention``,
``DeepseekV2Attention``), bound once by ``use_latent_attention``:
- the cache keeps per token the compressed latent ``kv_c`` (``kv_lora_rank``, after
  ``kv_a_layernorm``) and the rotated shared key ``k_pe`` (``qk_rope_head_dim``), once for all
  heads (minicore/model/kv_cache_interface.py);
- a prefill sequence (``_forward_prefill``) has its latents expanded by ``kv_b_proj`` into each
  head's keys and values, then causal attention as for any model;
- decode queries (``_forward_decode``) absorb the up-projections: ``q_nope @ W_UK`` puts the
  query in latent space, so attention is multi-query over the cached rows themselves
  (``kv_lora_rank + qk_rope_head_dim`` features); the value is the row's latent part (the decode
  paths read the key rows as values and their rope columns are dropped), and ``@ W_UV`` gives
  each head's value. Only the latent is read, never a per-head K or V.
With batch invariance every token is a decode query, and the absorbed products run per head by
the native linear kernel, whose sums do not depend on the batch. Left out: FlashMLA / FlashInfer
kernels, fp8 caches, vLLM's chunked reading of a long prefix in prefill, decode context parallel.
"""

from __future__ import annotations

import ctypes
import sys

import torch

from minicore.model.attention import (
    META_KWARG,
    AttentionMetadata,
    attend_by_kind,
    batched_decode_attention,
    prefill_attention,
    sequence_kv,
    write_kv_cache,
)
from minicore.model.native import linear


def use_latent_attention(model: torch.nn.Module, kernels: ctypes.CDLL | None = None) -> int:
    """Bind each DeepSeek attention module of ``model`` to MLAAttention; returns how many (none
    for any other model). ``kernels``: run the absorbed products by the native kernel."""
    bound = 0
    for module in model.modules():
        if hasattr(module, "kv_a_proj_with_mqa") and hasattr(module, "kv_b_proj"):
            module.forward = MLAAttention(module, kernels)
            bound += 1
    return bound


class MLAAttention:
    """The forward of one transformers DeepSeek attention module: with minicore's metadata over
    the paged latent cache, else (a plain forward, ``generate``) transformers' own."""

    def __init__(self, module: torch.nn.Module, kernels: ctypes.CDLL | None):
        self.module, self.kernels = module, kernels
        self.original = type(module).forward.__get__(module)
        self.rotary = _rotary(module)
        self.heads = module.num_heads
        self.nope, self.rope = module.qk_nope_head_dim, module.qk_rope_head_dim
        self.rank, self.v_dim = module.kv_lora_rank, module.v_head_dim
        # The kernel takes [out, in] row-major: W_UV is, W_UK's transpose is copied here, once
        # per binding (the runner binds again when the weights change: sleep, updates).
        w_uk, _ = self._up_projections()
        self.w_uk_rows = None if kernels is None else w_uk.transpose(1, 2).contiguous()

    def __call__(self, hidden_states: torch.Tensor, position_embeddings=None,
                 attention_mask: torch.Tensor | None = None, **kwargs):
        meta: AttentionMetadata | None = kwargs.get(META_KWARG)
        if meta is None:
            return self.original(hidden_states, position_embeddings=position_embeddings,
                                 attention_mask=attention_mask, **kwargs)
        m, x = self.module, hidden_states[0]
        q = m.q_proj(x) if m.q_lora_rank is None else m.q_b_proj(m.q_a_layernorm(m.q_a_proj(x)))
        q_nope, q_pe = q.view(len(x), self.heads, -1).split([self.nope, self.rope], dim=-1)
        kv_c, k_pe = m.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        q_pe, k_pe = self.rotary(q_pe.transpose(0, 1)[None], k_pe[None, None],
                                 position_embeddings)
        q_pe = q_pe[0].transpose(0, 1)
        latent = torch.cat([m.kv_a_layernorm(kv_c), k_pe[0, 0]], dim=-1)[:, None]  # [T, 1, D]
        kv_cache = meta.kv_caches[m.layer_idx]
        write_kv_cache(kv_cache, latent, latent, meta.slot_mapping)
        meta.decode_attention.update_kv(m.layer_idx, latent, latent, kv_cache, meta)

        def decode(rows: torch.Tensor | None) -> torch.Tensor:
            if rows is None:
                return self._forward_decode(q_nope, q_pe, kv_cache, meta)
            return self._forward_decode(q_nope[rows], q_pe[rows], kv_cache, meta)

        def prefill(seq: int, start: int, end: int) -> torch.Tensor:
            rows = slice(start, end)
            return self._forward_prefill(q_nope[rows], q_pe[rows], latent[rows], kv_cache,
                                         meta, seq)

        out = attend_by_kind(meta, decode, prefill)  # [T, heads, v_head_dim]
        return m.o_proj(out.reshape(1, len(x), -1)), None

    def _forward_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_cache: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """Absorbed: ``[n, heads, nope]`` and ``[n, heads, rope]`` queries over the latent rows;
        ``[n, heads, v_head_dim]`` back."""
        w_uk, w_uv = self._up_projections()
        q = torch.cat([self._per_head(q_nope, w_uk, self.w_uk_rows), q_pe], dim=-1)
        out = batched_decode_attention(q, kv_cache, self.module.layer_idx, meta,
                                       self.module.scaling, None, None)
        return self._per_head(out[..., :self.rank], w_uv.transpose(1, 2), w_uv)

    def _forward_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor,
                         kv_cache: torch.Tensor, meta: AttentionMetadata,
                         seq: int) -> torch.Tensor:
        """One sequence's new tokens over all its latents, expanded to per-head keys and
        values as transformers' ``expand_kv`` does."""
        rows = sequence_kv(latent, latent, kv_cache, meta, seq)[0][0, 0]  # [L, D]
        kv_c, k_pe = rows.split([self.rank, self.rope], dim=-1)
        kv = self.module.kv_b_proj(kv_c).view(len(rows), self.heads, -1)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k = torch.cat([k_nope, k_pe[:, None].expand(-1, self.heads, -1)], dim=-1)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k, v = (t.transpose(0, 1)[None] for t in (k, v))  # [1, heads, L, dim]
        return prefill_attention(q, k, v, self.module.scaling, None, None)

    def _up_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK`` ``[heads, nope, rank]`` and ``W_UV`` ``[heads, v_head_dim, rank]``: views of
        ``kv_b_proj``'s weight, read each step (sleep and weight updates replace it)."""
        weight = self.module.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
        return weight[:, :self.nope], weight[:, self.nope:]

    def _per_head(self, x: torch.Tensor, weight: torch.Tensor,
                  rows: torch.Tensor | None) -> torch.Tensor:
        """Each head's rows of ``x`` (``[n, heads, in]``) times its matrix (``weight``
        ``[heads, in, out]``; ``rows``: the same as ``[heads, out, in]``, each head's
        contiguous). By the kernel, one call a head (each output's sum in one order whatever the
        rows), else one batched matmul."""
        if self.kernels is None:
            return torch.bmm(x.transpose(0, 1), weight).transpose(0, 1)
        return torch.stack([linear(self.kernels, x[:, h].contiguous(), rows[h], None, x.dtype)
                            for h in range(self.heads)], dim=1)


def _rotary(module: torch.nn.Module):
    """The module's family's rotary embedding as ``f(q, k, position_embeddings)``: DeepSeek-V2's
    complex frequencies, V3's cos/sin, interleaved when the config says so."""
    names = vars(sys.modules[type(module).__module__])
    if "apply_rotary_emb" in names:
        return names["apply_rotary_emb"]
    interleave = getattr(module.config, "rope_interleave", False)
    apply = names["apply_rotary_pos_emb_interleave" if interleave else "apply_rotary_pos_emb"]
    return lambda q, k, position_embeddings: apply(q, k, *position_embeddings)
