"""The deferred (GPU) path never syncs with the host.

Run on CPU tensors with the kernel forced (Triton's interpreter executes it), under
a TorchDispatchMode that sees every aten op of the guarded write: none may read a
tensor's value on the host (`_local_scalar_dense`: .item(), int(t), bool(t)) or
need one (data-dependent shapes such as nonzero). .tolist(), .cpu() and .numpy()
do not dispatch on CPU tensors, so the hot-path source is checked for them too.
"""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import sglang_oobguard
from helpers import Layer, mha, token_allocator
from sglang_oobguard.model.targets import write_map_off
from sglang_oobguard.checks import guard as guard_mod
from sglang_oobguard.probes import device, hostscan, kernels, pools, record, shadow
from sglang_oobguard.checks import liveness, reads, stepcheck, swa, values, writes, writers
from sglang_oobguard.model import writemap
from sglang_oobguard.probes import readkernel, valuekernel
from test_stepmap import step_runner


@pytest.fixture
def runner(mp, monkeypatch):
    """test_stepmap's runner: sglang's ModelRunner with the guard's hook over a stand-in model loop."""
    return step_runner(mp, monkeypatch)

SYNCING = {"aten._local_scalar_dense.default", "aten.nonzero.default", "aten.masked_select.default",
           "aten.is_nonzero.default", "aten.equal.default", "aten.item.default", "aten.unique_dim.default",
           "aten._unique2.default"}


class OpLog(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_guarded_writes_issue_no_host_sync(mp, guard):
    guard("raise", backend="triton", poll_every=1)
    pool = mha(mp)
    k = torch.zeros(3, 2, 4)
    pool.set_kv_buffer(Layer(0), torch.tensor([1, 2, 3]), k, k)  # attach the record outside the log
    with OpLog() as log:
        pool.set_kv_buffer(Layer(0), torch.tensor([1, 2, 3]), k, k)
        pool.set_kv_buffer(Layer(0), torch.tensor([4, 70, 5]), k, k)  # recorded, contained
        with pytest.raises(sglang_oobguard.KVOutOfBoundsError, match=r"loc\[1\] = 70"):
            pool.set_kv_buffer(Layer(0), torch.tensor([6, 7, 8]), k, k)  # finds the landed mirror
    assert not SYNCING & set(log.ops), sorted(SYNCING & set(log.ops))
    assert "aten.index_put_.default" in log.ops  # the log saw the writes themselves


def test_liveness_alloc_free_and_writes_issue_no_host_sync(mp, guard):
    """The allocator side too: marking handed-out slots, checking and releasing a free,
    and the write probe's gather are device ops (sglang's token allocator adds none)."""
    from sglang.srt.mem_cache import allocator

    guard("raise", backend="triton", poll_every=1000, liveness=True)
    pool = mha(mp)
    alloc = token_allocator(allocator, pool)
    k = torch.zeros(3, 2, 4)
    with OpLog() as log:
        loc = alloc.alloc(3)
        pool.set_kv_buffer(Layer(0), loc, k, k)
        alloc.free(loc[1:2])
        pool.set_kv_buffer(Layer(0), loc.clone(), k, k)  # loc[1] freed: recorded, contained
        alloc.free(loc[1:2])  # a double free: recorded
    assert not SYNCING & set(log.ops), sorted(SYNCING & set(log.ops))
    assert "aten.index_fill_.int_Scalar" in log.ops  # the log saw the shadow's update
    with pytest.raises(sglang_oobguard.KVOutOfBoundsError, match=r"loc\[1\] = 2 is not allocated \(freed\)"):
        sglang_oobguard.check()
    assert pool._oobguard_state.record.read_now().calls == 2


def test_the_value_check_issues_no_host_sync(mp, guard):
    """SGLANG_OOBGUARD_FINITE on the kernel path: a clean and a NaN write, both launch the
    value kernel and read nothing back; the NaN is found at the next check point."""
    guard("raise", backend="triton", poll_every=1000, finite=True)
    pool = mha(mp)
    k = torch.zeros(3, 2, 4)
    nan = k.clone()
    nan[1, 0, 3] = float("nan")
    pool.set_kv_buffer(Layer(0), torch.tensor([1, 2, 3]), k, k)  # attach the record outside the log
    launches = []
    with OpLog() as log:
        original = valuekernel.launch_values
        valuekernel.launch_values = lambda *a, **kw: launches.append(a[5]) or original(*a, **kw)
        try:
            pool.set_kv_buffer(Layer(0), torch.tensor([1, 2, 3]), k, k)
            pool.set_kv_buffer(Layer(1), torch.tensor([4, 5, 6]), k, nan)  # recorded, written unchanged
        finally:
            valuekernel.launch_values = original
    assert not SYNCING & set(log.ops), sorted(SYNCING & set(log.ops))
    assert launches == ["cache_k", "cache_v"] * 2  # one launch per part, none skipped
    assert torch.isnan(pool.v_buffer[1][5]).any()  # the observer wrote the values as given
    with pytest.raises(sglang_oobguard.KVOutOfBoundsError, match=r"layer 1: cache_v of loc\[1\] \(slot 5\) head 0 is nan"):
        sglang_oobguard.check()


@pytest.mark.skipif(write_map_off() is not None, reason=f"the read check runs where the write map does: {write_map_off()}")
def test_the_read_check_on_the_device_path_issues_no_host_sync(mp, guard, runner):
    """The step with liveness on the kernel path: the step kernel, then the read kernel
    (sglang's host copy of req_pool_indices tells a row's new holder): no host read."""
    from sglang.srt.mem_cache import allocator
    from test_reads import admit, decode

    guard("raise", backend="triton", poll_every=1000, liveness=True)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    run, _ = runner(pool)
    table = run.req_to_token_pool.req_to_token
    table.zero_()
    prefix = admit(run, alloc, 1, 4)
    for n in (5, 6):
        table[1, n - 1] = int(alloc.alloc(1)[0])
        batch = decode(run, rows=(1,), seq_lens=(n,))
        batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
        if n == 6:
            alloc.free(prefix[1:2])  # read at this step: recorded
            with OpLog() as log:
                run.forward(batch)
        else:
            run.forward(batch)  # the first step: tables made, kernels compiled
    assert not SYNCING & set(log.ops), sorted(SYNCING & set(log.ops))
    with pytest.raises(sglang_oobguard.KVOutOfBoundsError, match=r"slot \d+ at position 1 is read by its running "
                       r"request but was given back"):
        sglang_oobguard.check()


@pytest.mark.skipif(write_map_off() is not None, reason=f"the read check runs where the write map does: {write_map_off()}")
def test_an_unmeasured_step_is_told_from_attributes_alone(mp, guard, runner, monkeypatch):
    """An older release's unmeasured forward (a PD decode server's, on sglang 0.5.12's entry) on
    the kernel path: the map and the read check skip it having read no tensor, its bounds and
    liveness launch as before: no host read."""
    from types import SimpleNamespace

    from sglang.srt.mem_cache import allocator
    from test_reads import admit, decode
    from test_writemap import older_release

    older_release(monkeypatch)
    guard("raise", backend="triton", poll_every=1000, liveness=True)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    run, _ = runner(pool)
    run.server_args = SimpleNamespace(disaggregation_mode="decode", speculative_algorithm=None)
    table = run.req_to_token_pool.req_to_token
    table.zero_()
    admit(run, alloc, 1, 4)
    for n in (5, 6):
        table[1, n - 1] = int(alloc.alloc(1)[0])
        batch = decode(run, rows=(1,), seq_lens=(n,))
        batch.req_pool_indices_cpu = batch.req_pool_indices.clone()
        if n == 6:
            with OpLog() as log:
                run.forward(batch)
        else:
            run.forward(batch)  # the first step: kernels compiled, the skips said
    assert not SYNCING & set(log.ops), sorted(SYNCING & set(log.ops))
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []


def test_host_scan_is_what_would_sync(mp):
    """The dispatch check can fail: the CPU host path does read values."""
    with OpLog() as log:
        hostscan.scan_host(torch.arange(100), 10)
    assert "aten._local_scalar_dense.default" in log.ops


HOT_PATH = [writes.check_write, writes._launch, guard_mod.Guard.launched, guard_mod.Guard.state,
            guard_mod.Guard.publish, pools.PoolState.copy_for, device.Order.probed, device.Order.after,
            pools.PoolState.after_probes, pools.region, writes.make_wrapper, writes._layer_id, writes.replaced,
            kernels.launch, kernels.programs, record.PoolRecord.poll, record.PoolRecord.unreported,
            liveness.check_free, kernels.launch_free, shadow.mark, shadow.release, shadow._pages, shadow._fill,
            liveness.make_wrapper, liveness._alloc, liveness._free, liveness._group_end, liveness._update,
            liveness.counted, stepcheck.step_begin, stepcheck.step_end, guard_mod.Steps.begin,
            swa.make_wrapper, swa.make_mapping_hook, swa.check_door, reads._launch, readkernel.launch,
            values.check_values, values.parts, values.before_write, valuekernel.launch_values, valuekernel.layout,
            writers.make_writer_wrapper, writemap.unmeasured, stepcheck._measured]
FORBIDDEN = {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero"}


def test_hot_path_source_calls_no_host_read():
    """`.tolist()` is allowed on the pinned mirror's numpy view alone: host memory."""
    for fn in HOT_PATH:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name = node.func.attr
                owner = ast.unparse(node.func.value)
                if name in FORBIDDEN:
                    assert (name, owner) == ("tolist", "self._mirror_view"), f"{fn.__qualname__}: {owner}.{name}()"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "bool":
                raise AssertionError(f"{fn.__qualname__}: bool() on the hot path")


def test_the_swa_checks_add_no_host_sync_on_the_device_path(guard):
    """SWAKVPool and its SWA allocator through one step's life (hand-out, a write per layer,
    SWA slots leaving the window, the rest freed), the device path forced: the guard adds
    no syncing op to those sglang's own SWA allocator makes (its CPU frees read values)."""
    from collections import Counter

    from helpers import needs, swa_allocator, swa_pool
    needs("SWATokenToKVPoolAllocator", "KVWriteLoc")
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    def life() -> Counter:
        pool = swa_pool(1)
        allocator = swa_allocator(pool)
        k = torch.zeros(4, 2, 4)
        with OpLog() as log:
            loc = allocator.alloc(4)
            for layer in range(4):
                pool.set_kv_buffer(Layer(layer), KVWriteLoc(loc, swa_loc=allocator.translate_loc_from_full_to_swa(loc)),
                                   k, k)
            allocator.free_swa(loc[:2])
            allocator.free_full(loc[:2])
            allocator.free(loc[2:])
        return Counter(op for op in log.ops if op in SYNCING)

    sglang_oobguard.uninstall()
    life()  # sglang's first-call work (one-time reads) out of the comparison
    unguarded = life()
    guard("raise", backend="triton", poll_every=1000, liveness=True)
    guarded = life()
    assert guarded == unguarded, (guarded, unguarded)
