"""--dtype auto: bfloat16 on CUDA and on CPUs with native bfloat16 (AMX or AVX512-BF16 in the
CPU's flags), float32 elsewhere, logged once with the reason; an explicit --dtype wins."""

import logging
import os

import pytest
import torch

from minicore.model import loader
from minicore.model.loader import NATIVE_BF16_FLAGS, cpu_flags, load_model, resolve_auto_dtype

choose = resolve_auto_dtype.__wrapped__  # uncached, so each case decides afresh


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "fma"}, torch.float32),
    ({"avx2", "avx512f", "avx512bw"}, torch.float32),  # AVX-512 without its bfloat16 part
    ({"avx512f", "avx512_bf16"}, torch.bfloat16),
    ({"avx512f", "amx_tile", "amx_bf16"}, torch.bfloat16),
    (set(), torch.float32),  # no /proc/cpuinfo (macOS)
])
def test_auto_on_cpu_follows_the_native_bfloat16_flags(monkeypatch, caplog, flags, expected):
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags))
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        assert choose("cpu") == expected
    [record] = caplog.records
    reason = str(expected).removeprefix("torch.")
    assert record.getMessage().startswith(f"--dtype auto: {reason}, as this CPU ")
    if expected == torch.bfloat16:
        assert all(flag in record.getMessage() for flag in flags & set(NATIVE_BF16_FLAGS))
        assert "--dtype float32 overrides" in record.getMessage()
    else:
        assert "--dtype bfloat16 overrides" in record.getMessage()


def test_auto_on_cuda_is_bfloat16_whatever_the_cpu(monkeypatch):
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset({"avx2"}))
    assert choose("cuda") == torch.bfloat16


@pytest.mark.skipif(not os.path.exists("/proc/cpuinfo"), reason="no /proc/cpuinfo")
def test_cpu_flags_are_this_machines():
    text = open("/proc/cpuinfo").read()
    line = next(line for line in text.splitlines() if line.startswith("flags"))
    assert cpu_flags() == frozenset(line.split(":", 1)[1].split())
    assert "sse2" in cpu_flags() or "neon" in cpu_flags() or "asimd" in cpu_flags()


@pytest.mark.model
def test_the_default_model_loads_in_the_dtype_auto_chooses_and_an_explicit_one_wins():
    native = any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS)
    model, _ = load_model(device="cpu")
    assert model.dtype == (torch.bfloat16 if native else torch.float32)
    other = torch.float32 if native else torch.bfloat16
    model, _ = load_model(dtype=str(other).removeprefix("torch."), device="cpu")
    assert model.dtype == other
