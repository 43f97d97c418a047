"""Sliding-window pools on the CPU: the real SWAKVPool and SWATokenToKVPoolAllocator (page 1
and 4), PureSWATokenToKVPoolAllocator, and DeepSeek-V4's leaf pools. Both id spaces are
bounded and tracked; every report names the SWA pool, the id space and the model's layer."""

from __future__ import annotations

import inspect
import re

import pytest
import torch

import sglang_oobguard
from helpers import Layer, model_runner_class, needs, swa_allocator, swa_pool
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.checks import swa as swa_check

FULL, SWA = r"\(pool SWAKVPool\.full_kv_pool \(full ids\)\)", r"\(pool SWAKVPool\.swa_kv_pool \(SWA ids\)\)"
DOOR = SWA[:-2] + r" at SWAKVPool's door\)"
PAGES = pytest.mark.parametrize("page_size", [1, 4])


@pytest.fixture
def swa(guard):
    """The guard (liveness on), then a real SWAKVPool and its SWA allocator."""
    needs("SWATokenToKVPoolAllocator", "KVWriteLoc")

    def make(mode: str, page_size: int):
        guard(mode, liveness=True)
        pool = swa_pool(page_size)
        return pool, swa_allocator(pool)

    return make


def alloc(allocator, n: int) -> torch.Tensor:
    """n fresh full slots (their SWA peers mapped): alloc at page 1, alloc_extend of a new request else."""
    if allocator.page_size == 1:
        return allocator.alloc(n)
    one = torch.tensor([0])
    return allocator.alloc_extend(one, one, torch.tensor([n]), torch.tensor([n]), torch.tensor([-1]), n)


def write(pool, allocator, loc: torch.Tensor, layer: int, swa_loc=None) -> None:
    """Layer `layer`'s K/V at full slots `loc`, as the attention backend passes them
    (KVWriteLoc with the SWA translation sglang computes once per forward)."""
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    k = torch.ones(loc.numel(), 2, 4)
    translated = allocator.translate_loc_from_full_to_swa(loc) if swa_loc is None else swa_loc
    pool.set_kv_buffer(Layer(layer), KVWriteLoc(loc, swa_loc=translated), k, k)


def raised(pattern: str, action) -> KVOutOfBoundsError:
    with pytest.raises(KVOutOfBoundsError) as info:
        action()
    history = info.value.history()  # the slot's history (liveness) follows what the pattern reads
    described = info.value.described()
    assert re.search(pattern, described.removesuffix(f"; {history}") if history else described), described
    return info.value


@PAGES
def test_a_clean_life_of_both_id_spaces_is_silent(swa, page_size):
    pool, allocator = swa("strict", page_size)
    for _ in range(3):  # the SWA pool round several times: ids churn
        loc = alloc(allocator, 8)
        for layer in range(4):
            write(pool, allocator, loc, layer)
        allocator.free_swa(loc[:page_size])  # the first page left the window
        write(pool, allocator, loc[page_size:], 0)
        allocator.free_full(loc[:page_size])
        allocator.free(loc[page_size:])
    assert sglang_oobguard.violations() == []


@PAGES
def test_ids_past_either_sub_pool_name_the_pool_the_id_space_and_the_model_layer(swa, page_size):
    pool, allocator = swa("raise", page_size)
    loc = alloc(allocator, 4)
    past = allocator.translate_loc_from_full_to_swa(loc)
    past[0] = 40
    raised(rf"layer 2: .*\[0, {32 + page_size}\): loc\[0\] = 40 {SWA}", lambda: write(pool, allocator, loc, 2, swa_loc=past))
    raised(rf"layer 2: .*\[0, {64 + page_size}\): loc\[0\] = 90 \(pool SWAKVPool \(full ids\)\)",
           lambda: write(pool, allocator, torch.tensor([90]), 2, swa_loc=torch.tensor([1])))
    raised(rf"layer 3: .*\[0, {64 + page_size}\): loc\[1\] = 80 ",
           lambda: write(pool, allocator, torch.tensor([1, 80]), 3, swa_loc=torch.tensor([1, 1])))


@PAGES
def test_a_write_to_an_swa_slot_that_left_the_window_is_caught(swa, page_size):
    pool, allocator = swa("raise", page_size)
    loc = alloc(allocator, 2 * page_size)
    swa_loc = allocator.translate_loc_from_full_to_swa(loc)
    allocator.free_swa(loc[:page_size])
    write(pool, allocator, loc, 1)  # a full layer: its slots are still held
    stale = rf"loc\[0\] = {int(swa_loc[0])} is not this token's SWA slot \(its full slot has none: it left the window"
    raised(rf"^set_kv_buffer \(SWAKVPool\) swa_loc layer 2: {stale}.*{DOOR}$",  # a stale translation, at the door
           lambda: write(pool, allocator, loc, 2, swa_loc=swa_loc))
    raised(rf"^set_kv_buffer \(MHA\) layer 2: loc\[0\] = {int(swa_loc[0])} is not allocated \(freed\) .*{SWA}$",
           lambda: pool.swa_kv_pool.set_kv_buffer(None, swa_loc, torch.ones(2 * page_size, 2, 4),  # behind the door
                                                  torch.ones(2 * page_size, 2, 4), layer_id_override=1))


@PAGES
def test_a_double_free_names_the_full_ids_and_nothing_reaches_a_free_list(swa, page_size):
    pool, allocator = swa("raise", page_size)
    loc = alloc(allocator, page_size)
    allocator.free(loc)
    sizes = (allocator.full_available_size(), allocator.swa_available_size())
    raised(rf"^free \(SWATokenToKVPoolAllocator\): free_index\[0\] = {int(loc[0])} is not allocated \(double free\)"
           rf".* {FULL}$", lambda: allocator.free(loc))
    assert (allocator.full_available_size(), allocator.swa_available_size()) == sizes


def test_a_double_free_within_one_call_names_the_id_freed_twice(swa):
    pool, allocator = swa("raise", 1)
    loc = alloc(allocator, 3)
    twice = torch.tensor([int(loc[1]), int(loc[2]), int(loc[1])])
    raised(rf"free_index\[2\] = {int(loc[1])} is not allocated \(double free\).* {FULL}",
           lambda: allocator.free(twice))


def test_an_swa_slot_freed_twice_is_caught_before_slot_zero_reaches_the_swa_free_list(swa):
    pool, allocator = swa("raise", 1)
    loc = alloc(allocator, 3)
    allocator.free_swa(loc[:2])
    if swa_check.PEERS_READ:  # 0.5.20+: sglang's free reads every peer
        raised(rf"^free_swa \(SWATokenToKVPoolAllocator\): free_index\[0\] = {int(loc[0])} has no SWA slot mapped: "
               rf"its SWA peer was freed already \(SWA double free.* {FULL}$", lambda: allocator.free_swa(loc))
    else:  # before, its free_swa drops the peers already gone (a peer that left the window): sglang's own
        allocator.free_swa(loc)
        assert sglang_oobguard.violations() == []
    assert 0 not in allocator.swa_attn_allocator.free_pages.tolist()


def test_an_swa_segment_freed_twice_names_its_page(swa):
    pool, allocator = swa("raise", 4)
    loc = alloc(allocator, 8)
    allocator.free_swa_segment(loc[:4], start_pos=0)
    raised(rf"free_swa_segment .*free_index\[0\] = {int(loc[0])} has no SWA slot mapped",
           lambda: allocator.free_swa_segment(loc[:4], start_pos=0))


@PAGES
def test_free_full_of_a_slot_whose_swa_slot_is_still_mapped_names_the_leaking_swa_slot(swa, page_size):
    pool, allocator = swa("raise", page_size)
    loc = alloc(allocator, page_size)
    peer = int(allocator.translate_loc_from_full_to_swa(loc)[0])
    raised(rf"^free_full \(SWATokenToKVPoolAllocator\): free_index\[0\] = {int(loc[0])} is freed while its SWA slot "
           rf"{peer} is still mapped \(that SWA slot would leak\).* {FULL}$", lambda: allocator.free_full(loc))


@PAGES
def test_a_live_swa_page_put_back_on_the_free_list_is_caught_when_handed_out_again(swa, page_size):
    """The fault: a live SWA page goes back on the SWA free list behind the guard's back
    (as sglang's double-free bugs do); the next request gets it while the first holds it."""
    pool, allocator = swa("raise", page_size)
    first = alloc(allocator, page_size)
    held = allocator.translate_loc_from_full_to_swa(first)
    sub = allocator.swa_attn_allocator
    page = held[:1] if page_size == 1 else held[:1] // page_size
    sub.free_pages = torch.cat([page.to(sub.free_pages.dtype), sub.free_pages])  # behind the guard's back
    method = "alloc" if page_size == 1 else "alloc_extend"
    raised(rf"^{method} \((Paged)?TokenToKVPoolAllocator\): handed_out\[0\] = {int(held[0])} is handed out again "
           rf"while still allocated .*{SWA}$", lambda: alloc(allocator, page_size))


def test_warn_mode_contains_a_double_free_so_no_free_list_takes_a_slot_twice(swa):
    pool, allocator = swa("warn", 1)
    loc = alloc(allocator, 4)
    allocator.free(loc[:2])
    allocator.free(loc)  # reported; only loc[2:] go back
    [violation] = sglang_oobguard.violations()
    assert (violation.kind, violation.value, violation.pool) == ("double_free", int(loc[0]),
                                                                "SWAKVPool.full_kv_pool (full ids)")
    for sub in (allocator.full_attn_allocator, allocator.swa_attn_allocator):
        free = sub.free_pages.tolist()
        assert len(free) == len(set(free)) and 0 not in free
    assert allocator.full_available_size() == 64 and allocator.swa_available_size() == 32


def test_pure_swa_allocator_tracks_its_one_id_space(guard):
    needs("PureSWATokenToKVPoolAllocator", "KVWriteLoc")
    from sglang.srt.mem_cache.allocator.swa import PureSWATokenToKVPoolAllocator

    guard("raise", liveness=True)
    pool = swa_pool(1, size=32, full_layers=())
    allocator = PureSWATokenToKVPoolAllocator(32, 1, torch.float32, "cpu", pool, False)
    loc = allocator.alloc(3)
    write(pool, allocator, loc, 1)
    allocator.free(loc[:1])
    raised(rf"layer 1: loc\[0\] = {int(loc[0])} is not allocated \(freed\) {SWA}",
           lambda: write(pool, allocator, loc, 1))
    raised(r"free \(TokenToKVPoolAllocator\): free_index\[0\] = .* \(double free\)", lambda: allocator.free(loc))


@pytest.mark.parametrize("method", ["set_key_buffer_fused", "set_index_fused", "set_index_k_scale_buffer"])
def test_deepseek_v4_leaf_pools_bound_their_token_ids_before_sglang_writes(guard, method):
    """Their rows: ceil((size + global_page_size) / page_size) pages of page_size tokens
    (deepseek_v4_memory_pool._num_dsv4_physical_kv_pages); sglang's own write kernels are
    CUDA ones, so the id past the rows must be refused before sglang is reached."""
    needs("DeepSeekV4SingleKVPool")
    from sglang.srt.mem_cache import deepseek_v4_memory_pool as dsv4

    guard("raise")
    if method == "set_key_buffer_fused":
        pool, payload = dsv4.DeepSeekV4SingleKVPool(64, 64, torch.float8_e4m3fn, 448, 64, 1, "cpu", False), ()
    else:
        takes_fp4 = "use_fp4_indexer" in inspect.signature(dsv4.DeepSeekV4IndexerPool).parameters  # later releases
        pool = dsv4.DeepSeekV4IndexerPool(64, 64, torch.float8_e4m3fn, 128, 1, "cpu", False,
                                          **({"use_fp4_indexer": False} if takes_fp4 else {}))
        payload = () if method == "set_index_fused" else (torch.zeros(1),)
    rows = 128  # ceil((64 + 64) / 64) pages of 64
    with pytest.raises(KVOutOfBoundsError, match=rf"{method} \({type(pool).__name__}\) layer 0: 1 of 1 slot ids "
                                                 rf"outside \[0, {rows}\): loc\[0\] = {rows}"):
        getattr(pool, method)(0, torch.tensor([rows]), torch.zeros(1, 512), *payload)


@PAGES
def test_an_swa_layer_writing_another_tokens_swa_slot_is_caught_at_the_door(swa, page_size):
    """The step's SWA ids must be the translation of its own full slots: a stale or
    crossed translation writes another request's SWA rows, which the SWA shadow calls live."""
    pool, allocator = swa("raise", page_size)
    mine, other = alloc(allocator, page_size), alloc(allocator, page_size)
    theirs = allocator.translate_loc_from_full_to_swa(other)
    own = allocator.translate_loc_from_full_to_swa(mine)
    write(pool, allocator, mine, 1, swa_loc=theirs)  # a full layer: its SWA ids are not read
    raised(rf"^set_kv_buffer \(SWAKVPool\) swa_loc layer 2: loc\[0\] = {int(theirs[0])} is not this token's SWA slot "
           rf"\(its full slot maps to {int(own[0])}\).* {DOOR}$", lambda: write(pool, allocator, mine, 2, swa_loc=theirs))


def test_two_tokens_of_one_write_on_one_swa_slot_are_caught_and_warn_contains_them(swa):
    pool, allocator = swa("warn", 1)
    loc = alloc(allocator, 3)
    swa_loc = allocator.translate_loc_from_full_to_swa(loc)
    twin = swa_loc.clone()
    twin[2] = twin[0]
    allocator.full_to_swa_index_mapping[loc[2]] = twin[0]  # the mapping itself crossed: the translation agrees
    before = pool.swa_kv_pool.k_buffer[1][int(swa_loc[0])].clone()
    write(pool, allocator, loc, 2, swa_loc=twin)
    [violation] = sglang_oobguard.violations()
    assert (violation.label, violation.kind, violation.pos, violation.value, violation.layer) == (
        "set_kv_buffer (SWAKVPool) swa_loc", "duplicate", 2, int(swa_loc[0]), 2)
    assert violation.pool == "SWAKVPool.swa_kv_pool (SWA ids) at SWAKVPool's door"
    assert torch.equal(pool.swa_kv_pool.k_buffer[1][int(swa_loc[0])], torch.ones(2, 4))  # token 0's own write
    assert not torch.equal(before, torch.ones(2, 4))


# -- both requests of a bad free, hand-out or SWA write (checks.claims, the door's owner) ----------


@pytest.fixture
def served(swa, monkeypatch):
    """A real SWAKVPool and allocator, and sglang's ModelRunner (not loaded) with the guard's
    step hook over an empty model loop: `admit` puts a real Req on a req_to_token row,
    `step` runs one decode forward of the admitted requests, or of the rows `only` (the guard
    learns their rids)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.sampling.sampling_params import SamplingParams

    ModelRunner = model_runner_class()

    def make(mode: str, page_size: int):
        pool, allocator = swa(mode, page_size)  # the guard on: its step hook wraps forward
        monkeypatch.setattr(ModelRunner.__dict__["forward"], "__wrapped__", lambda self, batch, *a, **k: "output")
        run = ModelRunner.__new__(ModelRunner)
        run.token_to_kv_pool, run.tp_rank, run.pp_rank, run.dp_rank, run.is_draft_worker = pool, 0, 0, 0, False
        run.token_to_kv_pool_allocator = allocator  # sglang's ModelRunner holds both
        run.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
        run.req_to_token_pool.req_to_token.zero_()
        reqs: dict[int, Req] = {}

        def admit(row: int, rid: str, n: int) -> tuple[Req, torch.Tensor]:
            loc = alloc(allocator, n)
            run.req_to_token_pool.req_to_token[row, :n] = loc.to(torch.int32)
            reqs[row] = req = Req(rid, "", [1] * n, SamplingParams())
            if hasattr(req, "kv"):  # ReqKvInfo: the row sglang's out-of-window free reads
                req.kv.req_pool_idx = row
            return req, loc

        def step(only: tuple = ()) -> None:
            rows = sorted(only or reqs)
            lens = [int((run.req_to_token_pool.req_to_token[row] != 0).sum()) for row in rows]
            rpi, seq = torch.tensor(rows), torch.tensor(lens)
            batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows),
                                 input_ids=torch.zeros(len(rows), dtype=torch.int64), req_pool_indices=rpi,
                                 seq_lens=seq, out_cache_loc=run.req_to_token_pool.req_to_token[rpi, seq - 1].long(),
                                 seq_lens_sum=sum(lens))
            batch.seq_lens_cpu, batch.rids = seq.clone(), [reqs[row].rid for row in rows]
            run.forward(batch)

        return pool, allocator, run, admit, step

    return make


def evict_out_of_window(run, allocator, req, page_size: int, seq_len: int) -> None:
    """sglang's own out-of-window SWA free for `req` (mem_cache.common), window 1."""
    needs("free_swa_out_of_window_slots", "ReqKvInfo")
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

    free_swa_out_of_window_slots(req, seq_len, sliding_window_size=1, page_size=page_size,
                                 req_to_token_pool=run.req_to_token_pool, token_to_kv_pool_allocator=allocator,
                                 supports_prefix_sharing=False)


@PAGES
def test_an_swa_double_free_names_the_request_that_held_the_slot_and_the_one_the_free_is_for(served, page_size):
    """rA's SWA page leaves the window (sglang's free for rA); then rB's req_to_token row names rA's
    page (a crossed row) and sglang frees rB's out-of-window slots: rA's page again."""
    pool, allocator, run, admit, step = served("raise", page_size)
    a, a_loc = admit(1, "rA", 2 * page_size)
    b, b_loc = admit(2, "rB", 2 * page_size)
    step()
    evict_out_of_window(run, allocator, a, page_size, 2 * page_size)
    run.req_to_token_pool.req_to_token[2, :page_size] = a_loc[:page_size].to(torch.int32)
    first = int(a_loc[0])
    raised(rf"^free_swa_segment \(SWATokenToKVPoolAllocator\): free_index\[0\] = {first} has no SWA slot mapped: "
           rf"its SWA peer was freed already .*\); slot {first} is held by request rA token 0; the free is for "
           rf"request rB {FULL}$", lambda: evict_out_of_window(run, allocator, b, page_size, 2 * page_size))


@PAGES
def test_a_double_free_and_a_leaking_free_full_name_the_holder_and_say_the_free_has_no_request(served, page_size):
    """Called with no request among its callers (as a tool behind the scheduler would), the
    report names the holder and says the other request is not known."""
    pool, allocator, run, admit, step = served("raise", page_size)
    _, loc = admit(1, "rA", 2 * page_size)
    step()
    allocator.free(loc[:page_size])
    unknown = "the request the free is for is not known \\(none of its callers passes one\\)"
    raised(rf"^free \(SWATokenToKVPoolAllocator\): free_index\[0\] = {int(loc[0])} is not allocated \(double free\)"
           rf"(.*ids bad\))?; slot {int(loc[0])} is held by request rA token 0; {unknown} {FULL}$",
           lambda: allocator.free(loc[:page_size]))
    leak = raised(rf"^free_full .*is still mapped \(that SWA slot would leak\)( \(\d+ of \d+ ids bad\))?; slot "
                  rf"{int(loc[page_size])} is held by "
                  rf"request rA token {page_size}; {unknown} {FULL}$", lambda: allocator.free_full(loc[page_size:]))
    assert (leak.violation.owner, leak.violation.request, leak.violation.claimed) == ("rA", None, True)


def test_before_any_step_a_double_free_says_neither_request_is_known(swa):
    pool, allocator = swa("raise", 1)
    loc = alloc(allocator, 2)
    allocator.free(loc)
    raised(rf"double free\).*; the request holding slot {int(loc[0])} is not known \(no forward step's req_to_token "
           rf"names it\); the request the free is for is not known", lambda: allocator.free(loc))


def hand_out_for(batch, allocator, n: int) -> torch.Tensor:
    """An allocation for `batch` (a ScheduleBatch), as sglang's alloc_for_decode makes it: the
    batch in a local named `batch`, its requests in out_cache_loc's order."""
    return alloc(allocator, n)


@PAGES
def test_a_live_swa_page_handed_out_names_its_holder_and_the_request_it_is_handed_to(served, page_size):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    pool, allocator, run, admit, step = served("raise", page_size)
    allocator.swa_attn_allocator.alloc(page_size)  # the SWA ids one page ahead of the full ones: rA's SWA page
    a, a_loc = admit(1, "rA", page_size)  # has rB's full ids, so only the mapping finds its holder
    b, _ = admit(2, "rB", page_size)
    step()
    held = allocator.translate_loc_from_full_to_swa(a_loc)
    assert int(held[0]) != int(a_loc[0])
    sub = allocator.swa_attn_allocator
    page = held[:1] if page_size == 1 else held[:1] // page_size
    sub.free_pages = torch.cat([page.to(sub.free_pages.dtype), sub.free_pages])  # behind the guard's back
    batch = ScheduleBatch.__new__(ScheduleBatch)  # not built: only what an allocation's caller holds
    batch.reqs, batch.forward_mode = [b], ForwardMode.DECODE
    method = "alloc" if page_size == 1 else "alloc_extend"
    raised(rf"^{method} \((Paged)?TokenToKVPoolAllocator\): handed_out\[0\] = {int(held[0])} is handed out again "
           rf"while still allocated \(a live slot went back on the free list\); slot {int(held[0])} is held by "
           rf"request rA token 0; the hand-out is for request rB {SWA}$",
           lambda: hand_out_for(batch, allocator, page_size))


@PAGES
def test_the_door_names_the_request_whose_swa_slot_another_token_writes(served, page_size):
    """Issue #31 item 3: a token's SWA id that is another request's SWA slot names both."""
    pool, allocator, run, admit, step = served("raise", page_size)
    _, mine = admit(1, "rA", page_size)
    _, other = admit(2, "rB", page_size)
    step()
    theirs = allocator.translate_loc_from_full_to_swa(other)
    info = raised(rf"^set_kv_buffer \(SWAKVPool\) swa_loc layer 2: loc\[0\] = {int(theirs[0])} is not this token's "
                  rf"SWA slot \(its full slot maps to \d+\); slot {int(theirs[0])} is held by request rB token 0",
                  lambda: write(pool, allocator, mine, 2, swa_loc=theirs))
    assert (info.violation.owner, info.violation.owner_token) == ("rB", 0)


def test_warn_mode_contains_a_segment_freed_twice_to_its_good_pages(swa):
    """A segment free keeps its contract (whole pages from a page-aligned start): the page
    freed already is left out, the other page goes back, nothing reaches a free list twice."""
    pool, allocator = swa("warn", 4)
    loc = alloc(allocator, 8)
    allocator.free_swa_segment(loc[:4], start_pos=0)
    before = allocator.swa_available_size()
    allocator.free_swa_segment(loc, start_pos=0)  # page 1 again (reported), page 2 for the first time
    [violation] = sglang_oobguard.violations()
    assert (violation.kind, violation.value, violation.label) == ("unmapped", int(loc[0]),
                                                                 "free_swa_segment (SWATokenToKVPoolAllocator)")
    assert allocator.swa_available_size() == before + 4
    free = allocator.swa_attn_allocator.free_pages.tolist()
    assert len(free) == len(set(free)) and 0 not in free
    assert not allocator.full_to_swa_index_mapping[loc].any()


# -- the step's owner and read checks, through the full sub-pool's shadow (req_to_token holds full ids) ----


@PAGES
def test_the_read_check_runs_on_an_swa_model_and_names_the_reader_of_a_freed_full_slot(served, page_size):
    """rA's first page goes back (full and SWA) while rA still reads it: the next step's
    read check finds it in the full sub-pool's shadow."""
    pool, allocator, run, admit, step = served("raise", page_size)
    _, a_loc = admit(1, "rA", 2 * page_size)
    step()
    allocator.free(a_loc[:page_size])  # the fault: an eviction under its running request
    info = raised(rf"^req_to_token \(read check\): .*slot {int(a_loc[0])} .*{FULL}", step)
    v = info.violation
    assert (v.kind, v.request, v.token, v.value) == ("read_freed", "rA", 0, int(a_loc[0]))


@PAGES
def test_the_owner_check_runs_on_an_swa_model_and_catches_a_twin_the_tables_agree_on(served, page_size):
    """rA's last entry is rewritten to rB's slot (the write map agrees: req_to_token says so);
    rB wrote it first, so the full sub-pool's owner table says rB's."""
    pool, allocator, run, admit, step = served("raise", page_size)
    admit(1, "rA", page_size)
    _, b_loc = admit(2, "rB", page_size)
    step(only=(2,))  # rB writes its last slot: it owns that page
    slot = int(b_loc[-1])
    run.req_to_token_pool.req_to_token[1, page_size - 1] = slot
    info = raised(rf"is owned by another running request.*{FULL}", lambda: step(only=(1,)))
    v = info.violation
    assert (v.kind, v.value, v.request, v.owner) == ("owned", slot, "rA", "req_to_token row 2")  # rB: not in the batch


@PAGES
def test_an_swa_page_freed_twice_through_a_stale_mapping_names_both_requests(served, page_size):
    """rA's SWA page leaves the window; a stale mapping still sends rA's full page to it, and
    rB's row names that full page: sglang's out-of-window free for rB passes the SWA-level
    check (the peer reads as mapped) and frees the SWA page again in the SWA sub-allocator,
    after sglang cleared the mapping. The report names the holder through the full ids the
    free began with, and the request the free is for."""
    pool, allocator, run, admit, step = served("raise", page_size)
    a, a_loc = admit(1, "rA", 2 * page_size)
    b, _ = admit(2, "rB", 2 * page_size)
    step()
    swa_a = allocator.translate_loc_from_full_to_swa(a_loc[:page_size]).clone()
    evict_out_of_window(run, allocator, a, page_size, 2 * page_size)
    allocator.full_to_swa_index_mapping[a_loc[:page_size]] = swa_a  # the stale mapping
    run.req_to_token_pool.req_to_token[2, :page_size] = a_loc[:page_size].to(torch.int32)
    page = int(swa_a[0]) // page_size
    info = raised(rf"^free_page_ids \((Paged)?TokenToKVPoolAllocator\): page_ids\[0\] = {page} is not allocated "
                  rf"\(double free\).*; page {page} is held by request rA token 0; the free is for request rB {SWA}$",
                  lambda: evict_out_of_window(run, allocator, b, page_size, 2 * page_size))
    assert (info.violation.owner, info.violation.request, info.violation.claimed) == ("rA", "rB", True)
