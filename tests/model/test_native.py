"""The native decode attention kernel (minicore/model/native.py): how it is built and found, and
its output against dense attention over randomly laid out pools (several chunks, slots in any
order, lengths ending anywhere, GQA groups, head sizes that are not a multiple of 8, sliding
window, soft-cap), and its linear layer against F.linear; each over float32 and bfloat16 storage
(bfloat16 widened exactly, so the references are float32 over the same values)."""

import logging
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

from minicore.model import native
from minicore.model.native import decode_attention, native_kernels


def native_kernel():
    """The kernels, built on this machine; skips where there is no C compiler, or no OpenMP with
    it as Linux's gcc has (Apple's clang has none: the build fails, torch runs)."""
    if shutil.which(os.environ.get("CC", "cc")) is None or sys.platform != "linux":
        pytest.skip("no C compiler with OpenMP on this machine")
    lib = native_kernels()
    assert lib is not None, "a C compiler is here but the kernel did not build"
    return lib


@pytest.fixture(params=["dot products", "widened"])
def bf16_path(request, monkeypatch):
    """The kernels, with bfloat16 products by AVX512-BF16 (csrc/linear_bf16.c; skipped where the
    CPU has none) or widened to float32 (csrc/linear.c)."""
    lib = native_kernel()
    if request.param == "dot products" and not lib.bf16_dot:
        pytest.skip("no AVX512-BF16 on this CPU")
    monkeypatch.setattr(lib, "bf16_dot", request.param == "dot products")
    return lib


@pytest.fixture
def fresh_build(tmp_path, monkeypatch):
    """native_kernels() as in a new process, with an empty cache folder."""
    monkeypatch.setenv("MINICORE_CACHE", str(tmp_path))
    native_kernels.cache_clear()
    yield tmp_path / "kernels"
    native_kernels.cache_clear()


def test_built_once_into_the_cache_folder(fresh_build):
    native_kernel()
    built = list(fresh_build.iterdir())
    assert [p.suffix for p in built] == [".so"]  # no temporary file left behind
    stamp = built[0].stat().st_mtime_ns
    native_kernels.cache_clear()
    assert native_kernels() is not None
    assert [p.stat().st_mtime_ns for p in fresh_build.iterdir()] == [stamp]  # not rebuilt


def test_no_compiler_or_failed_build_falls_back_with_a_warning(fresh_build, monkeypatch, caplog):
    monkeypatch.setenv("CC", "no-such-compiler")
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native_kernels() is None
    assert "no C compiler" in caplog.text
    native_kernels.cache_clear()
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=native.__name__):
        assert native_kernels() is None
    assert "failed" in caplog.text
    assert not any(fresh_build.iterdir())


def test_shares_torchs_openmp_runtime():
    native_kernel()
    maps = Path("/proc/self/maps").read_text().splitlines()
    gomp = {line.split()[-1] for line in maps if "libgomp" in line}
    assert len(gomp) == 1, gomp


def _dense(q, k, v, scaling, window, softcap):
    """One sequence: q [kv_heads, group, dim] over k, v [L, kv_heads, dim]."""
    scores = torch.einsum("hgd,lhd->hgl", q, k) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if window is not None:
        scores[..., :max(0, k.shape[0] - window)] = float("-inf")
    return torch.einsum("hgl,lhd->hgd", scores.softmax(-1), v)


DTYPES = [torch.float32, torch.bfloat16]
# The kernel's float32 result against the float32 reference, after rounding to the query's dtype.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group,dim,window,softcap", [
    (3, 64, None, None), (1, 12, None, None), (4, 8, 7, None), (2, 20, None, 0.7), (3, 8, 5, 2.0)])
def test_matches_dense_attention_over_scattered_pools(group, dim, window, softcap, dtype):
    lib = native_kernel()
    gen = torch.Generator().manual_seed(group * dim)
    heads, chunk, capacity, layers = 2, 16, 9, 2
    lens = [1, 5, 16, 17, 40, 33, 48]
    chunks = -(-max(lens) // chunk)
    pools = [[(torch.randn(2, capacity, heads, chunk, dim, generator=gen) * 2).to(dtype)
              for _ in range(chunks)] for _ in range(layers)]
    # Each sequence's slot in each chunk: distinct per chunk, in no particular order.
    slots = torch.stack([torch.randperm(capacity, generator=gen)[:len(lens)]
                         for _ in range(chunks)], dim=1)
    q = torch.randn(len(lens), heads, group, dim, generator=gen).to(dtype)
    scaling = dim**-0.5
    for layer in range(layers):
        pointers = torch.tensor([[p.data_ptr() + i * p.stride(0) * p.element_size()
                                  for p in pools[layer]] for i in (0, 1)])
        out = decode_attention(lib, q, pointers, slots, torch.tensor(lens), chunk, max(lens),
                               scaling, window, softcap, dtype)
        assert out.dtype == dtype
        for b, length in enumerate(lens):
            k, v = (torch.cat([pools[layer][c][i, slots[b, c]].transpose(0, 1)
                               for c in range(chunks)])[:length].float() for i in (0, 1))
            expected = _dense(q[b].float(), k, v, scaling, window, softcap).to(dtype)
            torch.testing.assert_close(out[b], expected, atol=TOLERANCE[dtype],
                                       rtol=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,out_features,in_features,bias", [
    (1, 7, 5, True), (3, 64, 100, False), (8, 13, 576, True), (16, 1536, 576, False),
    (17, 576, 1536, True), (32, 33, 64, False), (130, 70, 96, True), (261, 9, 33, False)])
def test_linear_matches_f_linear(rows, out_features, in_features, bias, dtype, bf16_path):
    """Any row count (full and partial blocks of 8 and 16, past a slab of 128), output sizes that
    are not a multiple of 4, input sizes that are not a multiple of 8 or 32; a bfloat16 weight
    summed in float32, widened or by the CPU's dot products."""
    lib = bf16_path
    gen = torch.Generator().manual_seed(rows * out_features)
    x = torch.randn(rows, in_features, generator=gen).to(dtype)
    w = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(dtype)
    b = torch.randn(out_features, generator=gen).to(dtype) if bias else None
    out = native.linear(lib, x, w, b)
    assert out.shape == (rows, out_features) and out.is_contiguous()
    assert out.dtype == torch.float32
    # float32 sums of a few hundred terms in another order than MKL's: a few ulps apart.
    expected = torch.nn.functional.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows,out_features", [(1, 7), (5, 64), (130, 13)])
def test_linear_rounds_to_bfloat16_as_torch_does(rows, out_features, bf16_path):
    """A bfloat16 result, rounded as the kernel stores it, is its float32 result rounded by
    torch (to nearest, ties to even), whichever path computes it."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(out_features, 96, generator=gen).bfloat16()
    b = torch.randn(out_features, generator=gen)
    out = native.linear(bf16_path, x, w, b, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, out_features)
    assert torch.equal(out, native.linear(bf16_path, x, w, b).bfloat16())
    # Exact ties, the last kept bit odd and even: a zero weight leaves the bias as the sum.
    ties = (torch.arange(0x3f80, 0x3f80 + out_features, dtype=torch.int32) << 16 | 0x8000)
    ties = ties.view(torch.float32)
    out = native.linear(bf16_path, x, torch.zeros_like(w), ties, torch.bfloat16)
    assert torch.equal(out, ties.bfloat16().expand(rows, -1))


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_linear_rows_result_is_the_same_whatever_the_rows_beside_it(dtype, bf16_path):
    """Batch invariance at the kernel: each row's output, bit for bit, alone, among 7, 100 and
    300 rows, and at another position."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(300, 200, generator=gen).to(dtype)
    w = torch.randn(50, 200, generator=gen).to(dtype)
    alone = torch.cat([native.linear(bf16_path, x[i:i + 1], w, None) for i in range(7)])
    for rows in (7, 100, 300):
        assert torch.equal(native.linear(bf16_path, x[:rows], w, None)[:7], alone)
    assert torch.equal(native.linear(bf16_path, x[:7].flip(0), w, None), alone.flip(0))
