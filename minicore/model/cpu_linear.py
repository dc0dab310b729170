"""Linear layers on pre-packed MKL weights, for float32 models on CPU.

vLLM's CPU backend runs its linear layers on weights that oneDNN packed once at load
(``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``; torch.compile's
inductor does the same with freezing). torch's eager ``F.linear`` repacks the weight matrix inside
MKL on every call; ``torch.ops.mkl._mkl_linear`` takes a weight packed once by
``_mkl_reorder_linear_weight`` and computes bit for bit the same result (the same sgemm kernel),
measured 2-13% faster per layer shape of SmolLM2-135M on an AVX2 EPYC, most on the wide
gate/up projections and the LM head, and most at small batches (served decode). The packed copy
is kept next to the original weight (which other code, tied embeddings included, still reads), so
the linear weights take twice their memory. The runner applies it to CPU models;
``MINICORE_PACKED_LINEAR=0`` turns it off (for A/B measurements). Left out: bfloat16 / oneDNN packing (vLLM uses it on
CPUs with AMX or AVX512-BF16) and quantized weights.
"""

import torch
import torch.nn.functional as F

# The batch size MKL packs for; the packed weight serves every batch size with the same results.
_PACK_BATCH = 64


def use_packed_linear(model: torch.nn.Module) -> int:
    """Swap the forward of each float32 ``nn.Linear`` of a CPU model for the packed one; returns
    how many were swapped (0 where MKL is missing or the model is not float32 on CPU)."""
    if not torch._C.has_mkl:
        return 0
    swapped = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if (type(module) is torch.nn.Linear and weight.dtype == torch.float32
                and weight.device.type == "cpu"):
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.detach(), _PACK_BATCH)
            module.forward = _PackedForward(packed, weight, module.bias)
            swapped += 1
    return swapped


class _PackedForward:
    """A module's forward: ``x @ weight.T + bias`` through the packed weight, any leading dims."""

    def __init__(self, packed: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None):
        self.packed, self.weight, self.bias = packed, weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.float32 or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)  # autograd has no packed-linear backward
        rows = x.reshape(-1, x.shape[-1]).contiguous()
        out = torch.ops.mkl._mkl_linear(rows, self.packed, self.weight, self.bias, _PACK_BATCH)
        return out.view(*x.shape[:-1], out.shape[-1])
