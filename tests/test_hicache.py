"""The HiCache check (checks/hicache.py) on sglang's real host pool (`MHATokenToKVPoolHost`,
layer_first, io_backend "direct") over a real MHA pool and sglang's token allocator, on the CPU
through tests/hicache_shim.py (which says what it stands in for): loads and backups of live
slots pass and copy; a load into a slot outside the pool or freed, and a backup from a freed
slot, are reported, and in warn mode contained."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import mha, needs, token_allocator
from sglang_oobguard import KVOutOfBoundsError

SIZE = 64


@pytest.fixture
def hicache(mp, guard, monkeypatch):
    """make(mode): the guard with liveness, a device pool with 8 slots handed out, its host pool."""
    needs("MHATokenToKVPoolHost.load_to_device_per_layer")
    import hicache_shim
    from sglang.srt.mem_cache import allocator as allocators
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    hicache_shim.install(monkeypatch)

    def make(mode: str):
        guard(mode, liveness=True)
        pool = mha(mp, SIZE)
        alloc = token_allocator(allocators, pool)
        slots = alloc.alloc(8)
        for layer in range(pool.layer_num):
            pool.k_buffer[layer][slots] = slots.float()[:, None, None] + 100 * layer
        host = MHATokenToKVPoolHost(pool._mha_buffer_info(), 2.0, 0, 1, "layer_first", pin_memory=False, device="cpu",
                                    device_capacity_tokens=pool.size, start_layer=0, end_layer=pool.layer_num)
        return pool, alloc, host, slots

    return make


def test_a_backup_and_a_load_back_of_live_slots_pass_and_copy(hicache):
    pool, alloc, host, slots = hicache("strict")
    host.backup_from_device_all_layer(pool, torch.arange(8), slots, "direct")
    fresh = alloc.alloc(8)
    for layer in range(pool.layer_num):
        host.load_to_device_per_layer(pool, torch.arange(8), fresh, layer, "direct")
        assert torch.equal(pool.k_buffer[layer][fresh], pool.k_buffer[layer][slots])
    assert not sglang_oobguard.violations()


@pytest.mark.parametrize("fault,kind", [("high", "bounds"), ("freed", "freed")])
def test_a_load_into_a_bad_device_slot_is_reported_before_it_writes(hicache, fault, kind):
    pool, alloc, host, slots = hicache("strict")
    host.backup_from_device_all_layer(pool, torch.arange(8), slots, "direct")
    fresh = alloc.alloc(4)
    if fault == "high":
        fresh[2] = SIZE + 5
    else:
        alloc.free(fresh[2:3].clone())
    before = pool.k_buffer[1].clone()
    with pytest.raises(KVOutOfBoundsError) as info:
        host.load_to_device_per_layer(pool, torch.arange(4), fresh, 1, "direct")
    violation = info.value.violation
    assert (violation.kind, violation.pos, violation.value, violation.layer) == (kind, 2, int(fresh[2]), 1)
    assert violation.label == "load_to_device_per_layer (HiCache host->device load) device_indices"
    assert torch.equal(pool.k_buffer[1], before)  # raised before the copy


def test_a_backup_from_a_freed_slot_is_reported(hicache):
    pool, alloc, host, slots = hicache("strict")
    alloc.free(slots[5:6].clone())
    with pytest.raises(KVOutOfBoundsError) as info:
        host.backup_from_device_all_layer(pool, torch.arange(8), slots, "direct")
    assert (info.value.violation.kind, info.value.violation.pos) == ("freed", 5)
    assert info.value.violation.label == "backup_from_device_all_layer (HiCache device->host backup) device_indices"


def test_warn_contains_a_bad_load_to_the_padding_slot(hicache):
    pool, alloc, host, slots = hicache("warn")
    host.backup_from_device_all_layer(pool, torch.arange(8), slots, "direct")
    fresh = alloc.alloc(4)
    fresh[1] = SIZE + 5  # unguarded: torch's IndexError inside the copy
    host.load_to_device_per_layer(pool, torch.arange(4), fresh, 0, "direct")
    assert sglang_oobguard.violations()[0].kind == "bounds"
    assert torch.equal(pool.k_buffer[0][fresh[[0, 2, 3]]], pool.k_buffer[0][slots[[0, 2, 3]]])  # the others loaded
