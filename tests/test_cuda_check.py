"""scripts/cuda_check.sh, the check of minicore on one NVIDIA GPU, proved on the CPU: --cpu-smoke
runs every part at tiny sizes with every package hidden but torch, transformers and uvloop (with
what they depend on) and the script's wheels, as on the GPU machine it is written for; without
CUDA every part but packages is skipped; a missing package is listed with the pip download
command; a part that raises, overruns or kills its worker is FAIL and the others still run."""

import importlib.metadata
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import cuda_check  # noqa: E402

LABELS = ["packages", "model", "gpu tests", "parity float32", "parity bfloat16",
          "throughput bfloat16", "throughput float32", "async scheduling", "sleep level 1",
          "sleep level 2"]

# Installed in sitecustomize.py on PYTHONPATH: every python the script starts sees only the
# packages a GPU machine with the wheels would have.
HIDE = """import importlib.machinery
import sys

HIDDEN_MODULES, HIDDEN_DISTS = {modules!r}, {dists!r}


class Hidden(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN_MODULES:
            return None
        return super().find_spec(name, path, target)

    @classmethod
    def find_distributions(cls, *args, **kwargs):
        return (d for d in super().find_distributions(*args, **kwargs)
                if d.metadata["Name"].lower().replace("_", "-") not in HIDDEN_DISTS)


sys.meta_path[sys.meta_path.index(importlib.machinery.PathFinder)] = Hidden
"""


def with_dependencies(names: set[str]) -> set[str]:
    """names and every distribution they require, transitively (extras left out)."""
    seen, todo = set(), [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        for spec in importlib.metadata.requires(name) or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(canonicalize_name(req.name))
    return seen


def hiding_site(tmp_path: Path) -> Path:
    """A directory whose sitecustomize.py hides every other installed distribution."""
    wheels = {Requirement(spec).name for spec in cuda_check.WHEELS.values()}
    kept = with_dependencies(set(cuda_check.MACHINE)) | {canonicalize_name(w) for w in wheels}
    kept.add("minicore")  # from the checkout (PYTHONPATH) there
    hidden = {canonicalize_name(d.metadata["Name"]) for d in importlib.metadata.distributions()}
    hidden -= kept
    modules = {module for module, dists in importlib.metadata.packages_distributions().items()
               if all(canonicalize_name(d) in hidden for d in dists)}
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HIDE.format(modules=modules, dists=hidden))
    return site


@pytest.mark.model
def test_cpu_smoke_runs_every_part_with_only_the_gpu_machines_packages(tmp_path):
    out = tmp_path / "cuda_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(hiding_site(tmp_path))}
    proc = subprocess.run([ROOT / "scripts" / "cuda_check.sh", "--cpu-smoke", "--json", out],
                          env=env, capture_output=True, text=True, timeout=400)
    log = out.with_suffix(".log")
    assert proc.returncode == 0, proc.stdout + proc.stderr + (log.read_text()[-3000:]
                                                              if log.exists() else "")
    rows = {r["part"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == LABELS
    for label in LABELS:
        assert label in proc.stdout
    gpu_tests = rows.pop("gpu tests")
    if torch.cuda.is_available():
        assert gpu_tests["status"] == "ok"
    else:  # pytest ran the CUDA-marked tests, which skipped themselves
        assert (gpu_tests["status"], gpu_tests["why"]) == ("skipped", "no CUDA device")
        assert gpu_tests["figures"]["skipped"] >= 1 and gpu_tests["figures"]["passed"] == 0
    assert {label: r["status"] for label, r in rows.items()} == dict.fromkeys(rows, "ok")
    assert rows["parity float32"]["figures"]["max_gap"] <= cuda_check.TIE_GAP["float32"]
    assert rows["throughput float32"]["figures"]["minicore_w1_tok_s"] > 0
    assert rows["async scheduling"]["figures"]["tokens_equal"]
    assert all(rows[f"sleep level {n}"]["figures"]["tokens_equal"] for n in (1, 2))


def test_without_cuda_every_part_but_packages_is_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "cuda_check.json"
    assert cuda_check.main(["--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["part"] for r in rows] == LABELS and rows[0]["status"] == "ok"
    assert all((r["status"], r["why"]) == ("skipped", "no CUDA device") for r in rows[1:])
    assert "skipped" in capsys.readouterr().out


def test_a_missing_package_is_listed_with_the_command_that_fetches_it(tmp_path, monkeypatch,
                                                                      capsys):
    monkeypatch.setitem(cuda_check.WHEELS, "not_a_module_here", "not-a-package==1.0")
    out = tmp_path / "cuda_check.json"
    assert cuda_check.main(["--json", str(out)]) == 1
    printed = capsys.readouterr().out
    assert "missing from" in printed and "not_a_module_here" in printed
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    command = (f"pip download --no-deps --only-binary=:all: --implementation cp --python-version "
               f"{version} --abi cp{version.replace('.', '')} --platform manylinux_2_28_x86_64 "
               f"-d .whl not-a-package==1.0")
    assert command in printed  # only what is missing: everything else imports here
    rows = json.loads(out.read_text())["rows"]
    assert rows[0]["status"] == "FAIL" and rows[0]["figures"]["pip_download"] == command
    assert all(r["status"] == "skipped" for r in rows[1:])


def test_a_part_that_raises_is_fail_and_the_next_one_runs(tmp_path, monkeypatch):
    def broken(ctx):
        raise RuntimeError("CUDA error: an illegal memory access")

    monkeypatch.setattr(cuda_check, "PARTS", {"sleep": broken,
                                              "model": lambda ctx: [cuda_check.row("model", "ok")]})
    results = tmp_path / "results.jsonl"
    cuda_check.worker(["sleep", "model"], "cpu", "cpu-smoke", results)
    rows = [r for line in results.read_text().splitlines() for r in json.loads(line)["rows"]]
    assert [(r["part"], r["status"]) for r in rows] == [
        ("sleep level 1", "FAIL"), ("sleep level 2", "FAIL"), ("model", "ok")]
    assert rows[0]["why"] == "RuntimeError: CUDA error: an illegal memory access"


def worker_stand_in(results: Path, code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True,
                            env={**os.environ, "RESULTS": str(results)})


def test_a_part_past_the_budget_is_killed_and_fail(tmp_path):
    results = tmp_path / "results.jsonl"
    results.touch()
    proc = worker_stand_in(results, "import time; time.sleep(60)")
    pending = ["async scheduling", "sleep"]
    start = time.monotonic()
    rows = cuda_check.watch(proc, pending, results, deadline=time.monotonic() + 1)
    assert time.monotonic() - start < 10 and proc.returncode is not None
    assert [(r["part"], r["status"], r["why"]) for r in rows] == [
        ("async scheduling", "FAIL", "past the run's budget")]
    assert pending == ["sleep"]  # for the next worker
    assert cuda_check.run_parts(pending, "cpu", "cpu-smoke", time.monotonic(), None) == [
        cuda_check.row(label, "FAIL", "not run: the run's budget was spent")
        for label in ("sleep level 1", "sleep level 2")]


def test_a_worker_that_dies_fails_its_part_and_keeps_the_rows_before(tmp_path):
    results = tmp_path / "results.jsonl"
    results.touch()
    line = json.dumps({"part": "model", "rows": [cuda_check.row("model", "ok")]})
    proc = worker_stand_in(results, "import os; open(os.environ['RESULTS'], 'a').write("
                                    f"{line!r} + '\\n'); os._exit(3)")
    pending = ["model", "gpu tests", "sleep"]
    rows = cuda_check.watch(proc, pending, results, deadline=time.monotonic() + 60)
    assert [(r["part"], r["status"]) for r in rows] == [("model", "ok"), ("gpu tests", "FAIL")]
    assert rows[1]["why"] == "its worker process died (exit 3; see the log)"
    assert pending == ["sleep"]
