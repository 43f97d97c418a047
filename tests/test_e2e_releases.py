"""The engine on the release at hand, with the guard installed as a user installs it (issue
#43): a regular install's `.pth` hook armed in every process (tests/e2e/siteinstall), and
on 0.5.11+ sglang's plugin loader too. Written for every release whose engine runs on the
CPU, not only 0.5.23: the older cells' venvs need the engine's extras
(ci/requirements/sglang-VERSION.txt) to run it.

- A slot freed under its running request (the fault plugin's `value=freed`), whose
  request later frees it again: liveness must report the double free. Before the hooks
  waited for their own modules, 0.5.4's engine imported `allocator` first, liveness was
  never tracked and nothing was reported (the engine died of sglang's own leak check).
- The smoke run: every check on (strict + liveness + finite), 4 prompts: no report, the
  unguarded run's tokens, every check that applies on this release counted work, and no
  hook named unguarded. Where every check applies, the clean matrix runs instead.
"""

from __future__ import annotations

import re

import pytest

from e2e.harness import reference_run, run_engine
from helpers import ROOT, SGLANG, has
from sglang_oobguard.checks.registry import UNITS
from sglang_oobguard.model.targets import write_map_off
from sglang_oobguard.report import summary
from test_e2e_clean import CORE, EVERY, INSTALLED, SILENT, counted

pytestmark = pytest.mark.e2e


def as_installed(env: dict[str, str], fault: bool = False) -> dict[str, str]:
    """`env` for every process of an engine with the guard installed as a regular package;
    `fault`: the fault plugin loaded where sglang has no plugin loader to load it."""
    return {**env, **INSTALLED,
            **({"OOBGUARD_FAULT_PLUGIN": "1"} if fault and not has("plugin loader") else {})}


# the release whose cell runs the clean matrix (ci/test.sh: the first of ci/matrix)
MATRIX_RELEASE = next(line for line in (ROOT / "ci" / "matrix").read_text().splitlines()
                      if line.strip() and not line.startswith("#")).strip()


def applicable() -> tuple[str, ...]:
    """The checks of the clean matrix that run on this release (the map's only where it is known),
    less ownids: it counts only writes whose ids are not the step's out_cache_loc tensor, and on the
    older releases every torch_native layer writes with that tensor itself (0.5.12's smoke run with
    the map on counted none, 2026-12-07): nothing for it to check, rightly. Each unit's modules are
    imported first, as doctor does: `where` reads sglang's classes (0.5.4's mem_cache.common has no
    release_kv_cache, which only its import shows)."""
    for unit in UNITS:
        unit.unread()  # a module this CPU cannot import: its check stays in, and must count
    return tuple(unit.name for unit in UNITS if unit.name in CORE and unit.name != "ownids" and unit.where() is None)


def test_a_double_free_is_reported_in_the_engine_as_a_user_installs_the_guard(model, tmp_path):
    run = run_engine(model, as_installed({"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_LIVENESS": "1",
                                          "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0", "SGLANG_OOBGUARD_REPORT_DIR": str(tmp_path),
                                          "OOBGUARD_FAULT": "step=3,token=1,value=freed"}, fault=True))
    (line,) = [line for line in run.log.splitlines() if line.startswith("oobguard_faultinject: step")]
    slot = int(re.search(r"out_cache_loc (\d+) freed", line).group(1))
    assert run.returncode == 0 and run.result and not run.result.get("error"), run.log[-3000:]
    assert "NOT GUARDED" not in run.log and "NOT tracked" not in run.log, run.log[-3000:]
    assert f"out_cache_loc (forward step): loc[1] = {slot} is not allocated (freed)" in run.log, run.log[-3000:]
    assert re.search(rf"free \(TokenToKVPoolAllocator\): free_index\[\d+\] = {slot} is not allocated \(double free\)",
                     run.log), run.log[-3000:]
    report = summary.read(str(tmp_path))
    assert report.exit_code == summary.VIOLATIONS
    # (and on releases where the write map is known, the read check: the request reads the slot it lost)
    assert {"out_cache_loc (forward step)", "free (TokenToKVPoolAllocator)"} <= {g.label for g in report.groups}
    assert not any(p.unguarded for p in report.processes)
    assert not run.leftovers


def test_every_check_that_applies_runs_clean_in_the_engine(model, tmp_path):
    if SGLANG == MATRIX_RELEASE:
        pytest.skip(f"the clean matrix (tests/test_e2e_clean.py) runs every check on {SGLANG}, in 15 configurations")
    clean = reference_run(model, "batch").result["outputs"]
    run = run_engine(model, as_installed({**EVERY, "SGLANG_OOBGUARD_REPORT_DIR": str(tmp_path)}))
    assert run.returncode == 0 and run.result and not run.result.get("error"), run.log[-3000:]
    assert run.result["outputs"] == clean
    known = () if write_map_off() is None else ("write map not checked",)  # said once where the map is off
    said = [line for line in run.log.splitlines() if any(w in line for w in SILENT if w not in known)]
    assert not said and "NOT GUARDED" not in run.log, said[:5]
    totals = counted(tmp_path, applicable(), "the smoke run")
    assert not any(p.unguarded for p in summary.read(str(tmp_path)).processes)
    assert not run.leftovers
    # the release table's engine cell (ci/sweep.sh reads this line)
    ran = [unit.name for unit in UNITS if any(n for what, n in totals.get(unit.name, {}).items() if what != "reports")]
    why = {unit.name: unit.where() or (f"runs where sglang runs {unit.feature}" if unit.feature else "no work here")
           for unit in UNITS}
    idle: dict[str, list[str]] = {}  # why -> the checks that did not run for it
    for name in why:
        if name not in ran:
            idle.setdefault(why[name], []).append(name)
    unrun = "; ".join(", ".join(names) + f" ({reason})" for reason, names in idle.items()) or "none"
    print(f"ENGINE: clean, same tokens; counted work: {', '.join(ran)}; not run: {unrun}")
