"""The hooks that wait for their own module (`activate.onimport`), on modules made here,
and a hook that cannot install after its module loaded: a WARNING naming what is
unguarded, an entry of the activation record, and `report DIR` exiting 3. The import
orders of sglang's engine: tests/test_import_order.py."""

from __future__ import annotations

import builtins
import importlib
import json
import logging
import sys
import types
from importlib.machinery import ModuleSpec

import pytest

from sglang_oobguard.activate import onimport
from sglang_oobguard.report import summary

OUTER = """
import {inner}
if not getattr(__import__("builtins"), "oobguard_test_outer_ok", True):
    raise RuntimeError("this import fails")
LATE = "defined after its import of {inner}"
"""
INNER = """
import sys
from sglang_oobguard.activate import onimport
onimport.when_loaded({outer!r}, sys.modules["oobguard_test_seen"].append)  # {outer} is still initializing here
"""


@pytest.fixture
def modules(tmp_path, monkeypatch, request):
    """A module `outer` whose first statement imports `inner`, which asks for outer's hook:
    the order in which 0.5.4's allocator imports memory_pool. Returns (outer's name, seen)."""
    outer, inner = f"oobguard_outer_{request.node.name[5:20]}", f"oobguard_inner_{request.node.name[5:20]}"
    (tmp_path / f"{outer}.py").write_text(OUTER.format(inner=inner))
    (tmp_path / f"{inner}.py").write_text(INNER.format(outer=outer))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list = []
    monkeypatch.setitem(sys.modules, "oobguard_test_seen", seen)
    yield outer, seen
    for name in (outer, inner):
        sys.modules.pop(name, None)


def test_a_hook_asked_for_while_its_module_initializes_runs_when_the_import_ends(modules):
    outer, seen = modules
    module = importlib.import_module(outer)
    assert seen == [module] and seen[0].LATE  # the whole module, once
    assert type(module.__spec__) is ModuleSpec and not onimport.initializing(module)


def test_an_import_that_fails_leaves_the_hook_for_the_next_import(modules, monkeypatch):
    outer, seen = modules
    monkeypatch.setattr(builtins, "oobguard_test_outer_ok", False, raising=False)
    with pytest.raises(RuntimeError, match="this import fails"):
        importlib.import_module(outer)
    assert seen == [] and outer not in sys.modules
    monkeypatch.setattr(builtins, "oobguard_test_outer_ok", True)
    module = importlib.import_module(outer)  # inner is imported already: only the first hook waits
    assert seen == [module] and module.LATE


def test_a_complete_module_runs_its_hook_at_once_and_a_watch_again_on_each_call(modules):
    outer, seen = modules
    module = importlib.import_module(outer)
    got: list = []
    onimport.when_loaded(outer, got.append)
    assert got == [module]
    name = f"{outer}_watched"
    watched = sys.modules[name] = types.ModuleType(name)
    try:
        onimport.watch(name, got.append)
        onimport.watch(name, got.append)  # a guard installed again
    finally:
        del sys.modules[name]
    assert got == [module, watched, watched]


class Failing:
    def append(self, module: types.ModuleType) -> None:
        raise RuntimeError("a hook's own bug")


def test_a_hook_that_raises_at_the_end_of_an_import_never_fails_that_import(modules, monkeypatch, caplog):
    outer, _ = modules
    monkeypatch.setitem(sys.modules, "oobguard_test_seen", Failing())
    with caplog.at_level(logging.ERROR, logger="sglang_oobguard"):
        assert importlib.import_module(outer).LATE
    assert f"internal error in a hook of {outer}: RuntimeError: a hook's own bug" in caplog.text


def test_a_hook_that_cannot_install_after_its_module_loaded_is_named_recorded_and_fails_the_report(
        mp, tmp_path, monkeypatch, caplog):
    import sglang_oobguard
    from sglang_oobguard.activate import instrument, modulehooks
    from sglang_oobguard.model.targets import ALLOCATOR_MODULE, STEP_HOOK

    importlib.import_module(ALLOCATOR_MODULE)  # complete: its hook runs inside install, before the file opens
    monkeypatch.setattr(modulehooks, "allocator_targets", lambda: "no allocator here (a test's)")
    monkeypatch.setenv("SGLANG_OOBGUARD_LIVENESS", "1")
    monkeypatch.setenv("SGLANG_OOBGUARD_REPORT_DIR", str(tmp_path))
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        sglang_oobguard.install("warn")
        runner = types.ModuleType(STEP_HOOK.module)  # its module loaded without ModelRunner: after the file opened
        instrument._active.hooks.patch_module(runner)
    warned = [r.getMessage() for r in caplog.records if "NOT GUARDED" in r.getMessage()]
    assert len(warned) == 2 and "liveness (the tracked allocators) did not install after " \
        f"{ALLOCATOR_MODULE} loaded (no allocator here (a test's)); checks that do not run here: liveness, " \
        "history, owners, reads, swa, pd" in warned[0], warned
    assert f"{STEP_HOOK.module}.ModelRunner.forward not found" in warned[1]

    (path,) = tmp_path.iterdir()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [entry["hook"] for entry in lines[0]["unguarded"]] == ["liveness (the tracked allocators)"]
    assert [(line["kind"], line["checks"]) for line in lines[1:] if line["kind"] == "unguarded"] == \
        [("unguarded", ["bounds", "map", "owners", "reads", "ownids"])]
    found = summary.read(str(tmp_path))
    assert found.exit_code == summary.NOT_INSTALLED == 3 and len(found.processes[0].unguarded) == 2
    text = summary.render(found)
    assert "not installed: liveness (the tracked allocators) after" in text and text.endswith(
        "FAIL: a check that was asked for did not install (see `not installed`)")


def test_a_hook_no_check_depends_on_is_named_but_does_not_fail_the_report(mp, tmp_path, monkeypatch):
    import sglang_oobguard
    from sglang_oobguard.activate import instrument
    from sglang_oobguard.model.targets import IDLE_HOOK

    monkeypatch.setenv("SGLANG_OOBGUARD_REPORT_DIR", str(tmp_path))
    sglang_oobguard.install("warn")
    instrument._active.hooks.patch_module(types.ModuleType(IDLE_HOOK.module))  # no Scheduler: counts at exit only
    found = summary.read(str(tmp_path))
    assert [e["checks"] for e in found.processes[0].unguarded] == [[]] and found.exit_code == summary.OK
    assert "no check depends on it" in summary.render(found)
