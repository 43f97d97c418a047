"""End to end, ownership: a write that lands in range, on a live slot, that belongs to
another running request. The real sglang 0.5.23 Engine on the CPU, three concurrent
requests (greedy), the fault plugin (tests/e2e/faultinject) at decode step 3:

- cross: token 0 (request 0) gets the slot of request 1's first token;
- dup: token 1 (request 1) gets token 0's slot;
- twin: as cross, and request 0's req_to_token entry says the same for that forward: the
  tables agree, only the owner check (liveness on) sees it.

Strict fails the engine, with no hang, and the report names the slot and both rids;
warn serves every request, and the owner's tokens and the untouched request's are the
clean run's. The write map is on whenever the guard is; the owner check and the read check
with liveness (every clean run below reads every slot of every request at every step)."""

from __future__ import annotations

import re

import pytest

from e2e.harness import reference_tokens, run_engine

pytestmark = pytest.mark.e2e

LIVE = {"SGLANG_OOBGUARD_LIVENESS": "1"}
INJECTED = re.compile(r"oobguard_faultinject: step 3 token (\d) of 3: out_cache_loc \d+ -> (\d+) \(pid \d+; mode decode "
                      r"rid (\w+) token \d+; (\w+); owner rid (\w+)\)")
# fault -> (writer token, owner token, untouched token, what the report says, settings)
FAULTS = {
    "cross": (0, 1, 2, "is not this token's slot (req_to_token holds", {}),
    "dup": (1, 0, 2, "is not this token's slot (req_to_token holds", {}),
    "twin": (0, 1, 2, "is owned by another running request", LIVE),
}


@pytest.fixture(scope="module")
def three_clean(model):
    return reference_tokens(model, "three")


def fault_run(model, fault: str, mode: str, extra: dict):
    writer = FAULTS[fault][0]
    return run_engine(model, {"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0", **extra,
                              "OOBGUARD_FAULT": f"step=3,token={writer},value={fault}"}, workload="three")


@pytest.mark.parametrize("mode", ["strict", "warn"])
@pytest.mark.parametrize("fault", ["cross", "dup", "twin"])
def test_a_slot_of_another_running_request_is_caught_named_and_contained(model, three_clean, fault, mode):
    writer, owner, untouched, what, extra = FAULTS[fault]
    run = fault_run(model, fault, mode, extra)
    (found,) = INJECTED.findall(run.log)
    slot, writer_rid, owner_rid = int(found[1]), found[2], found[4]
    assert int(found[0]) == writer and found[3] == fault
    report = re.compile(rf"out_cache_loc \(forward step\): loc\[{writer}\] = {slot} {re.escape(what)}[^;]*; "
                        rf"slot {slot} is held by request (\w+) token (\d+) \(pool MHATokenToKVPool\); "
                        rf"step \d+ \(decode, batch 3\); request {writer_rid} token \d+")
    hits = report.findall(run.log)
    assert hits, run.log[-4000:]
    assert hits[0][0] == owner_rid != writer_rid  # both sides named
    if fault != "dup":
        assert hits[0][1] == "0"  # the slot of the next request's first token
    if mode == "strict":
        assert f"KVOutOfBoundsError: out_cache_loc (forward step): loc[{writer}] = {slot}" in run.log
        assert run.result is None and run.returncode != 0  # reported, not hung
    else:
        assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
        outputs = run.result["outputs"]
        assert all(len(tokens) == 16 for tokens in outputs)
        assert "write contained" in run.log
        assert outputs[owner] == three_clean[owner], (outputs, three_clean)  # the owner's KV survived
        assert outputs[untouched] == three_clean[untouched]
        assert "memory leak" not in run.log
    assert not run.leftovers


def test_twin_without_liveness_is_not_seen_by_the_write_map(model, three_clean):
    """Honest limit: the tables agree, so the write map alone cannot see a twin; only the
    owner check (SGLANG_OOBGUARD_LIVENESS=1) does. The owner's tokens are corrupted."""
    run = fault_run(model, "twin", "strict", {})
    assert len(INJECTED.findall(run.log)) == 1
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert "KVOutOfBoundsError" not in run.log and "bad KV slot ids" not in run.log
    assert run.result["outputs"][1] != three_clean[1]  # request 1's first token's KV was overwritten
    assert not run.leftovers


EVICTED = re.compile(r"oobguard_faultinject: step 3 token 0: evicted \[([\d, ]+)\] of request (\w+) \(pid \d+\)")


def test_a_prefix_evicted_under_its_reader_and_handed_to_another_is_read_checked(model):
    """After decode step 3, request 0's first 4 slots go back to the allocator and first in
    its free list: the next step's allocations hand them to the running requests while
    request 0 still reads them. Strict + liveness: reported at that next step (the first
    that reads them), naming the reader, the position, the new holder and the free's call site."""
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE,
                             "OOBGUARD_FAULT": "step=3,token=0,value=evict,forward=decode"}, workload="three")
    (found,) = EVICTED.findall(run.log)
    slots, reader = [int(s) for s in found[0].split(", ")], found[1]
    report = re.search(r"KVOutOfBoundsError: req_to_token \(read check\): slot (\d+) at position (\d+) is read by its "
                       r"running request but was given back and handed out again \(generation \d+ -> \d+\); slot \d+ is "
                       r"held by request (\w+) token \d+(?: \(\d+ of \d+ ids bad\))? \(pool MHATokenToKVPool\); step (\d+) \(decode, batch 3\); "
                       rf"request {reader} token (\d+); [^;]*; slot \d+ last freed at step (\d+) by ([^\n]*), last "
                       r"allocated at step (\d+) by ([^\n]*) \(generation \d+\)", run.log)
    assert report, run.log[-4000:]
    slot, position, holder, step, token, freed_step, freed_by, allocated_step, allocated_by = report.groups()
    assert int(slot) == slots[int(position)] and position == token and holder != reader
    assert int(step) == int(freed_step) + 1  # the first step that reads them
    assert int(allocated_step) == int(freed_step)  # handed out between the two (a step number is the last begun)
    assert "_evict (__init__.py:" in freed_by and freed_by.endswith("TokenToKVPoolAllocator.free")
    assert "alloc_for_decode" in allocated_by and allocated_by.endswith("TokenToKVPoolAllocator.alloc")
    assert run.result is None and run.returncode != 0
    assert not run.leftovers
