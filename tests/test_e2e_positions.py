"""End to end, the position check: the real sglang 0.5.23 Engine on the CPU, greedy, with the
test-only faults of tests/e2e/faultinject (positions.py) on the batches sglang builds:

- the 4-prompt batch workload (prefilled together, then decoded): request 2's positions
  offset by 2 in the prefill (an extend request's), the last prompt tokens of requests 0 and
  1 swapped (a token id between two requests), token 1's position + 1 at the 4th decode;
- EAGLE (the tiny model as its own draft, 3 draft steps): a draft step's position not
  advanced (token 0 at draft step 1, one step behind: the mirror of sglang PR #25015's bug).

Each guarded run is warn mode (one run serves its faults: each filed at its own step, naming
the request, the token and the expected and actual position or token), and serves the same
tokens as its guard-off control (a position is not contained); the control shows each fault
fired without the guard. The clean runs are the clean matrix's (tests/test_e2e_clean.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from e2e.harness import run_engine

pytestmark = pytest.mark.e2e

FAULTS = "extend@0:2:2;swap@0:0:1;decode@3:1:1"
EAGLE = ("eagle", "steps=3", "drafts=4")
WARN = {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0"}
FIRED = re.compile(r"oobguard_faultinject: positions fault (\w+)@[\d:+-]+: (.*) \(pid \d+\)")


def filed(folder: Path) -> list[dict]:
    """Every violation the run's processes filed, in order."""
    return [record["violation"] for path in sorted(folder.glob("*.jsonl")) for line in path.read_text().splitlines()
            for record in [json.loads(line)] if record.get("kind") == "violation"]


def fired(run) -> dict[str, str]:
    return dict(FIRED.findall(run.log))


@pytest.fixture(scope="module")
def batch_runs(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("positions-reports")
    guarded = run_engine(model, {**WARN, "SGLANG_OOBGUARD_REPORT_DIR": str(folder), "OOBGUARD_POSITIONS": FAULTS})
    control = run_engine(model, {"OOBGUARD_POSITIONS": FAULTS})
    return guarded, control, filed(folder)


@pytest.fixture(scope="module")
def eagle_runs(model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("positions-eagle-reports")
    faults = {"OOBGUARD_POSITIONS": "draft@1:0:-1"}
    guarded = run_engine(model, {**WARN, "SGLANG_OOBGUARD_REPORT_DIR": str(folder), **faults}, options=EAGLE,
                         timeout=300)
    control = run_engine(model, faults, options=EAGLE, timeout=300)
    return guarded, control, filed(folder)


def served(run) -> list:
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert not run.leftovers
    return run.result["outputs"]


def test_each_fault_fires_with_the_guard_off_and_changes_the_tokens(batch_runs, clean):
    _, control, _ = batch_runs
    assert "sglang_oobguard active" not in control.log
    assert sorted(fired(control)) == ["decode", "extend", "swap"], control.log[-3000:]
    outputs = served(control)
    assert outputs[0] != clean[0] and outputs[1] != clean[1]  # the swapped prompt tokens
    assert outputs[3] == clean[3]  # the request no fault touched


def test_each_fault_is_reported_at_its_step_and_the_step_runs_on_uncontained(batch_runs):
    guarded, control, reports = batch_runs
    assert served(guarded) == served(control)  # warn: not contained, every request served as unguarded
    said = fired(guarded)
    extend = re.fullmatch(r"extend 0 tokens (\d+)\.\.(\d+) request (\w+): positions (\d+)\.\. -> (\d+)\.\.", said["extend"])
    swap = re.fullmatch(r"extend 0 tokens (\d+) and (\d+) \(requests (\w+) and (\w+)\): input_ids (\d+), (\d+) -> "
                        r"(\d+), (\d+)", said["swap"])
    decode = re.fullmatch(r"decode 3 tokens (\d+)\.\.\d+ request (\w+): positions (\d+)\.\. -> (\d+)\.\.", said["decode"])
    assert extend and swap and decode, said
    by_kind = {(v["kind"], v["mode"]): v for v in reports}
    assert len(reports) == 3 and set(by_kind) == {("position", "extend"), ("token", "extend"), ("position", "decode")}, \
        reports
    first, last, rid, was, got = extend.groups()
    v = by_kind["position", "extend"]
    assert (v["pos"], v["value"], v["expected"], v["request"], v["token"], v["bad"]) == (
        int(first), int(got), int(was), rid, int(was), int(last) - int(first) + 1)
    assert v["label"] == "positions (forward step)" and v["step"] == 0 and v["draft_step"] is None
    i, j, rid_i, rid_j, id_i, id_j, got_i, got_j = swap.groups()
    v = by_kind["token", "extend"]
    assert (v["pos"], v["value"], v["expected"], v["request"], v["bad"]) == (int(i), int(got_i), int(id_i), rid_i, 2)
    assert v["label"] == "input_ids (forward step)" and v["step"] == 0
    token, rid, was, got = decode.groups()
    v = by_kind["position", "decode"]
    assert (v["pos"], v["value"], v["expected"], v["request"], v["token"], v["bad"]) == (
        int(token), int(got), int(was), rid, int(was), 1)
    assert v["step"] > 0
    assert "sglang_oobguard: reported only (the slot is right, the position is not: the step runs on uncontained): " \
           "positions (forward step): positions[" in guarded.log  # the first report's line (then running totals)
    assert f"positions (forward step): positions[{token}] = {got} is not this token's position {was}: its K is " \
           "rotated there" in guarded.log


def test_an_eagle_draft_step_not_advanced_is_reported_at_that_draft_step(eagle_runs):
    guarded, control, reports = eagle_runs
    assert "sglang_oobguard active" not in control.log and "draft" in fired(control), control.log[-3000:]
    assert served(guarded) == served(control) and guarded.result["spec_verify_ct"] > 0
    found = re.fullmatch(r"draft step 1 token 0 request (\w+): position (\d+) -> (\d+)", fired(guarded)["draft"])
    assert found, fired(guarded)
    rid, was, got = found.groups()
    (v,) = reports  # and nothing else of the EAGLE run: its target's extends and verifies, its draft extends
    assert (v["kind"], v["mode"], v["draft_step"], v["pos"], v["value"], v["expected"], v["request"], v["token"]) == (
        "position", "decode", 1, 0, int(got), int(was), rid, int(was))
    assert f"positions[0] = {got} is not this token's position {was} at draft step 1: its K is rotated there" \
        in guarded.log
