"""The guard on the real MHATokenToKVPool (sglang 0.5.23, CPU): what lands, what is
rejected, and what each mode does with a bad id."""

from __future__ import annotations

import logging

import pytest
import torch

import sglang_oobguard
from helpers import Layer, mha, needs
from sglang_oobguard import KVOutOfBoundsError

HIGH = 65  # size 64 + page_size 1


def write(pool, loc, layer=3):
    n = getattr(loc, "loc", loc).numel()
    k = torch.arange(n * 8, dtype=torch.float32).reshape(n, 2, 4) + 1
    pool.set_kv_buffer(Layer(layer), loc, k, k.clone())
    return k


def snapshot(pool):
    return [t.clone() for t in pool.k_buffer + pool.v_buffer]


def test_unguarded_minus_one_silently_overwrites_the_last_row(mp):
    pool = mha(mp)
    write(pool, torch.tensor([5, -1]), layer=0)
    assert pool.k_buffer[0][HIGH - 1].abs().sum() > 0  # the damage the guard prevents


def test_unguarded_too_high_id_crashes_inside_the_write(mp):
    with pytest.raises(IndexError):
        write(mha(mp), torch.tensor([HIGH + 2]), layer=0)


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_valid_writes_land_exactly_as_unguarded(mp, guard, backend, dtype):
    loc = torch.tensor([0, 1, 17, HIGH - 1], dtype=dtype)
    plain = mha(mp)
    write(plain, loc.to(torch.int64))
    guard("strict", backend)
    guarded = mha(mp)
    write(guarded, loc)
    sglang_oobguard.check()
    for a, b in zip(snapshot(plain), snapshot(guarded)):
        assert torch.equal(a, b)
    assert sglang_oobguard.violations() == []


@pytest.mark.parametrize("bad", [HIGH, HIGH + 1, 10**9, -1, -(2**31)])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_strict_rejects_before_any_write(mp, guard, bad, dtype):
    guard("strict")
    pool = mha(mp)
    before = snapshot(pool)
    loc = torch.tensor([2, 9, bad, 4], dtype=dtype)
    with pytest.raises(KVOutOfBoundsError) as info:
        write(pool, loc)
    err = info.value
    assert (err.label, err.pool, err.layer) == ("set_kv_buffer (MHA)", "MHATokenToKVPool", 3)
    assert (err.low, err.high, err.bad, err.numel, err.pos, err.value) == (0, HIGH, 1, 4, 2, bad)
    assert str(err).startswith(f"set_kv_buffer (MHA) layer 3: 1 of 4 slot ids outside [0, {HIGH}): loc[2] = {bad}")
    assert isinstance(err, IndexError)
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


def test_message_reads_as_documented(mp, guard):
    guard("raise")
    pool = mp.MHATokenToKVPool(65536, 1, torch.float32, 1, 1, 4, "cpu", False)
    loc = torch.arange(512)
    loc[17], loc[300] = 70001, 65537
    with pytest.raises(KVOutOfBoundsError, match=r"^set_kv_buffer \(MHA\) layer 3: 2 of 512 slot ids "
                       r"outside \[0, 65537\): loc\[17\] = 70001"):
        pool.set_kv_buffer(Layer(3), loc, torch.zeros(512, 1, 1), torch.zeros(512, 1, 1))


def test_non_contiguous_loc(mp, guard):
    guard("raise")
    base = torch.tensor([[1, 100], [2, 100], [HIGH, 100]])
    loc = base[:, 0]
    assert not loc.is_contiguous()
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[2\] = 65"):
        write(mha(mp), loc)


def test_empty_loc_passes_through(mp, guard):
    guard("strict")
    pool = mha(mp)
    before = snapshot(pool)
    write(pool, torch.tensor([], dtype=torch.int64))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


def test_page_size_16_bounds(mp, guard):
    guard("raise")
    pool = mha(mp, size=64, page_size=16)
    write(pool, torch.tensor([0, 16, 79]))  # 79 = size + page_size - 1: the last row
    with pytest.raises(KVOutOfBoundsError, match=r"outside \[0, 80\): loc\[1\] = 80"):
        write(pool, torch.tensor([16, 80]))


def test_kv_write_loc_is_checked_and_the_same_object_reaches_sglang(mp, guard, monkeypatch):
    needs("KVCache._check_physical_write_loc", "KVWriteLoc.physical")
    guard("raise")
    pool = mha(mp)
    seen = []
    real = mp.KVCache._check_physical_write_loc
    monkeypatch.setattr(mp.KVCache, "_check_physical_write_loc",
                        lambda self, loc_info, where: seen.append(loc_info) or real(self, loc_info, where))
    info = mp.KVWriteLoc(torch.tensor([1, 2]), physical=True)
    write(pool, info)
    assert seen == [info] and seen[0] is info and seen[0].physical
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[1\] = 66"):
        write(pool, mp.KVWriteLoc(torch.tensor([1, 66])))
    assert len(seen) == 1  # rejected before sglang saw it


def loc_name(mp) -> str:
    """`loc_info` from 0.5.16, `loc` before."""
    import inspect

    return list(inspect.signature(mp.MHATokenToKVPool.set_kv_buffer).parameters)[2]


def test_loc_by_keyword(mp, guard):
    guard("raise")
    pool = mha(mp)
    k = torch.zeros(1, 2, 4)
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[0\] = -1"):
        pool.set_kv_buffer(layer=Layer(0), cache_k=k, cache_v=k, **{loc_name(mp): torch.tensor([-1])})


def test_layer_id_override_names_the_layer(mp, guard):
    guard("raise")
    pool = mha(mp)
    k = torch.zeros(1, 2, 4)
    with pytest.raises(KVOutOfBoundsError, match=r"layer 1:"):
        pool.set_kv_buffer(None, torch.tensor([99]), k, k, layer_id_override=1)


def test_raise_mode_raises_at_once_on_cpu(mp, guard):
    guard("raise")
    pool = mha(mp)
    before = snapshot(pool)
    with pytest.raises(KVOutOfBoundsError):
        write(pool, torch.tensor([1, HIGH]))
    assert all(torch.equal(a, b) for a, b in zip(before, snapshot(pool)))


def test_warn_mode_contains_to_slot_0_and_logs_once_then_rate_limits(mp, guard, caplog, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_WARN_INTERVAL_S", "3600")
    guard("warn")
    pool = mha(mp)
    before = snapshot(pool)
    caplog.set_level(logging.WARNING, logger="sglang_oobguard")
    loc = torch.tensor([7, -1, 8, HIGH + 5])
    k = write(pool, loc)
    # every row other than slot 0 and the valid targets 7 and 8 is untouched
    after = snapshot(pool)
    for b, a in zip(before, after):
        assert torch.equal(b[1:7], a[1:7]) and torch.equal(b[9:], a[9:])
    assert torch.equal(pool.k_buffer[3][7], k[0]) and torch.equal(pool.k_buffer[3][8], k[2])
    for _ in range(5):
        write(pool, torch.tensor([HIGH]))
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_oobguard" and "bad KV slot ids" in r.getMessage()]
    assert len(lines) == 1 and "loc[1] = -1" in lines[0] and "pool MHATokenToKVPool" in lines[0]
    (v,) = sglang_oobguard.violations()
    assert (v.total_bad, v.calls) == (7, 6)


def test_warn_mode_logs_running_totals_after_the_interval(mp, guard, caplog, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_WARN_INTERVAL_S", "0")
    guard("warn")
    pool = mha(mp)
    caplog.set_level(logging.WARNING, logger="sglang_oobguard")
    for _ in range(3):
        write(pool, torch.tensor([HIGH, HIGH]))
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_oobguard" and "bad KV slot ids" in r.getMessage()]
    assert len(lines) == 3
    assert "so far: 6 in 3 calls" in lines[2]


@pytest.mark.parametrize("mode", ["raise", "warn", "strict"])
def test_deferred_path_reports_at_the_next_guarded_call_or_check(mp, guard, mode):
    """The GPU's reporting path, forced on CPU tensors: the kernel contains the bad id
    and records it; the report comes later, never from the faulting call itself."""
    guard(mode, backend="triton", poll_every=1)
    pool = mha(mp)
    write(pool, torch.tensor([4, HIGH + 3]))  # contained: no IndexError from torch
    assert pool.k_buffer[3][0].abs().sum() > 0  # the bad id's data went to slot 0
    if mode == "warn":
        write(pool, torch.tensor([4]))
        write(pool, torch.tensor([4]))
        (v,) = sglang_oobguard.violations()
        assert (v.pos, v.value, v.layer, v.high) == (1, HIGH + 3, 3, HIGH)
        return
    with pytest.raises(KVOutOfBoundsError, match=rf"layer 3: 1 of 2 slot ids outside \[0, {HIGH}\): loc\[1\] = 68"):
        write(pool, torch.tensor([4]))


def test_check_reports_the_deferred_record(mp, guard):
    guard("raise", backend="triton", poll_every=1000)
    pool = mha(mp)
    write(pool, torch.tensor([-7]), layer=1)
    with pytest.raises(KVOutOfBoundsError, match=r"layer 1: 1 of 1 slot ids outside \[0, 65\): loc\[0\] = -7"):
        sglang_oobguard.check()
    sglang_oobguard.check()  # reported once


@pytest.mark.parametrize("mode", ["warn", "raise"])
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_containment_never_changes_the_callers_ids(mp, guard, mode, backend):
    """sglang reads out_cache_loc after the write (speculative decoding's accept moves,
    the frees): the contained write gets a private copy, the caller's tensor stays."""
    guard(mode, backend, poll_every=1000)
    pool = mha(mp)
    loc = torch.tensor([3, HIGH, 7])
    try:
        write(pool, loc)
    except KVOutOfBoundsError:
        assert mode == "raise" and backend == "auto"  # the host path raises before the write
    assert loc.tolist() == [3, HIGH, 7]


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_contained_kvwriteloc_is_passed_on_as_a_copy_with_only_its_ids_replaced(mp, guard, backend, monkeypatch):
    """Its other fields (swa_loc, the physical mark unified pools require) pass on as they are."""
    needs("KVWriteLoc", "KVWriteLoc.physical")
    guard("warn", backend)
    pool = mha(mp)
    given = mp.KVWriteLoc(torch.tensor([3, HIGH, 7]), swa_loc=torch.tensor([1, 2, 3]), physical=True)
    wrapper = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]  # our wrapt wrapper around sglang's method
    original, seen = wrapper.__wrapped__, []

    def spy(self, layer, loc_info, *rest, **kwargs):  # what sglang's own method receives
        seen.append(loc_info)
        return original(self, layer, loc_info, *rest, **kwargs)

    monkeypatch.setattr(wrapper, "__wrapped__", spy)
    write(pool, given)
    (passed,) = seen
    assert passed is not given and type(passed) is type(given)
    assert passed.loc.tolist() == [3, 0, 7] and passed.swa_loc is given.swa_loc and passed.physical is True
    assert given.loc.tolist() == [3, HIGH, 7] and given.physical is True
