"""One check, one switch (SGLANG_OOBGUARD_CHECKS), in the real engine on the CPU: a check
turned off counts no work (it did not run), the others still do, nothing is reported over a
correct sglang, and the tokens are the guard-off run's. Page size 4, the radix workload
(prefix reuse, evictions, half-filled pages), strict, as the clean matrix's `page4-radix` row.
"""

from __future__ import annotations

import re

import pytest

from e2e.harness import reference_run, run_engine
from sglang_oobguard.report.summary import read
from test_e2e_clean import TIMEOUT, guarded_clean, tokens

pytestmark = pytest.mark.e2e

OPTIONS = ("page=4",)
SWITCHES = [  # (SGLANG_OOBGUARD_CHECKS, the checks it turns off, the checks that must still count work)
    ("all,-reads", ("reads",), ("bounds", "map", "owners", "liveness", "history", "ownids", "finite")),
    ("bounds,liveness", ("map", "owners", "history", "reads", "ownids", "finite"), ("bounds", "liveness")),
]


@pytest.mark.parametrize("switch,off,on", SWITCHES, ids=[switch for switch, _, _ in SWITCHES])
def test_a_check_switched_off_never_runs_and_the_others_still_do(model, switch, off, on, tmp_path):
    reference = reference_run(model, "radix", OPTIONS)
    folder = tmp_path / "reports"
    env = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1", "SGLANG_OOBGUARD_CHECKS": switch,
           "SGLANG_OOBGUARD_REPORT_DIR": str(folder)}
    run = run_engine(model, env, workload="radix", options=OPTIONS, timeout=TIMEOUT)
    totals = guarded_clean(run, folder, on, switch)  # no report; every check left on counted work
    ran = {check: units for check, units in totals.items() if any(n for unit, n in units.items() if unit != "reports")}
    assert not set(off) & set(ran), (switch, totals)
    said = re.search(r"off by SGLANG_OOBGUARD_CHECKS: ([a-z, ]+)", run.log)  # the activation line says so
    assert said and set(said.group(1).split(", ")) >= set(off) - {"finite"}, switch  # (finite: never asked for here)
    for process in read(str(folder)).processes:  # the report file's activation record names only what runs
        assert not set(off) & set(process.activation.get("checks", ())), process.activation
    assert tokens("radix", run.result) == tokens("radix", reference.result), switch
