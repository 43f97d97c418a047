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

from e2e.harness import assert_radix_reused, reference_tokens, run_engine

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


def test_radix_shared_prefixes_chunks_and_eviction_raise_nothing_with_the_owner_check(model, radix_clean):
    """44 requests on 4 shared prefixes (read by many, written once), 32-token chunks,
    slots evicted and handed out again: strict, liveness on: no report, the unguarded tokens."""
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE}, workload="radix", count=True)
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert run.result["outputs"] == radix_clean
    assert "KVOutOfBoundsError" not in run.log and "bad KV slot ids" not in run.log
    assert "write map not checked" not in run.log  # extend, mixed and decode all mapped
    assert "read check skipped" not in run.log and "internal error" not in run.log  # every step's reads checked
    assert_radix_reused(run)
    tally = run.tally(rank=0)
    assert tally["probes"] >= tally["steps"] > 0, tally  # the step check ran every forward
    assert not run.leftovers


RETRACTED = re.compile(r"(?:KV cache pool is full\. Retract requests\.|Testing retraction\.) #retracted_reqs: (\d+)")


def test_retraction_raises_nothing(model):
    """sglang's own retraction test mode (SGLANG_TEST_RETRACT: retract_decode every 3rd
    forward, the scheduler's real path: the requests' slots freed or kept in the radix
    tree, their rows handed back, then prefilled again): strict + liveness, the radix
    workload: nothing reported, and the tokens of the same run unguarded."""
    retract = {"SGLANG_TEST_RETRACT": "1"}
    reference = run_engine(model, retract, workload="radix")
    assert reference.returncode == 0 and reference.result and "outputs" in reference.result, reference.log[-3000:]
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE, **retract}, workload="radix")
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert sum(int(n) for n in RETRACTED.findall(run.log)) > 0, run.log[-3000:]  # it did retract
    assert run.result["outputs"] == reference.result["outputs"]
    assert "KVOutOfBoundsError" not in run.log and "bad KV slot ids" not in run.log
    assert "read check skipped" not in run.log and "internal error" not in run.log
    assert not run.leftovers


@pytest.mark.parametrize("workload,options", [("mixed", ()), ("batch", ("eagle",)), ("batch", ("ngram",))],
                         ids=["mixed-chunks", "eagle", "ngram"])
def test_every_forward_mode_of_these_runs_is_mapped_and_clean(model, clean, workload, options):
    """Mixed chunked prefill (MIXED), EAGLE (target EXTEND, draft EXTEND and DECODE steps,
    TARGET_VERIFY, DRAFT_EXTEND_V2) and NGRAM (TARGET_VERIFY): strict + liveness, no
    forward skipped by the write map, nothing reported, the tokens of the same run unguarded."""
    # the same run unguarded: NGRAM's verify flips a near tie of this tiny random model (request 3, token 12)
    # against the plain run, guard or not
    reference = clean if workload == "batch" and options == ("eagle",) else reference_tokens(model, workload, options)
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE}, workload=workload, options=options)
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert run.result["outputs"] == reference
    assert "write map not checked" not in run.log, [l for l in run.log.splitlines() if "write map" in l]
    assert "read check skipped" not in run.log and "internal error" not in run.log  # every target step's reads
    assert "KVOutOfBoundsError" not in run.log and "bad KV slot ids" not in run.log
    if options:
        assert run.result["spec_verify_ct"] > 0
    else:
        assert re.search(r"Prefill batch[^\n]*#running-req: [1-9]", run.log), run.log[-3000:]  # mixed with decodes
    assert not run.leftovers


def test_a_full_pool_retracts_and_raises_nothing(model):
    """A real retraction: 44 requests admitted aggressively (schedule_conservativeness
    0.01) into a pool of 384 slots: decode runs out of room, sglang retracts requests
    (frees their slots, hands their rows back) and prefills them again later. Strict +
    liveness: nothing reported, the tokens of the same run unguarded."""
    reference = run_engine(model, {}, workload="retract")
    assert reference.returncode == 0 and reference.result and "outputs" in reference.result, reference.log[-3000:]
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", **LIVE}, workload="retract")
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert "KVOutOfBoundsError" not in run.log and "bad KV slot ids" not in run.log
    assert not run.leftovers
    full = "KV cache pool is full. Retract requests."
    if full not in run.log or sum(map(int, RETRACTED.findall(run.log))) == 0:
        # sglang's admission depends on when the requests arrive: a busy machine can admit them
        # slowly enough that nothing runs out (seen in a CI run beside another job).
        # test_retraction_raises_nothing retracts deterministically.
        pytest.skip("sglang did not retract in this run (its admission is timing-dependent)")
    if full in reference.log:  # the same kind of schedule unguarded: the same tokens
        assert run.result["outputs"] == reference.result["outputs"]


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
