"""LeakSanitizer for the KV cache (issue #44) in sglang's Engine on the CPU: the fault plugin's
three leak faults (tests/e2e/faultinject, `site=leak`: a release run twice, a release that
frees none of its KV, a row given back under its running request), each

- with the guard off: the fault fires (the plugin's line) and sglang says only what it can: an
  assertion at the second release, counts at idle ("memory leak detected"), no request named;
- in strict mode: the guard's report stops the scheduler where the fault is (the second release,
  the hand-out of the row, the release that freed nothing: release completeness), naming the request(s);
- in warn mode: one run with all three, each reported at its place with the requests and the
  history, the second release dropped, every request served.

Six engine runs; the clean matrix (tests/test_e2e_clean.py) runs both checks over a correct sglang.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from e2e.harness import Run, run_engine
from sglang_oobguard.model.leaktargets import RELEASE_LEAK_LABEL
from sglang_oobguard.model.violation import Violation

pytestmark = pytest.mark.e2e

LIVE = {"SGLANG_OOBGUARD_LIVENESS": "1"}
SGLANG_WARNS = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "0"}  # sglang's idle check logs instead of raising
ADMITTED = ("radix", ("radix=off",))  # 44 requests admitted over time, each freeing its own KV at the end
FIRED = {  # the fault plugin's line for each fault -> what it names
    "twice": re.compile(r"oobguard_faultinject: request (\w+) released twice"),
    "skip": re.compile(r"oobguard_faultinject: request (\w+) released without freeing its KV \(row (\d+)\)"),
    "row": re.compile(r"oobguard_faultinject: row (\d+) of request (\w+) freed while it runs, before the hand-out "
                      r"to \['(\w+)'\]"),
}
SAID = {"twice": "is released a second time", "skip": "neither freed by its release nor left to the tree",
        "row": "while running request"}


def fired(run: Run, fault: str) -> tuple:
    found = FIRED[fault].search(run.log)
    assert found, (fault, run.log[-3000:])
    return found.groups()


def filed(folder: Path) -> list[Violation]:
    return [Violation.from_dict(record["violation"]) for path in sorted(folder.glob("*.jsonl"))
            for record in map(json.loads, path.read_text().splitlines()) if record["kind"] == "violation"]


def leak_run(model, faults: str, env: dict, workload: tuple, folder=None) -> Run:
    extra = {"SGLANG_OOBGUARD_REPORT_DIR": str(folder)} if folder is not None else {}
    return run_engine(model, {"OOBGUARD_FAULT": f"site=leak,value={faults}", **env, **extra}, workload=workload[0],
                      options=workload[1], timeout=300)


def test_guard_off_a_second_release_trips_sglang_s_assert_which_names_no_first_release(model):
    run = leak_run(model, "twice", {}, ("batch", ()))
    fired(run, "twice")
    assert "sglang_oobguard active" not in run.log
    assert "AssertionError: Only a mamba-capable tree cache allows freeing before alloc" in run.log, run.log[-3000:]


def test_guard_off_a_skipped_free_and_a_reused_row_are_only_counts_in_sglang_s_idle_check(model, tmp_path):
    run = leak_run(model, "skip+row", SGLANG_WARNS, ADMITTED, tmp_path)  # the folder: engine_run idles before it stops
    assert "sglang_oobguard active" not in run.log and not list(tmp_path.glob("*.jsonl"))
    leaker, _ = fired(run, "skip")
    fired(run, "row")
    said = [line for line in run.log.splitlines() if "memory leak detected" in line]
    assert any(line.startswith("[") and "pool memory leak detected! [full]" in line for line in said), said[:3]
    assert any("req_to_token_pool memory leak detected" in line for line in said), said[:3]  # a row on its list twice
    assert not any(leaker in line for line in said)  # counts: whose, not said


@pytest.mark.parametrize("fault,workload,kind", [("twice", ("batch", ()), "double_release"),
                                                 ("skip", ("batch", ()), "leak"),
                                                 ("row", ADMITTED, "row_reused")], ids=["twice", "skip", "row"])
def test_strict_stops_where_each_fault_is_naming_its_request(model, tmp_path, fault, workload, kind):
    run = leak_run(model, fault, {**LIVE, "SGLANG_OOBGUARD_MODE": "strict"}, workload, tmp_path)
    named = fired(run, fault)
    raised = [line for line in run.log.splitlines() if line.startswith("sglang_oobguard.report.reporter."
                                                                       "KVOutOfBoundsError: ")]
    assert raised and SAID[fault] in raised[0], (fault, raised, run.log[-3000:])
    first = filed(tmp_path)[0]
    assert first.kind == kind, first
    if fault == "row":
        row, victim, new = named
        assert (first.value, first.owner, first.request) == (int(row), victim, new)
    else:
        assert first.request == named[0], (first, named)
    if fault == "skip":
        assert "memory leak detected" not in run.log  # reported before sglang's own idle check failed


def test_warn_names_each_fault_where_it_happens_and_serves_every_request(model, tmp_path):
    run = leak_run(model, "twice+skip+row", {**LIVE, **SGLANG_WARNS, "SGLANG_OOBGUARD_MODE": "warn"}, ADMITTED,
                   tmp_path)
    assert run.returncode == 0 and run.result and not run.result.get("error"), run.log[-3000:]
    assert len(run.result["outputs"]) == 44 and not run.leftovers
    (twice,), (leaker, _), (row, victim, new) = fired(run, "twice"), fired(run, "skip"), fired(run, "row")
    by_kind: dict[str, list[Violation]] = {}
    for violation in filed(tmp_path):
        by_kind.setdefault(violation.kind, []).append(violation)
    released, = by_kind["double_release"]  # the second release dropped: sglang's assert never ran
    assert released.request == twice and "batch_result_processor.py" in released.freed_by  # where it finished
    assert "AssertionError" not in run.log
    reused, = by_kind["row_reused"]
    assert (reused.value, reused.owner, reused.request) == (int(row), victim, new)
    double, = by_kind["row_double_free"]  # the victim's own release, the row its successor's now: dropped
    assert (double.value, double.request, double.owner) == (int(row), victim, new)
    assert "req_to_token_pool memory leak detected" not in run.log  # the row never went on sglang's list twice
    leak = next(v for v in by_kind["leak"] if v.request == leaker)
    assert leak.label == RELEASE_LEAK_LABEL  # at its release, not at the next idle
    assert leak.bad > 16 and leak.generation > 0 and "alloc" in leak.allocated_by  # its prompt's and its tokens' slots
    said = [line for line in run.log.splitlines() if "pool memory leak detected! [full]" in line]
    assert said and not any(leaker in line for line in said)  # sglang's own idle check: counts only
