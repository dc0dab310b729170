"""Linear layers of float32 and bfloat16 CPU models at decode batch sizes: the native kernel for the
fewest rows, else (float32) ``(W @ x^T)^T``.

vLLM's CPU backend routes its linear layers through its own GEMM dispatch
(``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``, oneDNN on pre-packed
weights). On torch's MKL build, eager ``F.linear`` with few rows (a decode step: one row per
sequence) spreads poorly over the threads, and the same product with the operands swapped, one sgemm
over the weight's long side, is faster. Up to 32 rows, native.py's kernel (``csrc/linear.c``), which
reads each weight once without MKL's per-call packing, is faster still (docs/BENCHMARKS.md has the
figures). A single row stays on ``F.linear`` (MKL's matrix-vector product, as fast, both bound by
reading the weights). Past 32 rows it loses on most shapes (its copy of x no longer stays in cache),
except on a layer much wider than deep, the LM head, where it wins up to 128 rows. Its sums run in
another order than MKL's, so its outputs are a few ulps from ``F.linear``'s (the greedy parity tests
hold). From 12 to 128 rows without it, and from 33 to 128 with it, the swapped product is used:
there its results equal ``F.linear``'s bit for bit (below 12 rows MKL's small-batch kernels round
``F.linear`` differently); past ~128 rows (prefill) it loses. The swapped product comes out
transposed: the MLP's gate/up projections hand it on as a view (their product feeds down_proj, which
then gets its ``x^T`` contiguous for free); every other output is copied back to row-major, which
attention, the residual adds and the sampler want (leaving all of them strided measured slower).
MKL-packed weights (``torch.ops.mkl._mkl_linear``, inductor's freezing path) measured no faster than
either. A bfloat16 layer takes the kernel (it widens the weight as it reads it, sums in float32, and
the result is rounded to bfloat16 as ``F.linear``'s is) for the same rows on a CPU with native
bfloat16, from one row on a CPU with AVX512-BF16 (the kernel then takes its dot products:
``csrc/linear_bf16.c``; an LM head up to 8 rows), and up to 256 rows on one without, where oneDNN's
bfloat16 product is emulated and 3 to 5 times slower than the kernel at any row count up to 256
(docs/BENCHMARKS.md); ``F.linear`` takes the others. With ``every_row`` (batch invariance) the
kernel takes every row count: its sum for an output element runs over the input features in one
order whatever the rows beside it, where MKL and oneDNN choose kernels (and orders) by the row
count. Inside a mixture-of-experts block, the router and the experts call ``F.linear`` on their own
weights, with as many rows as tokens were routed: with ``every_row`` the experts run transformers'
eager implementation and those calls take the kernel too (KernelLinear, a torch function mode around
each block). Left out: float16 and quantized weights.
"""

import ctypes
import sys

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from minicore.model.expert_parallel import is_moe_block
from minicore.model.loader import native_bf16_flags
from minicore.model.native import KERNEL_DTYPES, linear

# Rows (tokens) for which the swapped product is used, and for which the native kernel is; see
# the module docstring.
MIN_ROWS, MAX_ROWS, MIN_KERNEL_ROWS, MAX_KERNEL_ROWS = 12, 128, 2, 32
# Layers this many times wider than deep (an LM head) take the kernel up to MAX_ROWS.
WIDE = 8
# Rows up to which a bfloat16 layer takes the kernel where bfloat16 is emulated.
EMULATED_BF16_KERNEL_ROWS = 256
# Element-wise ops with a transcendental inside (Qwen2-MoE's shared-expert gate is a sigmoid
# over one column per token), and a multiple of every vector width torch uses.
PADDED_OPS = {torch.sigmoid, torch.Tensor.sigmoid, F.sigmoid, F.silu}
VECTOR_PAD = 64
# Rows up to which an LM head takes the AVX512-BF16 kernel (csrc/linear_bf16.c), which takes
# every layer from one row to MAX_KERNEL_ROWS: there it beats oneDNN's bfloat16 products.
BF16_DOT_WIDE_ROWS = 8


def use_cpu_linear(model: torch.nn.Module, kernels: ctypes.CDLL | None = None,
                   every_row: bool = False) -> int:
    """Swap the forward of each float32 or bfloat16 ``nn.Linear`` of a CPU model (the tied LM
    head included), with ``kernels`` (native.py) for the fewest rows, or for all with
    ``every_row``; returns how many were swapped."""
    swapped = 0
    for name, module in model.named_modules():
        if (type(module) is torch.nn.Linear and module.weight.dtype in KERNEL_DTYPES
                and module.weight.device.type == "cpu"):
            module.forward = _SwappedLinear(module.weight, module.bias,
                                            name.endswith(("gate_proj", "up_proj")), kernels,
                                            every_row)
            swapped += 1
        elif every_row and kernels is not None and is_moe_block(module):
            module.forward = _in_mode(type(module).forward.__get__(module), KernelLinear(kernels))
    if every_row and getattr(model, "_can_set_experts_implementation", lambda: False)():
        # transformers' eager experts: one F.linear per expert (its grouped_mm is a matmul of its
        # own, by row count).
        model.set_experts_implementation("eager")
    return swapped


class KernelLinear(TorchFunctionMode):
    """While active, ``F.linear`` on a contiguous float32 or bfloat16 CPU weight of the input's
    dtype runs the native kernel, at any row count; and a sigmoid or SiLU runs over its input
    padded to a multiple of VECTOR_PAD elements, so that no element falls in the scalar remainder
    of torch's vectorised loop (whose exp rounds otherwise), wherever the batch puts it."""

    def __init__(self, kernels: ctypes.CDLL):
        super().__init__()
        self.kernels = kernels

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, *rest = args
            bias = rest[0] if rest else kwargs.get("bias")
            if (weight.dtype in KERNEL_DTYPES and x.dtype == weight.dtype
                    and weight.device.type == "cpu" and weight.is_contiguous()):
                out = linear(self.kernels, x.reshape(-1, x.shape[-1]), weight, bias, x.dtype)
                return out.view(*x.shape[:-1], out.shape[1])
        if func in PADDED_OPS and not kwargs.get("inplace") and len(args) == 1:
            flat = args[0].reshape(-1)
            padded = func(F.pad(flat, (0, -flat.numel() % VECTOR_PAD)))
            return padded[:flat.numel()].view(args[0].shape)
        return func(*args, **kwargs)


def _in_mode(forward, mode: TorchFunctionMode):
    def run(*args, **kwargs):
        with mode:
            return forward(*args, **kwargs)
    return run


class _SwappedLinear:
    """A module's forward: ``x @ weight.T + bias``, by the native kernel or as
    ``(weight @ x^T)^T`` at decode sizes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool,
                 kernels: ctypes.CDLL | None, every_row: bool):
        self.weight, self.bias, self.transposed = weight, bias, transposed
        # The kernel reads the weight's storage as row-major, and a float32 bias.
        self.kernels = kernels if weight.is_contiguous() else None
        self.kernel_bias = None if bias is None else bias.float()
        out_features, in_features = weight.shape
        wide = out_features >= WIDE * in_features
        fewest, most = MIN_KERNEL_ROWS, MAX_ROWS if wide else MAX_KERNEL_ROWS
        if weight.dtype == torch.bfloat16 and getattr(kernels, "bf16_dot", False):
            fewest, most = 1, BF16_DOT_WIDE_ROWS if wide else MAX_KERNEL_ROWS
        elif weight.dtype == torch.bfloat16 and not native_bf16_flags():
            most = EMULATED_BF16_KERNEL_ROWS
        self.kernel_rows = range(1, sys.maxsize) if every_row else range(fewest, most + 1)
        # The swapped product is measured faster in float32 only.
        self.swapped_rows = range(MIN_ROWS, MAX_ROWS + 1) if weight.dtype == torch.float32 else ()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if x.dtype != self.weight.dtype or torch.is_grad_enabled():
            return F.linear(x, self.weight, self.bias)
        if self.kernels is not None and rows.shape[0] in self.kernel_rows:
            out = linear(self.kernels, rows, self.weight, self.kernel_bias, x.dtype)
            return out.view(*x.shape[:-1], out.shape[1])
        if rows.shape[0] not in self.swapped_rows:
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            out = torch.mm(self.weight, rows.t())
        else:
            out = torch.addmm(self.bias[:, None], self.weight, rows.t())
        out = out.t() if self.transposed else out.t().contiguous()
        return out.view(*x.shape[:-1], out.shape[1])
