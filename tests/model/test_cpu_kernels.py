"""The CPU runner's process and layer settings: linear layers as (W @ x^T)^T or by the native
kernel (minicore/model/cpu_linear.py) and glibc keeping freed blocks
(minicore/model/cpu_memory.py)."""

import platform
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from test_native import native_kernel

from minicore.model import cpu_linear, native
from minicore.model.cpu_linear import (
    EMULATED_BF16_KERNEL_ROWS,
    MAX_KERNEL_ROWS,
    MAX_ROWS,
    MIN_KERNEL_ROWS,
    MIN_ROWS,
    WIDE,
    use_cpu_linear,
)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(96, 160), torch.nn.Linear(96, 160, bias=False)
    mlp.down_proj = torch.nn.Linear(160, 96)
    mlp.head = torch.nn.Linear(96, 1000, bias=False)
    mlp.bf16_proj = torch.nn.Linear(96, 8).to(torch.bfloat16)
    return mlp


def _same(a: torch.Tensor, b: torch.Tensor) -> None:
    # Bit-identical with the MKL of torch's x86 CPU wheel as measured (AVX2 EPYC); a tolerance of
    # a few ulps keeps the check meaningful (a wrong layout is off by O(1)) on other CPUs' kernels.
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_swapped_linear_equals_f_linear():
    model = _model()
    weights = {name: (m.weight, m.bias) for name, m in model.named_children()}
    assert use_cpu_linear(model) == 5
    with torch.inference_mode():
        for rows in [1, 3, MIN_ROWS, 16, 64, MAX_ROWS, MAX_ROWS + 1, 300]:
            x = torch.randn(1, rows, 96)
            for name in ("gate_proj", "up_proj", "head"):
                out = getattr(model, name)(x)
                assert out.shape == (1, rows, weights[name][0].shape[0])
                _same(out, F.linear(x, *weights[name]))
            hidden = F.silu(model.gate_proj(x)) * model.up_proj(x)
            down = model.down_proj(hidden)
            _same(down, F.linear(hidden.contiguous(), *weights["down_proj"]))
            # gate/up stay transposed views in the swapped range (their product feeds down_proj
            # as a contiguous x^T); every other layer's output is contiguous.
            swapped = MIN_ROWS <= rows <= MAX_ROWS
            assert model.gate_proj(x).is_contiguous() is not swapped
            assert model.head(x).is_contiguous() and down.is_contiguous()


def test_native_kernel_takes_the_fewest_rows():
    """With the kernels, MIN_KERNEL_ROWS to MAX_KERNEL_ROWS rows go to native.linear (row-major,
    within a few ulps of F.linear), up to MAX_ROWS for a layer WIDE times wider than deep (the
    head); other rows take F.linear or the swapped product as without them."""
    kernels = native_kernel()
    model = _model()
    weights = {name: (m.weight, m.bias) for name, m in model.named_children()}
    use_cpu_linear(model, kernels)
    head, gate = model.head.weight.shape, model.gate_proj.weight.shape
    assert head[0] >= WIDE * head[1] and gate[0] < WIDE * gate[1]
    with torch.inference_mode():
        for rows in [1, MIN_KERNEL_ROWS, 5, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, 64, MAX_ROWS + 1]:
            x = torch.randn(1, rows, 96)
            for name in ("gate_proj", "down_proj", "head"):
                w, b = weights[name]
                x_in = x if name != "down_proj" else torch.randn(1, rows, 160)
                out = getattr(model, name)(x_in)
                assert out.shape == (1, rows, w.shape[0])
                if MIN_KERNEL_ROWS <= rows <= (MAX_ROWS if name == "head" else MAX_KERNEL_ROWS):
                    assert out.is_contiguous()
                    assert torch.equal(out[0], native.linear(kernels, x_in[0], w, b))
                    torch.testing.assert_close(out, F.linear(x_in, w, b), rtol=1e-5, atol=1e-5)
                else:
                    _same(out, F.linear(x_in, w, b))


@pytest.mark.parametrize("native_bf16", [True, False], ids=["native", "emulated"])
def test_a_bfloat16_layer_takes_the_kernel_for_the_fewest_rows_and_f_linear_otherwise(
        monkeypatch, native_bf16):
    """The kernel's float32 sums over the widened weight, rounded to bfloat16 once: within one
    bfloat16 rounding of F.linear (oneDNN's bfloat16 product), for as many rows as float32's on a
    CPU with native bfloat16 and up to EMULATED_BF16_KERNEL_ROWS on one without; every other row
    count is F.linear's own result, bit for bit (no swapped product in bfloat16)."""
    flags = ["amx_bf16"] if native_bf16 else []
    monkeypatch.setattr(cpu_linear, "native_bf16_flags", lambda: flags)
    kernels = native_kernel()
    model = _model()
    weight, bias = model.bf16_proj.weight, model.bf16_proj.bias
    use_cpu_linear(model, kernels)
    most = MAX_KERNEL_ROWS if native_bf16 else EMULATED_BF16_KERNEL_ROWS
    with torch.inference_mode():
        for rows in [1, MIN_KERNEL_ROWS, 7, MAX_KERNEL_ROWS, MAX_KERNEL_ROWS + 1, most, most + 1]:
            x = torch.randn(rows, 96).to(torch.bfloat16)
            out = model.bf16_proj(x)
            assert out.dtype == torch.bfloat16 and out.shape == (rows, 8)
            if MIN_KERNEL_ROWS <= rows <= most:
                assert torch.equal(out, native.linear(kernels, x, weight, bias).to(torch.bfloat16))
                torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=2e-2, atol=2e-2)
            else:
                assert torch.equal(out, F.linear(x, weight, bias))


def test_native_kernel_skips_a_non_contiguous_weight():
    layer = torch.nn.Linear(96, 64, bias=False)
    layer.weight = torch.nn.Parameter(torch.randn(96, 64).t())  # column-major storage
    use_cpu_linear(layer, native_kernel())
    x = torch.randn(4, 96)
    with torch.inference_mode():
        _same(layer(x), F.linear(x, layer.weight))
    with pytest.raises(ValueError, match="contiguous"):
        native.linear(native_kernel(), x, layer.weight, None)


def test_swapped_linear_leaves_autograd_to_f_linear():
    model = _model()
    use_cpu_linear(model)
    x = torch.randn(16, 96, requires_grad=True)
    model.gate_proj(x).sum().backward()
    assert x.grad is not None and model.gate_proj.weight.grad is not None


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
@pytest.mark.parametrize("keep", [False, True])
def test_freed_blocks_stay_in_the_heap(keep):
    """A freed 256 MiB activation goes back to the kernel with glibc's defaults (resident memory
    drops) and stays in the heap once keep_freed_memory() ran (resident memory stays)."""
    script = textwrap.dedent(f"""
        import torch
        from minicore.model.cpu_memory import keep_freed_memory
        def rss():
            with open("/proc/self/statm") as f:
                return int(f.read().split()[1]) * 4096
        if {keep}:
            assert keep_freed_memory()
        x = torch.ones(64 * 2**20)
        before_free = rss()
        del x
        print((before_free - rss()) / 2**20)
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True)
    returned_mib = float(out.stdout.split()[-1])
    if keep:
        assert returned_mib < 16
    else:
        assert returned_mib > 200
