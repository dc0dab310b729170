"""minicore's C kernels on CPU, built on first use: decode attention, linears, norm, rotary.

vLLM's CPU backend ships compiled kernels (csrc/cpu, behind ``vllm/v1/attention/backends/
cpu_attn.py`` and ``vllm/model_executor/layers/utils.py``). torch has no decode attention that
reads per-request rows at memory speed (its batched matmuls over decode's few query rows per KV
head stream keys at about half the machine's memory bandwidth), MKL repacks a whole weight on
every product, which at decode's few rows costs as much as the product, and transformers' norms
and rotary embedding are many small torch ops. ``csrc/`` holds ``decode_attention.c`` (scores over
the keys and the weighted sum of the values, the softmax between them staying in torch),
``linear.c`` and ``linear_bf16.c``, ``rms_norm.c`` and ``rotary.c`` (minicore/model/
cpu_layers.py). They are compiled with the machine's C compiler (``$CC``, else ``cc``; ``-O3
-march=native -fopenmp``) into ``$MINICORE_CACHE/kernels`` under a name keyed by sources, flags
and CPU, once per machine (a few seconds), and loaded with ctypes. Their OpenMP runtime is the one
torch already loaded (same soname), so their threads are torch's. Without a compiler, or if the
build fails, all stay in torch, with a warning. They read float32 or bfloat16 storage (the KV
pools, the weights) and compute in float32: a bfloat16 is widened by a shift as it is read, so
they run on every CPU and read half the bytes of float32 (decode is bound by those reads). On a
CPU with AVX512-BF16 a linear layer of bfloat16 weights and inputs takes its dot products instead
(``csrc/linear_bf16.c``, VDPBF16PS). Each sums an output in one order whatever the batch (batch
invariance, docs/ARCHITECTURE.md). Left out: AMX tiles, bfloat16 dot products in decode attention
(it widens), float16.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from minicore.model.loader import cpu_flags, default_cache_dir

logger = logging.getLogger(__name__)

SOURCES = sorted((Path(__file__).parent / "csrc").glob("*.c"))
HEADERS = sorted((Path(__file__).parent / "csrc").glob("*.h"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC")

_P, _I, _I64, _F = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


@functools.cache
def native_kernels() -> ctypes.CDLL | None:
    """The compiled kernels (built now if this machine has none yet), or None where they cannot
    be built."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        logger.warning("no C compiler: CPU decode attention and small linears run on torch "
                       "(slower)")
        return None
    path = default_cache_dir() / "kernels" / f"minicore-{_build_key(compiler)}.so"
    try:
        if not path.is_file():
            _build(compiler, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, subprocess.CalledProcessError) as e:
        logger.warning("building minicore's kernels failed, they run on torch: %s",
                       getattr(e, "stderr", None) or e)
        return None
    # The last argument of each: 1 when the pools or the weight are bfloat16, 0 for float32.
    lib.decode_attention.argtypes = [_P, _P, _P, _P, _P, *[_I] * 7, _F, _F, _I64, _P, _I, _I]
    lib.decode_attention.restype = _I
    lib.linear_rows.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I]
    lib.linear_rows_bf16.argtypes = [_P, _P, _P, _P, _I, _I, _I, _I, _I]
    lib.linear_rows.restype = lib.linear_rows_bf16.restype = _I
    lib.rms_norm.argtypes = [_P, _P, _P, _I, _I, _F, _I, _I]
    lib.rotary.argtypes = [_P, _I64, _I64, _P, _P, _P, _I64, _I64, _I, _I, _I, _I, _I]
    lib.rms_norm.restype = lib.rotary.restype = None
    # Whether bfloat16 products run on the CPU's own instructions (AVX512-BF16), asked once.
    lib.bf16_dot = lib.linear_rows_bf16(None, None, None, None, 0, 0, 0, 1, 0) == 0
    return lib


def _build_key(compiler: str) -> str:
    """Source, flags, compiler and CPU: a cache folder shared between machines must not hand
    one an -march=native build of another."""
    parts = [*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(FLAGS).encode(),
             compiler.encode(), " ".join(sorted(cpu_flags())).encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _build(compiler: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Built under a temporary name and renamed: DP ranks may build at the same moment.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        start = time.perf_counter()
        subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, SOURCES), "-lm"], check=True,
                       capture_output=True, text=True)
        os.replace(tmp, path)
        logger.info("built minicore's CPU kernels in %.1f s: %s", time.perf_counter() - start,
                    path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_batch_invariant(model_config, device: torch.device,
                            kernels: ctypes.CDLL | None) -> bool:
    """model_config.batch_invariant, its default resolved (on for CPU where the kernels built,
    off on CUDA) and set; ValueError where it was asked for and cannot hold: off the CPU, or
    without the kernels (their sums run in one order whatever the batch; torch's and MKL's do
    not)."""
    if model_config.batch_invariant is None:
        model_config.batch_invariant = device.type == "cpu" and kernels is not None
    elif model_config.batch_invariant:
        check_batch_invariant(device, kernels)
    return model_config.batch_invariant


def check_batch_invariant(device: torch.device, kernels: ctypes.CDLL | None) -> None:
    if device.type != "cpu":
        raise ValueError("--batch-invariant runs on CPU only: minicore has no batch-invariant "
                         f"{device.type} kernels (vLLM's are Triton ones, for compute capability "
                         "8.0+); drop the flag or VLLM_BATCH_INVARIANT")
    if kernels is None:
        raise ValueError("--batch-invariant needs minicore's CPU kernels, which could not be built "
                         "here (a C compiler, $CC or cc, with OpenMP; the warning above says "
                         "why)")


# The storage types the kernels read, by the flag they take.
KERNEL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def decode_attention(lib: ctypes.CDLL, q: torch.Tensor, pointers: torch.Tensor,
                     slots: torch.Tensor, seq_lens: torch.Tensor, chunk_size: int, max_len: int,
                     scaling: float, window: int | None, softcap: float | None,
                     kv_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Attention of ``q`` (``[B, kv_heads, group, dim]``) for B decoding sequences of lengths
    ``seq_lens`` (``[B]`` int64), whose positions ``[c * chunk_size, ...)`` lie in slot
    ``slots[b, c]`` of the pools whose addresses are ``pointers`` (``[2, chunks]``: keys, values;
    each pool ``[slots, kv_heads, chunk_size, dim]`` of ``kv_dtype``). Computed in float32,
    returned in ``q``'s dtype."""
    # What the kernel reads as float32 / int64 arrays (no copies in the runner's float32 use).
    qf = q.float().contiguous()
    slots, seq_lens = (t.to(torch.int64).contiguous() for t in (slots, seq_lens))
    batch, heads, group, dim = q.shape
    threads, bf16 = torch.get_num_threads(), KERNEL_DTYPES[kv_dtype]
    out = torch.empty_like(qf)
    if lib.decode_attention(qf.data_ptr(), pointers[0].data_ptr(), pointers[1].data_ptr(),
                            slots.data_ptr(), seq_lens.data_ptr(), batch, heads, group, dim,
                            chunk_size, slots.shape[1], max_len, scaling, softcap or 0.0,
                            window or 0, out.data_ptr(), threads, bf16):
        raise MemoryError("decode_attention: out of memory")
    return out.to(q.dtype)


def linear(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``x @ weight.T + bias`` for ``x`` ``[rows, in]``, ``weight`` contiguous, float32 or
    bfloat16, summed in float32 and returned in ``out_dtype`` (rounded to nearest even; float32
    keeps an LM head's logits unrounded). bfloat16 ``x`` and weight, on a CPU with AVX512-BF16,
    take its dot products (``csrc/linear_bf16.c``), which round as they store."""
    if not weight.is_contiguous():
        raise ValueError("linear: the weight must be contiguous (row-major)")
    bias = None if bias is None else bias.float().contiguous()
    bias_ptr = None if bias is None else bias.data_ptr()
    threads = torch.get_num_threads()
    if lib.bf16_dot and weight.dtype == x.dtype == torch.bfloat16:
        x = x.contiguous()
        out = x.new_empty(x.shape[0], weight.shape[0], dtype=out_dtype)
        lib.linear_rows_bf16(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(),
                             *out.shape, x.shape[1], threads, out_dtype == torch.bfloat16)
        return out
    x = x.float().contiguous()
    out = x.new_empty(x.shape[0], weight.shape[0])
    status = lib.linear_rows(x.data_ptr(), weight.data_ptr(), bias_ptr, out.data_ptr(),
                             *out.shape, x.shape[1], threads, KERNEL_DTYPES[weight.dtype])
    if status:
        raise MemoryError("linear_rows: out of memory")
    return out.to(out_dtype)


def rms_norm(lib: ctypes.CDLL, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm of ``x`` (``[..., dim]``) with ``weight`` (``[dim]``), both contiguous and of
    one of KERNEL_DTYPES (``csrc/rms_norm.c``)."""
    out = torch.empty_like(x)
    lib.rms_norm(x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.numel() // x.shape[-1],
                 x.shape[-1], eps, torch.get_num_threads(), KERNEL_DTYPES[x.dtype])
    return out


def rotary(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor,
           sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin`` for ``x`` ``[1, heads, tokens, dim]``
    (its last stride 1), ``cos`` and ``sin`` ``[1, tokens, dim]`` contiguous, all of one of
    KERNEL_DTYPES: the same bits (``csrc/rotary.c``)."""
    out = torch.empty_like(x)
    _, heads, tokens, dim = x.shape
    lib.rotary(x.data_ptr(), x.stride(1), x.stride(2), cos.data_ptr(), sin.data_ptr(),
               out.data_ptr(), out.stride(1), out.stride(2), heads, tokens, dim,
               torch.get_num_threads(), KERNEL_DTYPES[x.dtype])
    return out
