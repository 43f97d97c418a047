"""The read check's memory and its kernel's shape (trust issue: GPU memory nobody
budgeted). sglang's real ReqToTokenPool, KV pool, allocator and ModelRunner.forward with
the guard's hook, on the CPU: `Seen` (8 bytes per req_to_token entry) is made with the
ReqToTokenPool, said in the log with its size, and kept by every step; the read kernel
(Triton's interpreter) runs one program per batch row, and its record names the first
bad read by row, then position, with every row's count."""

from __future__ import annotations

import logging

import pytest

import sglang_oobguard
from helpers import mha, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.checks.reads import SEEN_ATTR
from sglang_oobguard.model.targets import write_map_off
from sglang_oobguard.probes import kernels, readkernel
from test_reads import admit, evict, step
from test_stepmap import step_runner

pytestmark = pytest.mark.skipif(write_map_off() is not None, reason=str(write_map_off()))


@pytest.mark.parametrize("liveness", [True, False])
def test_the_read_checks_memory_is_made_with_the_req_to_token_pool_and_kept_by_every_step(mp, guard, monkeypatch,
                                                                                         caplog, liveness):
    from sglang.srt.mem_cache import allocator

    guard("strict", "triton", liveness=liveness)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        run, _ = step_runner(mp, monkeypatch)(pool)  # builds sglang's ReqToTokenPool
    table = run.req_to_token_pool.req_to_token
    seen = run.req_to_token_pool.__dict__.get(SEEN_ATTR)
    if not liveness:  # no read check: nothing made
        assert seen is None and "read check memory" not in caplog.text
        return
    assert seen is not None and seen.fits(table) and seen.slot.shape == table.shape  # before any step
    rows, cols = table.shape
    assert f"read check memory: {(rows * cols * 8 + rows * 40 + 32) / 2**20:.1f} MiB on cpu (req_to_token " \
           f"{rows} x {cols}: two int32 per entry), made with sglang's ReqToTokenPool" in caplog.text
    table.zero_()
    admit(run, alloc, 1, 4)
    for n in (5, 6):
        step(run, alloc, {1: n})
    assert run.req_to_token_pool.__dict__[SEEN_ATTR] is seen and int(seen.checked[1]) == 6  # the steps used it
    sglang_oobguard.uninstall()
    assert SEEN_ATTR not in run.req_to_token_pool.__dict__  # uninstall takes it off sglang's object


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_the_read_kernel_runs_a_program_per_row_and_names_the_first_bad_read_by_row_then_position(
        mp, guard, monkeypatch, backend):
    """Two rows read a freed slot: row 1 (batch row 0) at position 2, row 2 (batch row 1)
    at position 0. The record: batch row 0's read, both counted, every read counted."""
    from sglang.srt.mem_cache import allocator

    guard("strict", backend, liveness=True)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    run, _ = step_runner(mp, monkeypatch)(pool)
    run.req_to_token_pool.req_to_token.zero_()
    grids = []
    launch = kernels._launch

    def spy(kernel, grid, *args):
        if kernel is readkernel._read_kernel:
            grids.append(grid)
        return launch(kernel, grid, *args)

    monkeypatch.setattr(kernels, "_launch", spy)
    first, second = admit(run, alloc, 1, 4), admit(run, alloc, 2, 4)
    step(run, alloc, {1: 5, 2: 5})
    evict(alloc, first[2:3])
    evict(alloc, second[0:1])
    with pytest.raises(KVOutOfBoundsError) as info:
        step(run, alloc, {1: 6, 2: 6})
        sglang_oobguard.check()
    v = info.value.violation
    assert (v.kind, v.request, v.token, v.value, v.bad, v.numel) == ("read_freed", "r1", 2, int(first[2]), 2, 12)
    if backend == "triton":
        assert grids[1:] == [2, 2]  # after the warm-up's empty launch: one program per batch row
