"""Shared fixtures: the real default model, loaded once per test session (fp32 on CPU), and the
machine kinds the suite plays."""

import os
import sys
from pathlib import Path

import pytest

# server_helpers (a real server, and the zygote that forks it and other commands) serves every
# directory's tests.
sys.path.insert(0, str(Path(__file__).parent / "entrypoints"))

# `make test` runs two test processes at once (pytest -n 2) on machines with as few as two cores:
# each test process, and every server and engine it starts (they inherit this), computes on one
# thread, or their OpenMP threads outnumber the cores and spin-wait on each other (a parity test
# took 75 s so, 28 s on one thread).
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MINICORE_CPU_THREADS", "1")
# The engines a test process starts (AsyncLLM, LLM with DP) are forked, as `serve` forks its own:
# a spawned one imports torch and transformers anew, some 7 s of CPU each, and the suite starts
# about a hundred. Forking a process that has computed is safe here because of the line above: on
# one thread OpenMP starts no pool for the child to hang on. tests/engine/test_start_method.py
# starts an engine each way.
os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")


@pytest.fixture(scope="session")
def hf_model_and_tokenizer():
    from minicore.model.loader import load_model

    return load_model(dtype="float32", device="cpu")


# The three kinds of machine the suite runs on, as their `lscpu` flags show them (abridged), and
# what --dtype auto takes on each.
CPU_KINDS = {
    "avx2": ("fpu sse2 avx avx2 fma f16c", "float32"),
    "avx512_bf16": ("fpu sse2 avx avx2 fma avx512f avx512bw avx512vl avx512_bf16", "bfloat16"),
    "amx": ("fpu sse2 avx avx2 fma avx512f avx512bw avx512_bf16 amx_tile amx_bf16 amx_int8",
            "bfloat16"),
}


@pytest.fixture(params=sorted(CPU_KINDS))
def cpu_kind(request, monkeypatch):
    """Plays each machine kind through the one seam minicore reads the CPU's flags from
    (MINICORE_CPU_FLAGS, which engine processes inherit); yields the dtype auto must choose."""
    from minicore.model import loader

    flags, auto_dtype = CPU_KINDS[request.param]
    monkeypatch.setenv("MINICORE_CPU_FLAGS", flags)
    loader.cpu_flags.cache_clear()
    loader.resolve_auto_dtype.cache_clear()
    yield auto_dtype
    loader.cpu_flags.cache_clear()
    loader.resolve_auto_dtype.cache_clear()


@pytest.fixture
def plugin_file():
    """Writes a module into a minicore package for the test's duration, as a plug-in's author
    would (found as a file of the package); write(package, name, source, registry, key) returns
    its module name. Afterwards the file, the module and its registry entry are gone."""
    written = []

    def write(package, name: str, source: str, registry: dict, key: str) -> str:
        path = Path(package.__file__).parent / f"{name}.py"
        path.write_text(source)
        written.append((path, f"{package.__name__}.{name}", registry, key))
        return f"{package.__name__}.{name}"

    yield write
    for path, module, registry, key in written:
        path.unlink()
        registry.pop(key, None)
        sys.modules.pop(module, None)
