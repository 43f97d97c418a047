"""SGLANG_OOBGUARD_OWN_TIME: the guard's own host time per entry point, minus the sglang
call it wraps, filed per process for bench/engine.py; unset, nothing is timed."""

from __future__ import annotations

import os
import struct
import time

import pytest
import torch

import sglang_oobguard
from helpers import Layer, decode_batch
from sglang_oobguard.report import owntime


def test_unset_nothing_is_timed(mp, guard):
    guard("strict")
    wrapper = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]._self_wrapper
    assert wrapper.__name__ == "lean_wrapper"  # the check's own wrapper (a lean write's), not the timing one


def test_the_own_time_counts_the_guard_not_sglang(mp, guard, monkeypatch, tmp_path, runner):
    monkeypatch.setenv("SGLANG_OOBGUARD_OWN_TIME", str(tmp_path))
    guard("strict")
    assert mp.MHATokenToKVPool.__dict__["set_kv_buffer"]._self_wrapper.__name__ == "timed_wrapper"
    assert (tmp_path / f"owntime-{os.getpid()}.bin").exists()
    # a large write: sglang's own copy of 4096 rows takes far longer than the guard's check of their ids
    pool = mp.MHATokenToKVPool(65536, 1, torch.bfloat16, 8, 128, 1, "cpu", False)
    loc = torch.randperm(65536)[:4096] + 1
    k = torch.randn(4096, 8, 128, dtype=torch.bfloat16)
    began = time.perf_counter_ns()
    for _ in range(5):
        pool.set_kv_buffer(Layer(0), loc, k, k)
    wall = time.perf_counter_ns() - began
    ns, calls, inclusive = owntime.read(str(tmp_path))["write"]
    assert calls >= 5 and 0 < ns < inclusive / 5 and inclusive <= wall  # sglang's write is not the guard's time
    # a forward step: counted once as a step; its layers' writes count as writes, not in the step's time
    small = mp.MHATokenToKVPool(64, 1, torch.float32, 2, 4, 4, "cpu", False)
    run = runner(small)
    for _ in range(3):
        run.forward(decode_batch(torch.tensor([3, 4, 5])))
    totals = owntime.read(str(tmp_path))
    assert totals["step"][1] == 3 and totals["write"][1] >= calls + 3 * 4
    assert 0 < totals["step"][0] < totals["step"][2]  # the forward's own time holds the layers' writes


def test_a_bad_write_is_still_reported_through_the_timed_wrapper(mp, guard, monkeypatch, tmp_path):
    monkeypatch.setenv("SGLANG_OOBGUARD_OWN_TIME", str(tmp_path))
    guard("raise")
    pool = mp.MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu", False)
    k = torch.ones(2, 2, 4)
    with pytest.raises(sglang_oobguard.KVOutOfBoundsError):
        pool.set_kv_buffer(Layer(1), torch.tensor([3, 99]), k, k)
    assert owntime.read(str(tmp_path))["write"][1] >= 1


def test_read_sums_the_processes_files(tmp_path):
    for pid, ns in ((11, 5), (12, 7)):
        slots = [ns, 1, 2 * ns] + [0] * (owntime.SLOTS * len(owntime.KINDS) - 3)
        (tmp_path / f"owntime-{pid}.bin").write_bytes(struct.pack(f"{len(slots)}q", *slots))
    assert owntime.read(str(tmp_path))["write"] == (12, 2, 24)


def test_a_folder_that_cannot_be_written_leaves_the_guard_on_untimed(mp, guard, monkeypatch, tmp_path, caplog):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("SGLANG_OOBGUARD_OWN_TIME", str(blocker / "sub"))
    assert guard("strict")  # installed
    assert mp.MHATokenToKVPool.__dict__["set_kv_buffer"]._self_wrapper.__name__ == "lean_wrapper"
    assert any("own time not kept" in r.getMessage() for r in caplog.records)
