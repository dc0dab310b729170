"""What machine a figure was measured on, printed and saved with every benchmark's figures:
timings compare only within one run on one machine (docs/BENCHMARKS.md)."""

from pathlib import Path

# The CPU flags that decide minicore's kernels and dtype (minicore/model/loader.py).
FLAGS_OF_INTEREST = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_description() -> str:
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines()
                  if line.startswith("model name")), "unknown CPU")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines()
                  if line.startswith("flags")), [])
    shown = " ".join(f for f in FLAGS_OF_INTEREST if f in flags) or "none of interest"
    return f"{model}; flags: {shown}"
