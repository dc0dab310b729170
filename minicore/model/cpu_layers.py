"""transformers' RMSNorm and rotary embedding on CPU by minicore's kernels, one call each.

transformers runs a Llama-family layer's two RMSNorms as seven torch ops each and its rotary
embedding as twelve; at decode's one row those ops cost more than their arithmetic (the profile
in docs/BENCHMARKS.md). vLLM's CPU backend has fused ops for both (``RMSNorm.forward_cpu`` in
``vllm/model_executor/layers/layernorm.py``, ``RotaryEmbedding.forward_cpu`` in
``vllm/model_executor/layers/rotary_embedding``). Only a module whose code is Llama's own takes
them (Qwen2, Mistral, Mixtral and Qwen2-MoE copy it), on float32 or bfloat16 CPU tensors without
autograd; anything else runs transformers' code. The norm takes the same steps and roundings as
transformers' with its own fixed order of the squares' sum (batch invariance); the rotary
embedding gives transformers' bits. Left out: the residual add fused into the norm (vLLM's
``fused_add_rms_norm``: transformers adds it in the decoder layer), Gemma's (1 + weight) norm,
partial rotary.
"""

from __future__ import annotations

import ctypes
import functools
import types

import torch
from transformers.models.llama import modeling_llama

from minicore.model.native import KERNEL_DTYPES, rms_norm, rotary


def use_cpu_layers(model: torch.nn.Module, kernels: ctypes.CDLL | None) -> int:
    """Bind each RMSNorm and each attention's rotary embedding of ``model`` that runs Llama's code
    to the kernels (none without them); returns how many modules were bound."""
    bound = 0
    if kernels is None:
        return bound
    for module in model.modules():
        forward = type(module).forward
        if "forward" in vars(module):
            continue  # minicore's already (DeepSeek's attention: mla.py)
        if same_code(forward, modeling_llama.LlamaRMSNorm.forward):
            module.forward = functools.partial(_norm, kernels, module, forward.__get__(module))
            bound += 1
        elif llama_rotary(unwrapped(forward)):
            original = unwrapped(forward).__globals__["apply_rotary_pos_emb"]
            fast = functools.partial(rotary_pos_emb, kernels, original)
            module.forward = _with_global(forward, "apply_rotary_pos_emb", fast).__get__(module)
            bound += 1
    return bound


def llama_rotary(forward) -> bool:
    """Whether forward calls a rotary embedding that is Llama's (rotate_half included)."""
    names = forward.__globals__
    return ("apply_rotary_pos_emb" in forward.__code__.co_names
            and same_code(names.get("apply_rotary_pos_emb"), modeling_llama.apply_rotary_pos_emb)
            and same_code(names.get("rotate_half"), modeling_llama.rotate_half))


def same_code(fn, reference) -> bool:
    code, ref = getattr(fn, "__code__", None), reference.__code__
    return code is not None and (code.co_code, code.co_consts, code.co_names) == (
        ref.co_code, ref.co_consts, ref.co_names)


def _kernel_ready(*tensors: torch.Tensor) -> bool:
    """Whether the kernels take these: CPU tensors of one KERNEL_DTYPES type, no autograd."""
    dtype = tensors[0].dtype
    return (dtype in KERNEL_DTYPES and not torch.is_grad_enabled()
            and all(t.dtype == dtype and t.device.type == "cpu" for t in tensors))


def _norm(kernels, module, original, x: torch.Tensor) -> torch.Tensor:
    weight = module.weight
    if not (_kernel_ready(x, weight) and x.is_contiguous() and weight.is_contiguous()):
        return original(x)
    return rms_norm(kernels, x, weight, module.variance_epsilon)


def rotary_pos_emb(kernels, original, q, k, cos, sin, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb for a packed batch ([1, heads, tokens, dim] queries and
    keys, [1, tokens, dim] cos and sin), else the original."""
    if not (_kernel_ready(q, k, cos, sin) and unsqueeze_dim == 1 and q.dim() == 4
            and q.shape[0] == 1 and cos.shape == sin.shape == (1, q.shape[2], q.shape[3])
            and k.shape[2:] == q.shape[2:] and q.stride(3) == k.stride(3) == 1
            and cos.is_contiguous() and sin.is_contiguous()):
        return original(q, k, cos, sin, unsqueeze_dim)
    return rotary(kernels, q, cos, sin), rotary(kernels, k, cos, sin)


def unwrapped(fn):
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def _with_global(fn, name: str, value):
    """A copy of fn (through the functools.wraps wrappers around it, such as transformers'
    deprecate_kwarg) whose innermost function sees global ``name`` as ``value``; the module's
    own global is left as it is."""
    inner = getattr(fn, "__wrapped__", None)
    globals_ = fn.__globals__ if inner is not None else {**fn.__globals__, name: value}
    closure = fn.__closure__
    if inner is not None:
        new_inner = _with_global(inner, name, value)
        closure = tuple(types.CellType(new_inner) if cell.cell_contents is inner else cell
                        for cell in closure or ())
    copy = types.FunctionType(fn.__code__, globals_, fn.__name__, fn.__defaults__, closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__dict__.update(fn.__dict__)
    if inner is not None:
        copy.__wrapped__ = new_inner
    return copy
