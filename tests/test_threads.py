"""Two threads (sglang 0.4.x runs the forward on a thread of its own, beside the
scheduler's): what one thread's call in progress means to the guard never leaks into
the other's. With the call state a process global, the second thread's write of the
same ids object on the same pool would pass as a super() call of the first's, unprobed."""

from __future__ import annotations

import threading

import torch

from helpers import Layer, mha, token_allocator
from sglang_oobguard import KVOutOfBoundsError


def test_a_write_on_another_thread_is_probed_while_one_is_in_progress(mp, guard, monkeypatch):
    """The first thread writes `loc` (held open inside sglang's write); meanwhile a slot
    of `loc` is given back, and the second thread writes the same ids object: a stale
    write, which must be reported, not passed as a nested call of the first thread's."""
    from sglang.srt.mem_cache import allocator as allocators

    guard("strict", liveness=True)
    pool = mha(mp)
    alloc = token_allocator(allocators, pool)
    loc = alloc.alloc(2)
    wrapper = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]
    inside, release = threading.Event(), threading.Event()

    def slow(self, layer, loc, *rest, **kwargs):  # sglang's write, held open on the first thread
        inside.set()
        release.wait(30)

    monkeypatch.setattr(wrapper, "__wrapped__", slow)
    k = torch.ones(2, 2, 4)
    first = threading.Thread(target=lambda: pool.set_kv_buffer(Layer(0), loc, k, k))
    first.start()
    assert inside.wait(30)
    try:
        alloc.free(loc[1:2].clone())
        held = []
        second = threading.Thread(target=lambda: held.append(_raises(lambda: pool.set_kv_buffer(Layer(1), loc, k, k))))
        second.start()
        second.join(30)
        assert len(held) == 1 and held[0].startswith(
            f"KVOutOfBoundsError: set_kv_buffer (MHA) layer 1: loc[1] = {int(loc[1])} is not allocated (freed) "
            f"(pool MHATokenToKVPool); slot {int(loc[1])} last freed before any forward step by "), held
        freed_by = held[0].split(", last allocated")[0]  # this test's own free, on this thread
        assert freed_by.endswith("> test_a_write_on_another_thread_is_probed_while_one_is_in_progress "
                                 "(test_threads.py:39) > TokenToKVPoolAllocator.free"), freed_by
    finally:
        release.set()
        first.join(30)


def test_each_thread_has_its_own_call_state(mp, guard):
    import sglang_oobguard.activate.instrument as instrument

    guard("strict")
    active = instrument._active.guard
    active.calls.depth = 3
    seen = []
    thread = threading.Thread(target=lambda: seen.append((active.calls.depth, active.calls.current, active.calls.memo)))
    thread.start()
    thread.join(30)
    assert active.calls.depth == 3
    active.calls.depth = 0
    assert seen == [(0, None, {})]


def _raises(call) -> str:
    try:
        call()
    except KVOutOfBoundsError as exc:
        return f"KVOutOfBoundsError: {exc}"
    return "no error"
