"""The package's shape, checked: no import cycle, small rooms, each named by its job.

Every import of a package module by another counts, including those inside
functions: a cycle hidden by a lazy import is still a cycle.
"""

from __future__ import annotations

import ast
from helpers import ROOT

PACKAGE = ROOT / "sglang_oobguard"
NAME = PACKAGE.name


def imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (relative or absolute, at any depth)."""
    graph: dict[str, set[str]] = {}
    for path in PACKAGE.glob("*.py"):
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level == 1 or module.startswith(NAME):
                    base = module.removeprefix(NAME).lstrip(".").split(".")[0]
                    found |= {base} if base else {alias.name for alias in node.names}
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[1] for a in node.names if a.name.startswith(NAME + ".")}
        graph[path.stem] = found & {p.stem for p in PACKAGE.glob("*.py")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph[module]):
            if state.get(other) == "open":
                found.append(stack[stack.index(other):] + [other])
            elif other not in state:
                visit(other, stack + [other])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    return found


def test_the_package_has_no_import_cycle():
    graph = imports()
    assert graph["instrument"] >= {"guard", "writes", "stepcheck", "liveness"}  # the walk sees real edges
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_file_is_over_350_lines_and_the_guard_class_is_small():
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.glob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 350} == {}
    tree = ast.parse((PACKAGE / "guard.py").read_text())
    (guard,) = [node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "Guard"]
    assert guard.end_lineno - guard.lineno + 1 < 120


def test_every_module_says_its_job_in_its_first_docstring_line():
    for path in PACKAGE.glob("*.py"):
        doc = ast.get_docstring(ast.parse(path.read_text()))
        assert doc and doc.splitlines()[0].strip(), path.name


def test_pyflakes_finds_no_undefined_or_unused_name():
    """A name used but never imported fails only where its line runs: some run on a GPU alone."""
    from pyflakes.api import checkPath
    from pyflakes.reporter import Reporter

    class Collect(Reporter):
        def __init__(self) -> None:
            self.messages: list[str] = []

        def flake(self, message) -> None:
            self.messages.append(str(message))

        def syntaxError(self, *args) -> None:
            self.messages.append(f"syntax error: {args}")

        def unexpectedError(self, filename, message) -> None:
            self.messages.append(f"{filename}: {message}")

    found = Collect()
    for path in sorted(PACKAGE.glob("*.py")):
        checkPath(str(path), found)
    assert found.messages == []
