"""The core stays small, read from the files: the DP engine core's reading path (its files and line
counts, as docs/ARCHITECTURE.md lists them) stays within its budget; the scheduler's import
closure, computed from the code, holds no feature package and stays within its own; and none of
the five core files tests a feature outside the core in a step: optional features bind once, at
construction, as components with do-nothing defaults."""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
READING_PATH_BUDGET = 2500
CORE_FILES = ("minicore/scheduler/scheduler.py", "minicore/engine/core.py",
              "minicore/engine/core_proc.py", "minicore/dp/engine.py", "minicore/model/runner.py")
# Names that belong to features outside the core: the P/D connector, logprobs, the CPU kernels,
# expert parallelism, the simulator, and the features still to come.
FEATURE_NAME = re.compile(r"connector|remote_kv|kv_transfer|logprob|simulat|lockstep|native|"
                          r"decode_kv|cpu|expert|ep_group|spec_|draft|structured|grammar|bitmask",
                          re.IGNORECASE)
# What minicore.scheduler.scheduler may import, counted from the code (issue 40's target: 1,800
# lines). Still in it: StructuredOutputsParams, a field of SamplingParams (vLLM keeps it in
# vllm/sampling_params.py), and SpecDecodingStats, a field of SchedulerStats on the wire.
SCHEDULER_CLOSURE_BUDGET = 2300
SCHEDULER_CLOSURE_FEATURES = {"minicore.structured_output", "minicore.structured_output.params",
                              "minicore.spec_decode", "minicore.spec_decode.metrics"}
FEATURE_PACKAGES = ("minicore.config", "minicore.arg_utils", "minicore.engine", "minicore.dp",
                    "minicore.model", "minicore.kv_transfer", "minicore.spec_decode",
                    "minicore.structured_output", "minicore.entrypoints")
# Where a component is chosen: run once, when the engine is built or torn down.
CONSTRUCTION = re.compile(r"__init__|_init_\w*|_?make_\w*|_load_model|shutdown|close")


def reading_path() -> dict[str, int]:
    """{path: documented line count} from the reading-path table of docs/ARCHITECTURE.md."""
    text = ARCHITECTURE.read_text()
    section = text.split("## Reading path", 1)[1].split("\n## ", 1)[0]
    return {path: int(lines) for path, lines in
            re.findall(r"^\| `(minicore/[\w/]+\.py)` \| (\d+) \|", section, re.MULTILINE)}


def module_path(root: Path, module: str) -> Path | None:
    base = root.joinpath(*module.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.exists()), None)


def module_imports(root: Path, source: str) -> list[str]:
    """The modules a module's own body imports as it loads: not under TYPE_CHECKING, not inside
    functions; `from package import name` counts name when it is a module."""
    found, body = [], list(ast.parse(source).body)
    while body:
        node = body.pop(0)
        if isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            body += node.body + node.orelse
        elif isinstance(node, ast.Try):
            body += node.body + [n for handler in node.handlers for n in handler.body]
        elif isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.append(node.module)
            found += [f"{node.module}.{alias.name}" for alias in node.names
                      if module_path(root, f"{node.module}.{alias.name}")]
    return found


def import_closure(module: str, root: Path = ROOT) -> dict[str, int]:
    """{module: lines} of every module of root's packages that importing module loads (its
    packages' __init__ files included)."""
    closure, todo = {}, [module]
    while todo:
        name = todo.pop()
        if name in closure or (path := module_path(root, name)) is None:
            continue
        source = path.read_text()
        closure[name] = len(source.splitlines())
        parts = name.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]
        todo += module_imports(root, source)
    return closure


def feature_conditionals(source: str) -> list[str]:
    """'function: test' for each conditional outside construction whose test names a feature."""
    found = []
    for func in ast.walk(ast.parse(source)):
        if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if CONSTRUCTION.fullmatch(func.name):
            continue
        for node in ast.walk(func):
            tests = ([node.test] if isinstance(node, ast.If | ast.While | ast.IfExp)
                     else node.ifs if isinstance(node, ast.comprehension) else [])
            for test in tests:
                names = [n.id if isinstance(n, ast.Name) else n.attr for n in ast.walk(test)
                         if isinstance(n, ast.Name | ast.Attribute)]
                if any(FEATURE_NAME.search(name) for name in names):
                    found.append(f"{func.name}: {ast.unparse(test)}")
    return found


def test_the_reading_path_is_documented_with_its_true_line_counts():
    documented = reading_path()
    assert len(documented) >= 10, "the reading-path table of docs/ARCHITECTURE.md was not found"
    actual = {path: len((ROOT / path).read_text().splitlines()) for path in documented}
    assert documented == actual, "update the reading-path table in docs/ARCHITECTURE.md"


def test_the_reading_path_of_the_dp_engine_core_fits_its_budget():
    documented = reading_path()
    # The runner is the model side's: read after the engine core, not part of its budget.
    assert set(CORE_FILES) - {"minicore/model/runner.py"} <= set(documented)
    assert sum(documented.values()) <= READING_PATH_BUDGET


def test_the_scheduler_imports_no_feature_and_fits_its_budget():
    closure = import_closure("minicore.scheduler.scheduler")
    features = {m for m in closure if m.startswith(FEATURE_PACKAGES)}
    assert features == SCHEDULER_CLOSURE_FEATURES, sorted(features)
    assert sum(closure.values()) <= SCHEDULER_CLOSURE_BUDGET, sorted(closure.items())


def test_the_closure_follows_what_a_module_loads(tmp_path):
    # guard against a vacuous measure
    files = {"p/__init__.py": "from p import b\n",
             "p/a.py": ("import p.c\nfrom typing import TYPE_CHECKING\n"
                        "if TYPE_CHECKING:\n    import p.d\n"
                        "try:\n    from p import e\nexcept ImportError:\n    pass\n"
                        "def f():\n    import p.d\n"),
             "p/b.py": "x = 1\ny = 2\n", "p/c.py": "", "p/d.py": "",
             "p/e.py": "from p.c import x\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert import_closure("p.a", tmp_path) == {"p.a": 10, "p": 1, "p.b": 2, "p.c": 0, "p.e": 1}


@pytest.mark.parametrize("path", CORE_FILES)
def test_no_core_file_tests_a_feature_outside_the_core_in_a_step(path):
    assert feature_conditionals((ROOT / path).read_text()) == []


def test_the_counter_sees_a_feature_test_in_a_step_and_not_at_construction():
    # guard against a vacuous check
    source = ("class E:\n"
              "    def __init__(self, c):\n        if c.connector: pass\n"
              "    def step(self, out):\n"
              "        if out.logprobs is not None: pass\n"
              "        ids = [r for r in out.reqs if r.remote_kv]\n"
              "        return 1 if self.budget else 0\n")
    assert feature_conditionals(source) == ["step: out.logprobs is not None",
                                            "step: r.remote_kv"]
