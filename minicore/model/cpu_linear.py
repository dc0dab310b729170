"""Linear layers of float32 CPU models at decode batch sizes, computed as ``(W @ x^T)^T``.

vLLM's CPU backend routes its linear layers through its own GEMM dispatch
(``vllm/model_executor/layers/utils.py`` ``dispatch_cpu_unquantized_gemm``, oneDNN on
pre-packed weights). On torch's MKL build, eager ``F.linear`` with few rows (a decode step:
one row per sequence) spreads poorly over the threads: the LM head of SmolLM2-135M takes 20 ms
for 16 rows on two AVX2 cores, and the same product with the operands swapped, one sgemm over
the weight's long side, 13 ms (27 vs 33 ms at 64 rows; 10-35% on the layers' own shapes). Past
~128 rows (prefill) the swapped product loses, so it is used for 12..128 rows only: below 12,
MKL's small-batch kernels round ``F.linear`` differently, and inside the range the two results are
equal bit for bit (so greedy outputs match transformers' exactly). The product comes out
transposed: the MLP's gate/up projections hand it on as a view (their product feeds down_proj,
which then gets its ``x^T`` contiguous for free); every other output is copied back to row-major,
which attention, the residual adds and the sampler want (leaving all of them strided measured
slower). MKL-packed weights
(``torch.ops.mkl._mkl_linear``, inductor's freezing path) measured no faster than either.
Left out: bfloat16 (oneDNN) and quantized weights.
"""

import torch
import torch.nn.functional as F

# Rows (tokens) for which the swapped product is used; see the module docstring.
MIN_ROWS, MAX_ROWS = 12, 128


def use_cpu_linear(model: torch.nn.Module) -> int:
    """Swap the forward of each float32 ``nn.Linear`` of a CPU model (the tied LM head
    included); returns how many were swapped."""
    swapped = 0
    for name, module in model.named_modules():
        if (type(module) is torch.nn.Linear and module.weight.dtype == torch.float32
                and module.weight.device.type == "cpu"):
            module.forward = _SwappedLinear(module.weight, module.bias,
                                            name.endswith(("gate_proj", "up_proj")))
            swapped += 1
    return swapped


class _SwappedLinear:
    """A module's forward: ``x @ weight.T + bias``, as ``(weight @ x^T)^T`` at decode sizes."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool):
        self.weight, self.bias, self.transposed = weight, bias, transposed

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if (not MIN_ROWS <= rows.shape[0] <= MAX_ROWS or x.dtype != torch.float32
                or torch.is_grad_enabled()):
            return F.linear(x, self.weight, self.bias)
        if self.bias is None:
            out = torch.mm(self.weight, rows.t())
        else:
            out = torch.addmm(self.bias[:, None], self.weight, rows.t())
        out = out.t() if self.transposed else out.t().contiguous()
        return out.view(*x.shape[:-1], out.shape[1])
