"""The liveness guard (SGLANG_OOBGUARD_LIVENESS) on the real sglang allocators and
pools, on the CPU: writes to freed slots and double frees are caught; the normal
alloc / free / re-alloc life of a slot is clean."""

from __future__ import annotations

import logging
import re

import pytest
import torch

import sglang_oobguard
from helpers import SGLANG, Layer, as_write_loc, mha, needs, needs_site, paged_allocator, site_cases, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.targets import version_of_sglang

SIZE = 64


@pytest.fixture(scope="module")
def allocators():
    from sglang.srt.mem_cache import allocator

    return allocator


@pytest.fixture
def tracked(mp, allocators, guard):
    """The guard with liveness on, then a real MHA pool and sglang's token allocator over it."""

    def make(mode: str, backend: str = "auto"):
        guard(mode, backend, liveness=True)
        pool = mha(mp, SIZE)
        return pool, token_allocator(allocators, pool)

    return make


def write(pool, loc, layer=3):
    n = loc.numel()
    k = torch.arange(n * 8, dtype=torch.float32).reshape(n, 2, 4) + 1
    pool.set_kv_buffer(Layer(layer), loc, k, k.clone())


@pytest.fixture(params=["auto", "triton"])
def backend(request):
    """The host scan, and the fused kernels (Triton's interpreter on the CPU)."""
    return request.param


def caught(backend, action):
    """Run `action`; the violation it makes, raised at once (host scan) or at the next
    check point (kernel)."""
    with pytest.raises(KVOutOfBoundsError) as info:
        action()
        sglang_oobguard.check()
    return info.value


def test_write_after_free_is_caught(tracked, backend):
    pool, alloc = tracked("raise", backend)
    loc = alloc.alloc(4)
    write(pool, loc)
    sglang_oobguard.check()
    alloc.free(loc[2:])
    write(pool, loc[:2])  # still held: clean
    sglang_oobguard.check()
    freed = int(loc[2])
    err = caught(backend, lambda: write(pool, loc.clone()))
    assert str(err).startswith(f"set_kv_buffer (MHA) layer 3: loc[2] = {freed} is not allocated (freed) "
                               "(2 of 4 ids bad)")
    assert (err.pos, err.value, err.bad, err.high) == (2, freed, 2, SIZE + 1)


def test_write_to_a_slot_never_handed_out_is_caught_and_slot_zero_is_exempt(mp, allocators, guard):
    guard("strict", liveness=True)
    pool = mha(mp, SIZE)
    token_allocator(allocators, pool)
    write(pool, torch.tensor([0, 0]))  # padding slot 0: CUDA-graph padding rows write here
    with pytest.raises(KVOutOfBoundsError, match=r"layer 3: loc\[1\] = 9 is not allocated \(freed\) \(pool MHATokenToKVPool\)$"):
        write(pool, torch.tensor([0, 9]))


def test_double_free_is_caught_before_the_allocator_takes_it(tracked, backend):
    pool, alloc = tracked("raise", backend)
    loc = alloc.alloc(3)
    alloc.free(loc[1:2])
    free_before = alloc.available_size()
    err = caught(backend, lambda: alloc.free(loc))
    assert str(err).startswith(f"free (TokenToKVPoolAllocator): free_index[1] = {int(loc[1])} "
                               "is not allocated (double free)")
    assert err.pool == "MHATokenToKVPool" and err.layer == -1
    if backend == "auto":  # the host check raises before the free reaches the free list
        assert alloc.available_size() == free_before


def test_alloc_free_realloc_write_is_clean(tracked, backend):
    pool, alloc = tracked("strict", backend)
    for _ in range(3):  # the whole pool, three times round
        loc = alloc.alloc(SIZE)
        write(pool, loc)
        alloc.free(loc[::2])
        alloc.free(loc[1::2])
    loc = alloc.alloc(5)
    write(pool, loc)
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []


def test_a_free_group_holds_slots_live_until_it_ends(tracked):
    pool, alloc = tracked("raise")
    loc = alloc.alloc(4)
    alloc.free_group_begin()
    alloc.free(loc[:2])
    alloc.free(loc[2:])
    write(pool, loc)  # queued, not yet reusable: still live
    alloc.free_group_end()
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(pool, loc[3:])


@pytest.mark.parametrize("page_size", [16])
def test_paged_allocator_tracks_whole_pages(mp, allocators, guard, backend, page_size):
    guard("raise", backend, liveness=True)
    pool = mha(mp, 256, page_size)
    alloc = paged_allocator(allocators, pool)
    loc = alloc.alloc(3 * page_size)
    write(pool, loc)
    alloc.free(loc[:page_size])  # page one goes back
    write(pool, loc[page_size:])
    sglang_oobguard.check()
    err = caught(backend, lambda: write(pool, loc[page_size - 1:page_size + 1].clone()))
    assert str(err).startswith(f"set_kv_buffer (MHA) layer 3: loc[0] = {int(loc[page_size - 1])} is not allocated")
    # a pool's record details its first violation: a fresh pair for the double free
    pool = mha(mp, 256, page_size)
    alloc = paged_allocator(allocators, pool)
    loc = alloc.alloc(2 * page_size)
    alloc.free(loc[page_size:])
    again = caught(backend, lambda: alloc.free(loc[page_size + 3:]))
    assert "free (PagedTokenToKVPoolAllocator): free_index[0]" in str(again) and "(double free)" in str(again)


def test_paged_free_segment_gives_pages_back_at_once_and_at_its_group_s_end(mp, allocators, guard):
    """A request's row freed by segments (release_kv_cache's free_kv_row): 0.5.17-0.5.19's paged
    free_segment releases the pages itself (its own wrapper), later ones through free_page_ids.
    Either way the shadow sees the pages go: written after, reported; handed out again, not a
    double hand-out (0.5.19's engine at page 4 said "handed out again while still allocated"
    before the wrapper, 2026-12-07). In a free group the pages go at the group's end."""
    needs("PagedTokenToKVPoolAllocator.free_segment")
    guard("raise", liveness=True)
    pool = mha(mp, 64, 4)
    alloc = paged_allocator(allocators, pool)
    loc = alloc.alloc(16)
    alloc.free_segment(loc[4:], start_pos=4)  # pages 2-4 of the row
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(pool, loc[8:9])
    write(pool, loc[:4])  # page 1 stays
    again = alloc.alloc(12)  # the three pages come back: no report
    assert sorted(torch.unique(again // 4).tolist()) == sorted(torch.unique(loc[4:] // 4).tolist())
    alloc.free_group_begin()
    alloc.free_segment(again, start_pos=0)
    write(pool, again)  # held by the group: still live
    alloc.free_group_end()
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(pool, again[:1])
    sglang_oobguard.check()


def test_paged_free_page_ids_double_free(mp, allocators, guard):
    needs("PagedTokenToKVPoolAllocator.free_page_ids")
    guard("raise", liveness=True)
    pool = mha(mp, 256, 16)
    alloc = paged_allocator(allocators, pool)
    loc = alloc.alloc(32)
    pages = torch.unique(loc // 16)
    alloc.free_page_ids(pages[:1])
    with pytest.raises(KVOutOfBoundsError, match=rf"free_page_ids \(PagedTokenToKVPoolAllocator\): "
                                                 rf"page_ids\[0\] = {int(pages[0])} is not allocated \(double free\)"):
        alloc.free_page_ids(pages)
    alloc.free_group_begin()
    alloc.free_page_ids(pages[1:])
    write(pool, loc[16:])  # held by the group: still live
    alloc.free_group_end()
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(pool, loc[16:17])


def test_warn_mode_contains_a_write_to_a_freed_slot(tracked, caplog):
    pool, alloc = tracked("warn")
    loc = alloc.alloc(3)
    alloc.free(loc[1:2])
    freed = int(loc[1])
    row_before = pool.k_buffer[3][freed].clone()
    bad = loc.clone()
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        write(pool, bad)
    assert torch.equal(bad, loc)  # the caller's ids are left as they were
    assert torch.equal(pool.k_buffer[3][freed], row_before)  # the freed row is untouched
    assert pool.k_buffer[3][0].abs().sum() > 0  # the write's copy sent that token to padding slot 0
    assert "is not allocated (freed)" in caplog.text


def test_resize_clear_starts_over(tracked):
    pool, alloc = tracked("raise")
    loc = alloc.alloc(4)
    alloc.clear()  # every slot back
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(pool, loc)


def test_off_wraps_no_allocator_and_uninstall_restores_them(mp, allocators, guard):
    cls = allocators.TokenToKVPoolAllocator
    originals = {name: vars(cls)[name] for name in ("alloc", "free", "clear")}
    guard("strict")
    assert all(vars(cls)[name] is fn for name, fn in originals.items())
    pool = mha(mp, SIZE)
    alloc = token_allocator(allocators, pool)
    write(pool, torch.tensor([9]))  # not allocated, but liveness is off: clean
    guard("strict", liveness=True)
    assert all(vars(cls)[name].__wrapped__ is fn for name, fn in originals.items())
    sglang_oobguard.uninstall()
    assert all(vars(cls)[name] is fn for name, fn in originals.items())
    assert alloc.alloc(2) is not None


def test_untracked_allocators_are_named(mp, allocators, guard, caplog):
    from sglang_oobguard.model.discover import pool_classes

    others = {cls.__name__ for cls in pool_classes(allocators.BaseTokenToKVPoolAllocator)[1:]}
    others -= {"TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator",  # and the SWA family (test_swa)
               "SWATokenToKVPoolAllocator", "PureSWATokenToKVPoolAllocator"}
    assert others  # every release has more allocators than the two tracked
    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        guard("strict", liveness=True)
    assert "liveness=on" in caplog.text
    line = next(r.getMessage() for r in caplog.records if "liveness not tracked" in r.getMessage())
    named = set(line.split("pools of ", 1)[1].split(" (bound")[0].split(", "))
    assert named == others


def test_int32_ids_as_the_radix_cache_frees_them(tracked, backend):
    pool, alloc = tracked("raise", backend)
    loc = alloc.alloc(4)
    write(pool, loc.to(torch.int32))
    alloc.free(loc[:2].to(torch.int32))
    sglang_oobguard.check()
    err = caught(backend, lambda: write(pool, loc.to(torch.int32)))
    assert err.pos == 0 and err.value == int(loc[0]) and "is not allocated (freed)" in str(err)


def test_restore_state_gives_back_what_was_handed_out_since_backup(tracked, allocators):
    if not hasattr(allocators.BaseTokenToKVPoolAllocator, "backup_state"):
        pytest.skip(f"backup_state / restore_state do not exist in sglang {SGLANG} (removed in 0.5.17)")
    pool, alloc = tracked("raise")
    kept = alloc.alloc(2)
    saved = alloc.backup_state()
    draft = alloc.alloc(3)  # speculative decoding's draft slots
    write(pool, torch.cat([kept, draft]))
    alloc.restore_state(saved)
    write(pool, kept)
    with pytest.raises(KVOutOfBoundsError, match=rf"loc\[0\] = {int(draft[0])} is not allocated"):
        write(pool, draft)


def test_warn_mode_contains_a_double_free_on_the_host(tracked, caplog):
    """Only the live ids reach the free list, so no slot is ever handed out twice."""
    pool, alloc = tracked("warn")
    loc = alloc.alloc(3)
    alloc.free(loc[1:2])
    before = alloc.available_size()
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        alloc.free(free_index=loc.clone())
    assert alloc.available_size() == before + 2  # loc[0] and loc[2]; loc[1] not again
    assert f"free_index[1] = {int(loc[1])} is not allocated (double free)" in caplog.text
    handed = alloc.alloc(alloc.available_size())
    assert len(set(handed.tolist())) == handed.numel()


def test_a_later_install_turns_liveness_off_and_on_without_stale_shadows(tracked, mp, allocators, monkeypatch):
    cls = allocators.TokenToKVPoolAllocator
    pool, alloc = tracked("raise")
    loc = alloc.alloc(2)
    monkeypatch.setenv("SGLANG_OOBGUARD_LIVENESS", "0")
    sglang_oobguard.install("raise")  # a second install() reconfigures the same guard
    assert not hasattr(vars(cls)["alloc"], "__wrapped__")  # unwrapped
    alloc.free(loc)
    alloc.free(loc)  # no liveness: not checked
    write(pool, torch.tensor([7]))
    monkeypatch.setenv("SGLANG_OOBGUARD_LIVENESS", "1")
    sglang_oobguard.install("raise")
    assert hasattr(vars(cls)["alloc"], "__wrapped__")
    write(pool, torch.tensor([7]))  # the old pool's shadow was dropped: no false report
    fresh = mha(mp, SIZE)
    token_allocator(allocators, fresh)
    with pytest.raises(KVOutOfBoundsError, match="is not allocated"):
        write(fresh, torch.tensor([7]))


@pytest.mark.parametrize("label", list(site_cases(None)))
def test_every_upstream_site_checks_liveness(mp, allocators, guard, label):
    """MHA, MLA (set_mla_kv_buffer's DCP bound is the token-slot bound at span 1) and FP4
    pools alike: a write to a slot the allocator took back is caught before sglang's
    own write code runs."""
    needs_site(mp, label)
    make, method, payload = site_cases(mp)[label]
    guard("raise", liveness=True)
    pool = make()
    alloc = token_allocator(allocators, pool)
    loc = alloc.alloc(2)
    alloc.free(loc[1:])
    with pytest.raises(KVOutOfBoundsError, match=rf"^{re.escape(label)} layer 1: loc\[1\] = {int(loc[1])} "
                                                 r"is not allocated \(freed\)"):
        getattr(pool, method)(Layer(1), as_write_loc(mp, loc.clone()), *payload(2))


def test_freeing_the_padding_slot_is_reported(tracked, backend):
    """Slot 0 may be written (padding rows) but is never handed out, so never freed."""
    pool, alloc = tracked("raise", backend)
    err = caught(backend, lambda: alloc.free(torch.tensor([0])))
    assert "free_index[0] = 0 is not allocated (double free)" in str(err)


def test_an_id_freed_twice_in_one_call_is_a_double_free(tracked, backend):
    """free(tensor([s, s])) would put s on the free list twice: two requests, one slot."""
    pool, alloc = tracked("raise", backend)
    loc = alloc.alloc(3)
    twice = torch.stack([loc[1], loc[0], loc[1]])
    err = caught(backend, lambda: alloc.free(twice))
    assert f"free_index[2] = {int(loc[1])} is not allocated (double free)" in str(err)


@pytest.fixture
def paged(mp, allocators, guard):
    """The guard with liveness on, then a real paged MHA pool (page 4) and sglang's paged allocator."""

    def make(mode: str, backend: str):
        guard(mode, backend, liveness=True)
        pool = mha(mp, SIZE, page_size=4)
        return pool, paged_allocator(allocators, pool)

    return make


def test_paged_token_free_takes_a_page_back_once_and_catches_it_twice(paged, backend):
    """Several token ids of one page in one free are that page given back once (clean);
    a token of the same page in a later free is a double free."""
    pool, alloc = paged("raise", backend)
    loc = alloc.alloc(8)  # two whole pages
    alloc.free(loc[:4])  # four tokens of the first page, one call: clean
    sglang_oobguard.check()
    alloc.free(loc[4:8])
    sglang_oobguard.check()
    err = caught(backend, lambda: alloc.free(loc[1:2]))
    assert f"free_index[0] = {int(loc[1])} is not allocated (double free)" in str(err)


def test_a_page_id_freed_twice_in_one_call_is_a_double_free(mp, allocators, paged, backend):
    if not hasattr(allocators.PagedTokenToKVPoolAllocator, "free_page_ids"):
        pytest.skip(f"sglang {version_of_sglang()} has no PagedTokenToKVPoolAllocator.free_page_ids")
    pool, alloc = paged("raise", backend)
    page = int(alloc.alloc(4)[0]) // 4
    err = caught(backend, lambda: alloc.free_page_ids(torch.tensor([page, page])))
    assert f"page_ids[1] = {page} is not allocated (double free)" in str(err)


def allocator_over(cls, kvcache, page_size=None):
    """sglang's allocator class built as sglang's own unit tests build it, over any kvcache."""
    import inspect

    given = dict(size=SIZE, page_size=page_size, dtype=torch.float16, device="cpu", kvcache=kvcache, need_sort=False)
    params = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in given.items() if k in params and v is not None or k == "kvcache"})


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
@pytest.mark.parametrize("kvcache", ["None", "MagicMock", "plain object"])
def test_allocators_over_a_mock_kvcache_are_left_untracked_and_work(allocators, guard, backend, mode, kvcache, caplog):
    """sglang's own allocator tests build allocators over `kvcache=None`, `MagicMock()`
    or a plain object without `size`: with liveness on they run exactly as unguarded,
    and the log names them."""
    from unittest.mock import MagicMock

    guard(mode, backend, liveness=True)
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        for cls, page_size in ((allocators.TokenToKVPoolAllocator, None), (allocators.PagedTokenToKVPoolAllocator, 4)):
            pool = {"None": None, "MagicMock": MagicMock(), "plain object": object()}[kvcache]
            alloc = allocator_over(cls, pool, page_size)
            loc = alloc.alloc(8)
            alloc.free(loc)
            alloc.free(alloc.alloc(4))
        sglang_oobguard.check()
    assert sglang_oobguard.violations() == []
    named = [r.getMessage() for r in caplog.records if "liveness not tracked for a" in r.getMessage()]
    for cls in ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator"):
        assert any(f"for a {cls}: its kvcache is a" in line and "not a sglang.srt.mem_cache.memory_pool.KVCache" in line
                   for line in named), named
