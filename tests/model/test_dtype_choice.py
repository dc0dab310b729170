"""--dtype auto: bfloat16 on CUDA and on CPUs with native bfloat16 (AMX or AVX512-BF16 in the
CPU's flags), float32 elsewhere, logged once with the reason; an explicit --dtype wins. The three
machine kinds are played on every machine through MINICORE_CPU_FLAGS (the cpu_kind fixture)."""

import logging
import os
import subprocess
import sys

import pytest
import torch

from minicore.model import loader
from minicore.model.loader import NATIVE_BF16_FLAGS, cpu_flags, load_model, resolve_auto_dtype

choose = resolve_auto_dtype.__wrapped__  # uncached, so each case decides afresh


def test_auto_on_each_machine_kind_follows_its_native_bfloat16_flags(cpu_kind, caplog):
    _assert_auto_chooses(getattr(torch, cpu_kind), set(loader.cpu_flags()), caplog)


@pytest.mark.parametrize("flags, expected", [
    ({"avx2", "avx512f", "avx512bw"}, torch.float32),  # AVX-512 without its bfloat16 part
    (set(), torch.float32),  # no /proc/cpuinfo (macOS)
])
def test_auto_on_cpu_without_bfloat16_flags_is_float32(monkeypatch, caplog, flags, expected):
    monkeypatch.setattr(loader, "cpu_flags", lambda: frozenset(flags))
    _assert_auto_chooses(expected, flags, caplog)


def _assert_auto_chooses(expected, flags, caplog):
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
def test_cpu_flags_are_this_machines(monkeypatch):
    monkeypatch.delenv("MINICORE_CPU_FLAGS", raising=False)
    loader.cpu_flags.cache_clear()
    text = open("/proc/cpuinfo").read()
    line = next(line for line in text.splitlines() if line.startswith("flags"))
    assert cpu_flags() == frozenset(line.split(":", 1)[1].split())
    assert "sse2" in cpu_flags() or "neon" in cpu_flags() or "asimd" in cpu_flags()


@pytest.mark.model
def test_the_default_model_loads_in_the_dtype_auto_chooses_and_an_explicit_one_wins(cpu_kind):
    model, _ = load_model(device="cpu")
    assert model.dtype == getattr(torch, cpu_kind)
    other = "bfloat16" if cpu_kind == "float32" else "float32"
    model, _ = load_model(dtype=other, device="cpu")
    assert model.dtype == getattr(torch, other)


def test_an_engine_process_sees_the_machine_kind_its_parent_plays(cpu_kind):
    """The seam reaches processes started from the test (engines, headless ranks) unchanged."""
    code = "from minicore.model.loader import resolve_auto_dtype as r; print(r('cpu'))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == f"torch.{cpu_kind}"
