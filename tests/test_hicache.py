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


# -- the holder check (checks/hiloads.py): a load-back into a slot a running request holds --------------
# sglang's real HiCacheController (io_backend "direct") queues and starts the load-back; the running
# request is a row of test_stepmap's runner (sglang's ModelRunner with the guard's step hook), whose
# decode steps write, and so own, its slots. The fault is a stale id in the queued load (`load_queue`).


@pytest.fixture
def loading(hicache, mp, monkeypatch):
    """make(mode): the hicache fixture's pools, a running request r1 (row 1) that wrote 4 slots in 4
    decode steps, a HiCacheController over the pools, and 8 backed-up host slots. The holder check reads
    the owner table, which the write map's owner check keeps: where the write map runs."""
    import threading

    from sglang_oobguard.model.targets import write_map_off

    if write_map_off():
        pytest.skip(write_map_off())

    from sglang.srt.managers.cache_controller import HiCacheController

    from test_reads import step
    from test_stepmap import step_runner

    runners = []  # each model runner lives as long as its server would (the guard holds it weakly)

    def make(mode: str):
        pool, alloc, host, slots = hicache(mode)
        run, _ = step_runner(mp, monkeypatch)(pool)
        runners.append(run)
        run.req_to_token_pool.req_to_token.zero_()
        for n in range(1, 5):
            step(run, alloc, {1: n})
        held = run.req_to_token_pool.req_to_token[1, :4].long()
        host_ids = host.alloc(8)
        host.backup_from_device_all_layer(pool, host_ids, slots, "direct")
        controller = HiCacheController(alloc, host, 1, None, threading.Event(), io_backend="direct")
        return pool, controller, host_ids, held, slots

    return make


def test_a_load_back_beside_a_running_request_passes(loading):
    pool, controller, host_ids, held, _ = loading("strict")
    before = pool.k_buffer[0][held].clone()
    fresh = controller.load(host_ids, node_id=7)
    controller.start_loading()
    assert torch.equal(pool.k_buffer[0][held], before) and not sglang_oobguard.violations()
    assert not set(fresh.tolist()) & set(held.tolist())


def test_a_load_back_into_a_running_requests_slot_names_the_node_and_the_holder(loading):
    pool, controller, host_ids, held, _ = loading("strict")
    controller.load(host_ids, node_id=7)
    controller.load_queue[0].device_indices[2] = held[3]  # a stale id upstream of the load
    before = pool.k_buffer[0][held].clone()
    with pytest.raises(Exception) as info:  # on the CPU sglang's cleanup (l2_transfer's except: a CPU stream's
        controller.start_loading()           # synchronize, which torch.cpu.Stream lacks) raises during handling
    error = info.value
    while error is not None and not isinstance(error, KVOutOfBoundsError):
        error = error.__context__
    assert error is not None, info.value
    v = error.violation
    assert (v.kind, v.pos, v.value, v.node, v.owner, v.owner_token) == ("held", 2, int(held[3]), 7, "r1", 3)
    assert v.label == "load_to_device_per_layer (HiCache host->device load) device_indices"
    assert f"loc[2] = {int(held[3])}: a HiCache load for tree node 7 into a slot another running request " \
           f"holds; slot {int(held[3])} is held by request r1 token 3" in v.described()
    assert v.allocated_step >= 0 and v.allocated_by and "step" in v.allocated_by, v  # the slot's history
    assert torch.equal(pool.k_buffer[0][held], before)  # raised before the copy


def test_warn_contains_a_load_into_a_held_slot_and_loads_the_others(loading):
    pool, controller, host_ids, held, slots = loading("warn")
    fresh = controller.load(host_ids, node_id=7).clone()
    controller.load_queue[0].device_indices[2] = held[0]
    before = [pool.k_buffer[layer][held].clone() for layer in range(pool.layer_num)]
    controller.start_loading()
    assert [v.kind for v in sglang_oobguard.violations()] == ["held"]
    others = [0, 1, *range(3, 8)]
    for layer in range(pool.layer_num):
        assert torch.equal(pool.k_buffer[layer][held], before[layer])  # the running request's KV kept
        assert torch.equal(pool.k_buffer[layer][fresh[others]], pool.k_buffer[layer][slots[others]])  # loaded
