"""Decode context parallelism on the CPU: sglang's runtime context says the DCP width,
and the real MLA pool and paged allocator are built as sglang builds them under it.
Under DCP the MLA write ids are logical, `(size + page_size) * dcp` of them (upstream's
fix of the same false positive, sglang #33432), and the allocator hands out ids over a
pool `dcp` times the pool's rows; a healthy DCP server must pass every check."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from helpers import model_runner_class
import sglang_oobguard
from sglang_oobguard import KVOutOfBoundsError

DCP, SIZE, PAGE = 2, 64, 1


@pytest.fixture
def dcp(mp):
    if not importlib.util.find_spec("sglang.srt.runtime_context") or not hasattr(mp.MLATokenToKVPool,
                                                                                  "_write_loc_dcp_span"):
        pytest.skip("the DCP write span arrived in sglang 0.5.19")
    from sglang.srt.runtime_context import get_parallel

    with get_parallel().override(attn_dcp_size=DCP, attn_dcp_rank=0, dcp_enabled=True):
        yield


def mla_pool(mp):
    return mp.MLATokenToKVPool(SIZE, PAGE, torch.bfloat16, 16, 16, 2, "cpu", False)


def forward_step(pool, loc):
    """One forward through sglang's ModelRunner.forward under the guard's step hook
    (no model: the step check alone)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    ModelRunner = model_runner_class()

    run = ModelRunner.__new__(ModelRunner)
    run.token_to_kv_pool, run.tp_rank, run.pp_rank, run.dp_rank = pool, 0, 0, 0
    n = loc.numel()
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(n, dtype=torch.int64),
                         req_pool_indices=torch.tensor([1]), seq_lens=torch.tensor([n]), out_cache_loc=loc,
                         seq_lens_sum=n)
    ModelRunner.__dict__["forward"]._self_wrapper(lambda b: "output", run, (batch,), {})


def test_the_step_check_takes_the_dcp_write_ids_of_a_healthy_server(mp, guard, dcp):
    guard("strict")
    pool = mla_pool(mp)
    forward_step(pool, torch.tensor([3, 65, 70, 129]))  # inside (64 + 1) * 2
    with pytest.raises(KVOutOfBoundsError, match=r"out_cache_loc \(forward step\): 1 of 2 slot ids outside "
                                                 r"\[0, 130\): loc\[1\] = 130"):
        forward_step(pool, torch.tensor([3, 130]))


def test_without_dcp_the_same_ids_are_outside(mp, guard):
    guard("strict")
    with pytest.raises(KVOutOfBoundsError, match=r"outside \[0, 65\): loc\[1\] = 65"):
        forward_step(mla_pool(mp), torch.tensor([3, 65]))


def test_the_liveness_shadow_spans_the_dcp_allocators_ids(mp, guard, dcp, caplog):
    """sglang builds the allocator over `size * dcp` ids under DCP: every one it hands
    out and takes back is tracked, with no internal error and no false report."""
    from sglang.srt.mem_cache import allocator as allocators

    guard("strict", liveness=True)
    pool = mla_pool(mp)
    cls = allocators.PagedTokenToKVPoolAllocator
    extra = (False,) if "need_sort" in inspect.signature(cls).parameters else ()
    alloc = cls(SIZE * DCP, PAGE, torch.bfloat16, "cpu", pool, *extra)
    ids = alloc.alloc(SIZE * DCP)  # every id, up to 128: past the pool's 65 rows
    assert ids is not None and int(ids.max()) == SIZE * DCP
    forward_step(pool, ids[-4:])  # written at their DCP write ids: live
    alloc.free(ids)
    assert "internal error" not in caplog.text
    assert sglang_oobguard.violations() == []
    with pytest.raises(KVOutOfBoundsError, match=r"is not allocated \(freed\)"):
        forward_step(pool, ids[-2:])  # freed: now a stale write
