"""Slot history (liveness on): every liveness report names where the slot was last
freed and handed out (step and call site) and its generation, on the real sglang
allocator and pool, on the CPU; the call site costs one interned int per call."""

from __future__ import annotations

import sys

import pytest

import sglang_oobguard
from helpers import mha, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model import callsite
from test_liveness import SIZE, write


@pytest.fixture
def tracked(mp, guard):
    from sglang.srt.mem_cache import allocator

    def make(mode: str, backend: str = "auto"):
        guard(mode, backend, liveness=True)
        pool = mha(mp, SIZE)
        return pool, token_allocator(allocator, pool)

    return make


def finish_request(alloc, loc):
    """Stands for the scheduler's release of a finished request: the frame a report must name."""
    alloc.free(loc)


def admit_request(alloc, n):
    return alloc.alloc(n)


FREE_LINE = finish_request.__code__.co_firstlineno + 2  # its alloc.free line: the frame a report names


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_write_to_a_freed_slot_names_its_free_and_its_allocation(tracked, backend):
    pool, alloc = tracked("raise", backend)
    loc = admit_request(alloc, 4)
    finish_request(alloc, loc[2:])
    freed = int(loc[2])
    with pytest.raises(KVOutOfBoundsError) as info:
        write(pool, loc.clone())
        sglang_oobguard.check()
    err = info.value
    assert err.freed_by.endswith(f" > finish_request (test_history.py:{FREE_LINE}) > TokenToKVPoolAllocator.free")
    assert "admit_request (test_history.py:" in err.allocated_by
    assert err.allocated_by.endswith("TokenToKVPoolAllocator.alloc")
    assert err.generation > 0
    text = str(err)
    assert f"slot {freed} last freed before any forward step by " in text and " > finish_request (test_history.py:" in text
    assert ", last allocated before any forward step by " in text and f"(generation {err.generation})" in text


def test_a_double_free_names_the_first_free(tracked):
    pool, alloc = tracked("raise")
    loc = admit_request(alloc, 2)
    finish_request(alloc, loc)
    with pytest.raises(KVOutOfBoundsError) as info:
        alloc.free(loc[:1])  # this line's own frame is the second free, the report names the first
    assert info.value.kind == "double_free"
    assert info.value.freed_by.endswith(f"> finish_request (test_history.py:{FREE_LINE}) > TokenToKVPoolAllocator.free")


def test_generations_rise_at_each_allocation_of_a_slot(tracked):
    from sglang_oobguard.probes import shadow

    pool, alloc = tracked("raise")
    state = alloc.__dict__["_oobguard_live"]
    loc = alloc.alloc(1)
    slot = int(loc[0])
    first = shadow.story(state.live, slot)[0]
    alloc.free(loc)
    again = alloc.alloc(SIZE)  # every free slot: this one among them
    assert slot in again.tolist()
    assert shadow.story(state.live, slot)[0] > first


def test_call_sites_are_interned_by_code_and_line():
    class X:
        pass

    def where():
        return callsite.here(X, "alloc", skip=0)

    first, second = where(), where()
    assert first == second  # the same line: one id
    other = callsite.here(X, "alloc", skip=0)
    assert other != first
    # two calls on one line (two instructions): one site, as the text reads the same
    assert callsite.here(X, "alloc", skip=0) == callsite.here(X, "alloc", skip=0) != other
    line = sys._getframe().f_lineno + 1  # the next line's: the line of the call, as f_lineno reads it
    assert callsite.text(callsite.here(X, "alloc", skip=0)).endswith(f"(test_history.py:{line}) > X.alloc")
    assert callsite.here(X, "free", skip=0) != callsite.here(X, "alloc", skip=0)  # the method is part of the site
    assert callsite.text(first).endswith("> X.alloc") and "test_call_sites_are_interned_by_code_and_line" \
        in callsite.text(first)
    assert callsite.unpack(callsite.pack(57, first)) == (57, first)
    assert callsite.unpack(callsite.NONE) == (-1, -1) and callsite.text(-1) is None
