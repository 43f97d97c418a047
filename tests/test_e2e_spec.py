"""End to end where slot ids move fastest: speculative decoding and two tensor-parallel
ranks, in sglang 0.5.23's real Engine on the CPU (the tiny Llama, greedy), the guard
loaded by sglang's plugin loader in every process, strict mode with liveness on.

Speculative decoding hands out draft slots, frees the rejected ones and moves the
accepted ones' KV (`move_kv_cache`), so a liveness false positive would show here.
EAGLE (topk 1, the tiny model as its own draft) and NGRAM run on the `intel_amx`
attention backend with the test-only stand-ins of its CPU ops (tests/standins/
sgl_kernel; tests/test_standins.py). Their attention makes the same SDPA call as the
plain runs' torch_native backend, so a speculative run must give exactly the plain,
unguarded run's tokens. The fault plugin (tests/e2e/faultinject) counts the calls of
the guarded methods in each process, so that a clean run is not a vacuous one.
"""

from __future__ import annotations

import re

import pytest

from e2e.harness import Run, reference_tokens, run_engine

pytestmark = pytest.mark.e2e

STRICT_LIVE = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1"}
VIOLATION = ("KVOutOfBoundsError", "bad KV slot ids", "not allocated", "sglang_oobguard: bad free")


def ranks(run: Run) -> dict[int, int]:
    """rank -> the pid of its scheduler (the one that counted its KV writes)."""
    return {tally["rank"]: pid for pid, tally in run.counts.items() if tally["writes"]}


EXCEPTION = re.compile(r"^\[[^\]]* TP(\d)\] Scheduler hit an exception", re.M)


def test_a_bad_id_on_one_rank_is_reported_by_that_rank(model):
    """rank 1 alone writes at a too-high slot id: rank 1's scheduler reports it, and the
    report names the rank (with the step and the request); rank 0 reports nothing."""
    run = run_engine(model, {**STRICT_LIVE, "OOBGUARD_FAULT": "step=3,token=1,value=high+3,rank=1"},
                     options=("tp=2",), count=True)
    (injected,) = [line for line in run.log.splitlines() if line.startswith("oobguard_faultinject: step")]
    assert f"(pid {ranks(run)[1]};" in injected
    assert [int(rank) for rank in EXCEPTION.findall(run.log)] == [1], run.log[-3000:]
    report = re.compile(r"KVOutOfBoundsError: [^\n]*1 of 4 slot ids outside \[0, 2049\): loc\[1\] = 2052 "
                        r"\(pool MHATokenToKVPool\); step \d+ \(decode, batch 4\); request \S+ token \d+; tp 1\b")
    found = report.findall(run.log)
    assert len(found) == 1 and run.log.index(found[0]) > EXCEPTION.search(run.log).start(), run.log[-3000:]
    assert run.result is None and run.returncode != 0 and not run.leftovers


# Stale slots in the draft path, given back to the allocator while still in use:
# EAGLE: a draft token's slot (token 1 of the verify batch: request 0's first draft),
# just before the target model verifies the drafts and writes their KV there.
# NGRAM: the first target slot of the accepted drafts' KV move (`move_kv_cache`).
DRAFT_FAULTS = {
    "eagle": ("step=2,token=1,value=freed,forward=target_verify", "out_cache_loc",
              r"out_cache_loc \(forward step\): loc\[1\] = {slot} is not allocated \(freed\)"),
    "ngram": ("site=move,step=2,token=0,value=freed", "move_kv_cache tgt_loc",
              r"move_kv_cache tgt_loc\b[^:]*: loc\[0\] = {slot} is not allocated \(freed\)"),
}


# One run per mode: strict at EAGLE's verify write, warn at NGRAM's move (both name their site).
@pytest.mark.parametrize("algorithm,mode", [("eagle", "strict"), ("ngram", "warn")])
def test_a_slot_freed_in_the_draft_path_is_caught_and_contained(model, clean, algorithm, mode):
    """The untouched requests keep the tokens of the same algorithm unguarded: NGRAM's
    verify batches move a near tie of this tiny random model (request 3, token 12)
    against the plain run, guard or not."""
    reference = reference_tokens(model, "batch", (algorithm,)) if mode == "warn" else clean
    fault, what, report = DRAFT_FAULTS[algorithm]
    run = run_engine(model, {**STRICT_LIVE, "SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0",
                             "OOBGUARD_FAULT": fault}, options=(algorithm,))
    (line,) = [line for line in run.log.splitlines() if line.startswith("oobguard_faultinject: step")]
    slot = int(re.search(rf"{what} (\d+) freed", line).group(1))
    report = report.format(slot=slot)
    if mode == "strict":  # the engine fails at that write, naming the site
        assert re.search(rf"KVOutOfBoundsError: {report}", run.log), run.log[-3000:]
        assert run.result is None and run.returncode != 0
    else:  # served; the move contained; the request's own free of the slot later is a double free, contained
        assert run.returncode == 0 and run.result and len(run.result["outputs"]) == 4, run.log[-3000:]
        assert re.search(rf"write contained \(the write got a copy with those ids sent to padding slot 0\): {report}",
                         run.log), run.log[-3000:]
        # the request's own free of the slot, when it came before the engine shut down (the result is streamed
        # first: under load the shutdown can win), is a double free
        assert set(re.findall(rf"free_index\[\d+\] = {slot} is not allocated \(([\w ]+)\)", run.log)) <= {"double free"}
        assert "memory leak" not in run.log
        differ = [i for i, (got, want) in enumerate(zip(run.result["outputs"], reference)) if got != want]
        assert differ in ([], [0])  # only the faulted request may differ
    assert not run.leftovers
