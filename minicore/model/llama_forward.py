"""A Llama model's forward as plain calls, without transformers' per-module dispatch (CPU).

transformers runs each decoder layer of a step through some fifteen module calls, decorators and
keyword-argument plumbing; at decode's few rows on CPU that Python costs more than the layer's
norms and residual adds (the single-stream profile in docs/BENCHMARKS.md, issue 41). vLLM's CPU
backend runs its own model code (``LlamaModel``, ``LlamaDecoderLayer``, ``LlamaAttention`` and
``LlamaMLP`` in ``vllm/model_executor/models/llama.py``); this is minicore's, over the loaded
transformers modules: their weights and their forwards (with the kernels cpu_linear.py and
cpu_layers.py bound to them), called in transformers' order on transformers' shapes, so that every
value is the one transformers' forward computes, bit for bit (tests/model/test_llama_forward.py).
Chosen once, at construction, for a model whose model, layer, attention and MLP code is Llama's
own (compared by bytecode, as cpu_layers.py does: Llama and its copies such as SmolLM2) and has no
hooks; every other model runs transformers' forward. Left out: the families whose layers differ
(Qwen2's sliding window, Gemma's norms, mixtures of experts), CUDA.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers.models.llama import modeling_llama

from minicore.model.attention import paged_attention_forward
from minicore.model.cpu_layers import llama_rotary, rotary_pos_emb, same_code, unwrapped


@dataclass(slots=True)
class _Layer:
    """One decoder layer's modules, looked up once; their forwards are read at each call (sleep
    mode and weight loading bind new ones)."""
    input_norm: torch.nn.Module
    attn: torch.nn.Module
    q: torch.nn.Module
    k: torch.nn.Module
    v: torch.nn.Module
    o: torch.nn.Module
    post_norm: torch.nn.Module
    gate: torch.nn.Module
    up: torch.nn.Module
    down: torch.nn.Module
    act: torch.nn.Module

    @classmethod
    def of(cls, layer) -> _Layer:
        attn, mlp = layer.self_attn, layer.mlp
        return cls(layer.input_layernorm, attn, attn.q_proj, attn.k_proj, attn.v_proj,
                   attn.o_proj, layer.post_attention_layernorm, mlp.gate_proj, mlp.up_proj,
                   mlp.down_proj, mlp.act_fn)

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary,
                meta) -> torch.Tensor:
        """LlamaDecoderLayer.forward with LlamaAttention's and LlamaMLP's inlined."""
        x = self.input_norm.forward(hidden)
        shape = (*hidden.shape[:-1], -1, self.attn.head_dim)
        q = self.q.forward(x).view(shape).transpose(1, 2)
        k = self.k.forward(x).view(shape).transpose(1, 2)
        v = self.v.forward(x).view(shape).transpose(1, 2)
        q, k = rotary(q, k, cos, sin)
        out, _ = paged_attention_forward(self.attn, q, k, v, None, self.attn.scaling,
                                         minicore_meta=meta)
        hidden = hidden + self.o.forward(out.reshape(*hidden.shape[:-1], -1).contiguous())
        x = self.post_norm.forward(hidden)
        x = self.down.forward(self.act.forward(self.gate.forward(x)) * self.up.forward(x))
        return hidden + x


def llama_forward(base_model: torch.nn.Module, kernels: ctypes.CDLL | None
                  ) -> Callable[..., torch.Tensor] | None:
    """forward(input_ids [1, T], position_ids [1, T], meta) -> hidden states [T, hidden] of
    base_model, or None where its code is not Llama's or a module has hooks."""
    if not _runs_llama_code(base_model):
        return None
    layers = tuple(map(_Layer.of, base_model.layers))
    original = modeling_llama.apply_rotary_pos_emb
    rotary = original if kernels is None else functools.partial(rotary_pos_emb, kernels, original)
    return functools.partial(_forward, base_model, layers, rotary)


def _forward(model, layers: tuple[_Layer, ...], rotary, input_ids: torch.Tensor,
             position_ids: torch.Tensor, meta) -> torch.Tensor:
    hidden = model.embed_tokens.forward(input_ids)
    cos, sin = model.rotary_emb.forward(hidden, position_ids)
    for layer in layers:
        hidden = layer.forward(hidden, cos, sin, rotary, meta)
    return model.norm.forward(hidden)[0]


def _runs_llama_code(base_model: torch.nn.Module) -> bool:
    """Whether the model, its layers, attentions (their rotary embedding included) and MLPs run
    transformers' Llama code, every layer counted, with no hooks anywhere."""
    if not _same_forward(base_model, modeling_llama.LlamaModel):
        return False
    layers = getattr(base_model, "layers", ())
    if len(layers) != base_model.config.num_hidden_layers:
        return False
    for layer in layers:
        if not (_same_forward(layer, modeling_llama.LlamaDecoderLayer)
                and _same_forward(layer.self_attn, modeling_llama.LlamaAttention)
                and llama_rotary(unwrapped(type(layer.self_attn).forward))
                and _same_forward(layer.mlp, modeling_llama.LlamaMLP)):
            return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in base_model.modules())


def _same_forward(module: torch.nn.Module, cls: type) -> bool:
    return same_code(unwrapped(type(module).forward), unwrapped(cls.forward))
