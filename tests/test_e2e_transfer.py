"""End to end: PD disaggregation's decode side, the real sglang Engine on the CPU with the fake
transfer backend (`disaggregation_mode="decode"`; tests/e2e/engine_run.py's `decode` workload),
the guard with liveness on (its KV transfer check, `checks/transfer.py`).

The fake receiver concludes at once; the fault plugin's OOBGUARD_TRANSFER=hold=3 makes each
transfer take 3 s and gives the fake manager a drain signal, as a real backend's RDMA write and
abort acknowledgement would (`armed`); with `,drain=none` the fake manager keeps its lack of one
(`none`: the fake backend as it is, or a real one with sglang's deferred release off), and
sglang's deferred-release timeout, the longest warn holds such pages, is set to 6 s. A request
aborted 0.6 s after its send then has its pages freed while the write into them may still run;
three more requests than the pool has left follow it."""

from __future__ import annotations

import re

import pytest

from e2e.harness import run_engine
from helpers import needs

pytestmark = pytest.mark.e2e

LIVE = {"SGLANG_OOBGUARD_LIVENESS": "1", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0"}
HOLDS = {"armed": {"OOBGUARD_TRANSFER": "hold=3"},
         "none": {"OOBGUARD_TRANSFER": "hold=3,drain=none", "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT": "6"}}
STATE = {"armed": "is in flight", "none": "may still be in flight (no drain signal)"}
HANDED = re.compile(r"oobguard_faultinject: pages \[[\d, ]+\] handed out while in flight \(room 100,")


def report(drain: str) -> re.Pattern:
    """The in-flight free's report line: its state text (`STATE`), the victim, how many pages."""
    return re.compile(rf"free \(TokenToKVPoolAllocator\): page (\d+) freed while a KV transfer into it "
                      rf"{re.escape(STATE[drain])} \(request victim, bootstrap room 100, sent [^)]*\) "
                      r"\((\d+) of (\d+) freed pages in flight\)")


FOLLOWERS = {"follower0", "follower1", "follower2"}


@pytest.fixture(autouse=True)
def _decode_side():
    needs("DecodePreallocQueue._send_kv_metadata")


def reported(run) -> list[str]:
    return [line for line in run.log.splitlines() if "sglang_oobguard:" in line and "freed while" in line]


@pytest.mark.parametrize("drain", ["armed", "none"])
def test_baseline_unguarded_an_aborted_transfer_pages_go_to_the_next_request_in_flight(model, drain):
    """What the guard is for: without it, another request gets the pages still being written."""
    run = run_engine(model, HOLDS[drain], workload="decode", options=("abort",))
    assert run.returncode == 0 and FOLLOWERS <= set(run.result["by_rid"]), run.log[-3000:]
    assert HANDED.search(run.log), run.log[-3000:]
    assert "sglang_oobguard" not in run.log


@pytest.mark.parametrize("drain", ["armed", "none"])
def test_strict_reports_the_in_flight_free_naming_the_request_and_pages(model, drain):
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE, **HOLDS[drain]}, workload="decode",
                     options=("abort",))
    found = report(drain).search(run.log)
    assert found and "KVOutOfBoundsError" in run.log, run.log[-3000:]
    assert found.group(2) == found.group(3) == "60"  # the victim's 60 prompt pages, all in flight
    assert run.result is None and run.returncode != 0 and not run.leftovers  # reported at the free, not hung
    assert not HANDED.search(run.log)


@pytest.mark.parametrize("drain", ["armed", "none"])
def test_warn_holds_the_pages_until_the_transfer_ends_and_serves_the_others(model, drain):
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "warn", **LIVE, **HOLDS[drain]}, workload="decode",
                     options=("abort",))
    assert run.returncode == 0 and FOLLOWERS <= set(run.result["by_rid"]), run.log[-3000:]
    assert all(len(run.result["by_rid"][rid]) == 8 for rid in FOLLOWERS)
    assert len(reported(run)) == 1 and report(drain).search(reported(run)[0]), run.log[-3000:]
    assert not HANDED.search(run.log)  # nothing handed out while the write into it ran
    given_back = {"armed": "the KV transfer of request victim (bootstrap room 100) ended: the 60 pages held back",
                  "none": "the backend has no drain signal for the KV transfer of request victim (bootstrap room 100) "
                          "after 6 s: the 60 pages held back go to the free list now"}
    assert given_back[drain] in run.log, run.log[-3000:]
    assert not run.leftovers
