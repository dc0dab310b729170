#!/usr/bin/env bash
# minicore checked on a machine with one NVIDIA GPU and no network, in one command of under 8
# minutes: the CUDA-marked tests, greedy parity with transformers in float32 and bfloat16, W1 and
# batch-1 decode speed, async scheduling on and off, sleep levels 1 and 2, as a table (and JSON in
# benchmarks/results/cuda_check.json); benchmarks/cuda_check.py says what each part measures.
# It runs on the machine's python3 ($PYTHON to choose another), which must have torch (its CUDA
# build), transformers and uvloop; the other packages come as wheels in .whl/ (the check lists the
# missing ones and the pip download command that fetches them), installed here without network.
# Not scripts/setup.sh: that makes a virtualenv from the network. Exit status 1 if a part failed.
#
#   scripts/cuda_check.sh [--cpu-smoke] [--json PATH] [--budget-s 450]
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
SITE=/tmp/site
if compgen -G ".whl/*.whl" >/dev/null; then
    # --upgrade: replace what an earlier run put there, rather than stop at it.
    "$PY" -m pip install --quiet --disable-pip-version-check --no-index --no-deps --upgrade \
        --target "$SITE" .whl/*.whl
    export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
# minicore from this checkout, which is not installed there.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec "$PY" benchmarks/cuda_check.py "$@"
