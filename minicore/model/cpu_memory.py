"""Keep freed memory in the process heap, for models running on CPU.

vLLM's CPU platform preloads the tcmalloc it bundles into its workers (``vllm/platforms/cpu.py``,
``LD_PRELOAD``), because glibc's malloc hands every large block back to the kernel when it is
freed: each step's activations then come back as fresh pages, and every page costs a fault and a
zeroing on first touch. A prefill step of 8192 tokens of SmolLM2-135M makes ~50 MB intermediates,
and keeping freed blocks makes it measurably faster (docs/BENCHMARKS.md). minicore gets that from
glibc itself, without a preload: ``mallopt`` raises the mmap and trim thresholds, so blocks of up
to 1 GiB are taken from, and freed back to, the heap. The heap then keeps the largest step's
memory until the process exits, unless release_freed_memory hands it back (sleep mode).
Elsewhere than glibc this does nothing.
"""

import ctypes
import ctypes.util
import platform

# mallopt parameters, from glibc's malloc.h.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_THRESHOLD = 2**30
# glibc before 2.35 refuses mmap thresholds above HEAP_MAX_SIZE / 2 (32 MiB on 64-bit).
_OLD_GLIBC_MAX = 32 * 2**20


def keep_freed_memory() -> bool:
    """Make glibc's malloc serve and keep blocks of up to 1 GiB in the heap (32 MiB on older
    glibc) and never trim it; returns whether it took effect."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    mmap_set = (libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD)
                or libc.mallopt(_M_MMAP_THRESHOLD, _OLD_GLIBC_MAX))
    return bool(mmap_set and libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD))


def release_freed_memory() -> bool:
    """Hand the heap's free memory back to the kernel (glibc's malloc_trim); whether any was."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    return bool(ctypes.CDLL(ctypes.util.find_library("c")).malloc_trim(0))
