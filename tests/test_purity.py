"""The scheduler core is pure Python: importing it (in a fresh interpreter) loads no torch, zmq or
transformers, and its sources import none of them anywhere, not even lazily inside a function (which
the import probe cannot see)."""

import ast
import subprocess
import sys
from pathlib import Path

# The DP simulator steps the schedulers without torch too: `python -m minicore simulate` should
# start in a moment.
MODULES = ["minicore.scheduler", "minicore.request", "minicore.sampling_params",
           "minicore.config", "minicore.outputs", "minicore.testing", "minicore.dp.simulator",
           "minicore.dp.sim_report", "minicore.dp.sim_trace"]
FORBIDDEN = ["torch", "zmq", "transformers"]
PACKAGE = Path(__file__).resolve().parents[1] / "minicore"
SOURCES = sorted((PACKAGE / "scheduler").rglob("*.py")) + [
    PACKAGE / name for name in ("request.py", "sampling_params.py", "config.py", "outputs.py",
                                "testing.py", "dp/simulator.py", "dp/sim_report.py",
                                "dp/sim_trace.py", "tracing/step_trace.py")]


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


def _forbidden_imports(source: str, forbidden=FORBIDDEN) -> list[tuple[int, str]]:
    """(line, module) of every import of a forbidden top-level package, at any depth."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:  # relative ones stay inside
            names = [node.module]
        else:
            continue
        found += [(node.lineno, n) for n in names if n.split(".")[0] in forbidden]
    return sorted(found)


def test_scheduler_core_imports_no_heavy_modules():
    assert _probe(MODULES, FORBIDDEN) == "[]"


def test_the_probe_detects_a_loaded_module():
    # guard against a vacuous check: the same probe does see a module that is loaded
    assert _probe(MODULES, FORBIDDEN + ["json"], pre="import json") == "['json']"


def test_scheduler_core_sources_import_no_heavy_modules():
    assert PACKAGE / "scheduler" / "scheduler.py" in SOURCES  # the glob found the package
    found = {path.relative_to(PACKAGE.parent).as_posix(): hits for path in SOURCES
             if (hits := _forbidden_imports(path.read_text()))}
    assert found == {}


def test_the_source_check_sees_lazy_imports():
    # guard: imports inside a function body, which the probe above never executes
    source = ("import os\n"
              "def gather():\n"
              "    import torch.distributed as dist\n"
              "    from zmq.asyncio import Context\n"
              "    from transformers import AutoConfig\n"
              "    from . import torch\n")
    assert _forbidden_imports(source) == [(3, "torch.distributed"), (4, "zmq.asyncio"),
                                          (5, "transformers")]
