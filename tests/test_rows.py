"""The request-row check (`rows`) on sglang's own ReqToTokenPool and Req: a row freed twice is
reported at the second free, a row handed to a request while the running request it was handed
to before still has it is reported at the hand-out (both requests and the row named), and in
warn mode the bad free is dropped. What serving does (chunked requests keeping their row,
finished requests' rows reused) passes. The engine tests: tests/test_e2e_leaks.py."""

from __future__ import annotations

import array

import pytest

import sglang_oobguard
from helpers import needs
from sglang_oobguard import KVOutOfBoundsError

pytestmark = pytest.mark.usefixtures("clean_env")


def pool_and_reqs(n: int):
    needs("ReqKvInfo")  # 0.5.23's request record (req.kv): the Req these tests build
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.sampling.sampling_params import SamplingParams

    pool = ReqToTokenPool(size=4, max_context_len=8, device="cpu", enable_memory_saver=False)
    reqs = [Req(f"r{i}", "hi", array.array("i", [1, 2, 3]), SamplingParams(max_new_tokens=4)) for i in range(n)]
    return pool, reqs


def reports():
    return sorted(sglang_oobguard.violations(), key=lambda v: v.kind)


def test_a_row_freed_twice_is_reported_at_the_second_free_before_sglang_takes_it(guard):
    guard("strict", liveness=True)
    pool, (a,) = pool_and_reqs(1)
    pool.alloc([a])
    row = a.kv.req_pool_idx
    pool.free_rows([row])
    before = list(pool.free_slots)
    with pytest.raises(KVOutOfBoundsError) as caught:
        pool.free_rows([row])
    assert caught.value.kind == "row_double_free" and caught.value.value == row
    assert f"req_to_token row {row} is freed while not handed out (double free)" in str(caught.value)
    assert "last freed before any forward step by" in str(caught.value)  # the row's history
    assert pool.free_slots == before  # raised before sglang put it on its free list again


def test_a_row_given_back_under_its_running_request_is_named_at_the_hand_out_and_its_second_free_dropped(guard):
    guard("warn", liveness=True)
    pool, (a, b) = pool_and_reqs(2)
    pool.alloc([a])
    row = a.kv.req_pool_idx
    pool.free_rows([row])  # behind the request's back: it still runs with this row
    pool.alloc([b])
    assert b.kv.req_pool_idx == row  # sglang hands it out again
    reused = sglang_oobguard.violations()[0]
    assert reused.kind == "row_reused" and reused.value == row
    assert (reused.request, reused.owner) == ("r1", "r0")
    assert f"row {row} is handed to request r1 while running request r0 still has it" in reused.described()
    pool.free(a)  # a's own release: the row is b's now
    double = sglang_oobguard.violations()[0]
    assert double.kind == "row_double_free" and (double.request, double.owner) == ("r0", "r1")
    assert a.kv.req_pool_idx is None and b.kv.req_pool_idx == row
    assert pool.free_slots.count(row) == 0  # dropped: b keeps its row, the list holds it never twice
    pool.free(b)
    assert pool.free_slots.count(row) == 1 and len(sglang_oobguard.violations()) == 1


def test_serving_s_own_row_traffic_passes(guard):
    """A chunked request keeps its row across alloc calls, a finished request's row goes to the
    next, clear gives every row back, beam search's member rows come and go without a request."""
    from sglang.srt.managers.schedule_batch import FINISH_LENGTH

    guard("strict", liveness=True)
    pool, (a, b, c) = pool_and_reqs(3)
    pool.alloc([a])
    a.kv.kv_allocated_len = 3
    row = a.kv.req_pool_idx
    pool.alloc([a, b])  # a continues (chunked prefill): no new row for it
    assert a.kv.req_pool_idx == row
    a.finished_reason = FINISH_LENGTH(length=4)
    pool.free(a)
    pool.alloc([c])  # a's row, a finished
    assert c.kv.req_pool_idx == row
    members = pool.alloc_rows(2)
    pool.free_rows(members)
    pool.free(b)
    pool.free(c)
    pool.clear()  # sglang's flush_cache: at idle
    pool.alloc([a.__class__("d", "hi", array.array("i", [1]), b.sampling_params)])
    assert sglang_oobguard.violations() == []
    counts = sglang_oobguard.activate.instrument._active.guard.counts.snapshot()
    assert counts["rows"] == {"allocs": 5, "frees": 4}, counts


def test_off_by_the_switch_nothing_is_looked_at(guard, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_CHECKS", "-rows")
    guard("strict", liveness=True)
    pool, (a,) = pool_and_reqs(1)
    pool.alloc([a])
    pool.free_rows([a.kv.req_pool_idx])
    pool.free_rows([a.kv.req_pool_idx])  # sglang's own bug now, unseen
    assert sglang_oobguard.violations() == []
