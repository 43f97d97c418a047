"""The package's shape, checked: layers that import only downward, no import cycle, small rooms,
each named by its job.

Every import of a package module by another counts, including those inside
functions: a cycle hidden by a lazy import is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "sglang_oobguard"
NAME = PACKAGE.name
# The layers, lowest first: each may import its own and those below it, never one above.
LAYERS = ("model", "report", "probes", "checks", "activate")
# The package's root holds its doors only, above every layer: the API, the command line,
# the entry points (sglang's plugin, the .pth hook, pytest's) and the demo.
DOORS = {"__init__", "__main__", "plugin", "autoload", "pytest_plugin", "demo"}


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """'layer.module' (or 'module' at the root) -> its file; a layer's __init__ is 'layer'."""
    found = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)] = path
    return found


def imports() -> dict[str, set[str]]:
    """module -> the package modules it imports (relative or absolute, at any depth,
    inside functions too: a cycle hidden by a lazy import is still a cycle)."""
    known = modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - node.level + 1]
                    target = [*base, *(node.module.split(".") if node.module else [])]
                elif (node.module or "").split(".")[0] == NAME:
                    target = node.module.split(".")[1:]
                else:
                    continue
                for alias in node.names:  # `from .layer import module` names a module
                    full = ".".join([*target, alias.name])
                    found.add(full if full in known else ".".join(target))
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".", 1)[1] for a in node.names if a.name.startswith(NAME + ".")}
        graph[name] = {m for m in found if m in known and m != name}
    return graph


def rank(module: str) -> int:
    top = module.split(".")[0]
    return LAYERS.index(top) if top in LAYERS else len(LAYERS)


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if rank(b) > rank(a))


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state = [], {}

    def visit(module: str, stack: list[str]) -> None:
        state[module] = "open"
        for other in sorted(graph.get(module, ())):
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
    assert graph["activate.instrument"] >= {"checks.guard", "checks.writes", "activate.modulehooks", "checks.registry"}
    assert "checks.stepcheck" in graph["activate.modulehooks"]
    assert "checks.liveness" in graph["checks.swa"]
    assert "probes.device" in graph["checks.writes"]  # `from ..probes import device` is seen
    assert cycles(graph) == []


def test_the_cycle_finder_finds_one():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c", "a"]]


def test_no_layer_imports_a_higher_one():
    assert upward(imports()) == []


def test_the_layer_rule_sees_an_upward_import():
    assert upward({"probes.kernels": {"checks.guard", "model.violation"}, "report.files": {"probes.record"}}) \
        == ["probes.kernels -> checks.guard", "report.files -> probes.record"]


def test_every_module_lives_in_a_layer_or_is_a_door():
    rooms = {name.split(".")[0] for name in modules()}
    assert rooms == set(LAYERS) | DOORS


def test_no_file_is_over_350_lines_and_no_class_over_120():
    sizes = {path.name: len(path.read_text().splitlines()) for path in PACKAGE.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 350} == {}
    classes = {f"{path.stem}.{node.name}": node.end_lineno - node.lineno + 1
               for path in PACKAGE.rglob("*.py") for node in ast.walk(ast.parse(path.read_text()))
               if isinstance(node, ast.ClassDef)}
    assert "Guard" in {name.split(".")[1] for name in classes}
    assert {name: n for name, n in classes.items() if n > 120} == {}


def test_every_module_says_its_job_in_its_first_docstring_line():
    for path in PACKAGE.rglob("*.py"):
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
    for path in sorted(PACKAGE.rglob("*.py")):
        checkPath(str(path), found)
    assert found.messages == []


def units() -> set[str]:
    """The modules of checks/ that are a unit: they define `UNIT` at their top level."""
    return {name for name, path in modules().items() if name.startswith("checks.")
            and any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "UNIT" for t in node.targets)
                    for node in ast.parse(path.read_text()).body)}


def test_the_guard_imports_no_unit():
    """The guard is the registry's holder, not a check's: it imports no unit, nor the registry."""
    found = units()
    assert len(found) >= 11, found
    assert not imports()["checks.guard"] & (found | {"checks.registry"}), imports()["checks.guard"]


def test_every_unit_is_registered_with_a_switch_and_a_doctor_line():
    """Every unit is one line of the registry; every registered unit is named by a switch, in its
    order, and doctor gives it its line (`  name: state - what it catches`)."""
    from sglang_oobguard.activate.doctor import _check_lines
    from sglang_oobguard.checks.registry import UNITS
    from sglang_oobguard.model.config import from_env
    from sglang_oobguard.model.switches import NAMES

    registry = (PACKAGE / "checks" / "registry.py").read_text()
    listed = {f"checks.{node.value.id}" for node in ast.walk(ast.parse(registry))
              if isinstance(node, ast.Attribute) and node.attr == "UNIT" and isinstance(node.value, ast.Name)}
    assert listed == units()
    assert tuple(unit.name for unit in UNITS) == NAMES
    lines = _check_lines(from_env({"SGLANG_ENABLE_ASYNC_ASSERT": "1", "SGLANG_OOBGUARD_CHECKS": "all,-reads"}))
    for unit in UNITS:
        line = next(line for line in lines if line.startswith(f"  {unit.name}: "))
        state = "off (SGLANG_OOBGUARD_CHECKS)" if unit.name == "reads" else line.split(" - ")[0].split(": ", 1)[1]
        assert line.startswith(f"  {unit.name}: {state} - {unit.catches}; cost: {unit.cost}"), line


# -- one of each shared thing -------------------------------------------------------

HOLDER = "checks.owners"  # the one place a slot becomes its holder (request, row, position)
OWNER_READS = {"numpy", "tolist", "take", "cpu", "item", "__getitem__"}  # what reads the owner table's values


def holder_lookups(package: Path = PACKAGE) -> dict[str, set[str]]:
    """Each form a holder look-up takes -> the modules that hold it: a kept step's
    req_to_token (`seen.runner.req_to_token_pool`), the owner table's values read above
    the probes (`<live>.owner[...]`, `.owner.numpy()`, ...: below, the kernels and their
    host twins keep the table as the check itself), and a holder named by its row (an
    f-string "req_to_token row {row}")."""
    found: dict[str, set[str]] = {"step table": set(), "owner table": set(), "row name": set()}
    for name, path in modules(package).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr == "req_to_token_pool" and \
                    isinstance(node.value, ast.Attribute) and node.value.attr == "runner":
                found["step table"].add(name)
            read = node.value if isinstance(node, ast.Subscript) else node.value if isinstance(node, ast.Attribute) \
                and node.attr in OWNER_READS else None
            if isinstance(read, ast.Attribute) and read.attr == "owner" and rank(name) >= LAYERS.index("checks"):
                found["owner table"].add(name)
            if isinstance(node, ast.JoinedStr) and rank(name) >= LAYERS.index("checks") and any(
                    isinstance(part, ast.Constant) and str(part.value).endswith("req_to_token row ")
                    and isinstance(after, ast.FormattedValue) for part, after in zip(node.values, node.values[1:])):
                found["row name"].add(name)
    return found


def test_no_two_modules_hold_the_same_holder_lookup():
    """Every report that names who holds a slot asks `checks.owners`: no copy of the look-up elsewhere."""
    assert holder_lookups() == {"step table": {HOLDER}, "owner table": {HOLDER}, "row name": {HOLDER}}


def test_the_holder_rule_sees_a_copy(tmp_path):
    copy = tmp_path / "pkg" / "checks"
    copy.mkdir(parents=True)
    (copy / "claims.py").write_text(
        "def holder(seen, live, slot, row):\n"
        "    table = seen.runner.req_to_token_pool.req_to_token\n"
        "    return live.owner.numpy()[slot], f'req_to_token row {row}'\n")
    assert holder_lookups(tmp_path / "pkg") == {"step table": {"checks.claims"}, "owner table": {"checks.claims"},
                                                "row name": {"checks.claims"}}


def test_every_record_is_built_by_a_named_constructor():
    """`Record(...)` with its fields in order only where record.py reads a record back (`Record(*values)`)."""
    positional = sorted(
        f"{name}:{node.lineno}" for name, path in modules().items() for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Record"
        and not (name == "probes.record" and [type(arg) for arg in node.args] == [ast.Starred] and not node.keywords))
    assert positional == []
