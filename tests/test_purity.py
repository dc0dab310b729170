"""The scheduler core is pure Python: importing it (in a fresh interpreter) loads no torch, zmq or
transformers."""

import subprocess
import sys

MODULES = ["minicore.scheduler", "minicore.request", "minicore.sampling_params",
           "minicore.config", "minicore.outputs"]
FORBIDDEN = ["torch", "zmq", "transformers"]


def _probe(modules, forbidden, pre=""):
    """Import ``modules`` in a fresh interpreter; return the forbidden top-level names loaded."""
    code = (
        "import sys\n" + pre + "\n"
        f"for m in {modules!r}:\n"
        "    __import__(m)\n"
        f"assert all(m in sys.modules for m in {modules!r})\n"
        f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({forbidden!r})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


def test_scheduler_core_imports_no_heavy_modules():
    assert _probe(MODULES, FORBIDDEN) == "[]"


def test_the_probe_detects_a_loaded_module():
    # guard against a vacuous check: the same probe does see a module that is loaded
    assert _probe(MODULES, FORBIDDEN + ["json"], pre="import json") == "['json']"
