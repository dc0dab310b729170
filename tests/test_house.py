"""The house rules of minicore's source, read from the files: each file one idea (at most 400
lines), short functions (at most 60 lines), and no import circle between minicore's modules, lazy
imports inside functions included."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "minicore"
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60


def sources() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text(), str(path))
    return modules


def runtime_nodes(tree: ast.AST):
    """Every node, less the bodies of `if TYPE_CHECKING:` blocks (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and ast.unparse(node.test).endswith("TYPE_CHECKING"):
            continue
        yield node
        yield from runtime_nodes(node)


def imported_modules(tree: ast.Module, known: set[str]) -> set[str]:
    """The minicore modules a module imports at run time, anywhere in it (a `from package import
    name` counts the submodule when name is one)."""
    found = set()
    for node in runtime_nodes(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found & known


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt] if nxt in path else [node, nxt]
            if nxt not in state and (cycle := visit(nxt, path + [nxt])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def test_no_file_is_over_the_limit():
    too_long = {path.name: n for path in PACKAGE.rglob("*.py")
                if (n := len(path.read_text().splitlines())) > MAX_FILE_LINES}
    assert too_long == {}


def test_no_function_is_over_the_limit():
    too_long = [f"{module}.{node.name} ({node.end_lineno - node.lineno + 1} lines)"
                for module, tree in sources().items() for node in ast.walk(tree)
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]
    assert too_long == []


def test_no_import_circle():
    modules = sources()
    known = set(modules)
    graph = {name: imported_modules(tree, known) - {name} for name, tree in modules.items()}
    assert find_cycle(graph) is None, " -> ".join(find_cycle(graph))


@pytest.mark.parametrize("graph, has_cycle", [
    ({"a": {"b"}, "b": {"c"}, "c": set()}, False),
    ({"a": {"b"}, "b": {"c"}, "c": {"a"}}, True),
    ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, False),
])
def test_the_cycle_finder_finds_cycles(graph, has_cycle):
    # guard against a vacuous check
    assert (find_cycle(graph) is not None) == has_cycle


def test_lazy_imports_count_and_type_checking_ones_do_not():
    tree = ast.parse("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import minicore.a\n"
                     "def f():\n    from minicore import b\n")
    assert imported_modules(tree, {"minicore.a", "minicore.b"}) == {"minicore.b"}
