"""GPU-only: the fused kernel on CUDA tensors, eager and inside a CUDA graph.
Skipped cleanly on machines without CUDA (see bench/gpu_probe.py for the numbers)."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import Layer, run_python, token_allocator
from sglang_oobguard import KVOutOfBoundsError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIGH = 65


def cuda_pool(mp):
    return mp.MHATokenToKVPool(64, 1, torch.bfloat16, 8, 128, 4, "cuda", False)


def kv(n):
    return torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")


def test_strict_fails_the_process_at_the_next_sync_with_label_and_bound():
    code = (
        "import torch, sglang_oobguard\n"
        "from sglang.srt.mem_cache import memory_pool as mp\n"
        "sglang_oobguard.install('strict')\n"
        "pool = mp.MHATokenToKVPool(64, 1, torch.bfloat16, 8, 128, 4, 'cuda', False)\n"
        "class L: layer_id = 2\n"
        "k = torch.randn(2, 8, 128, dtype=torch.bfloat16, device='cuda')\n"
        "pool.set_kv_buffer(L, torch.tensor([1, 70], device='cuda'), k, k)\n"
        "print('enqueued', flush=True)\n"
        "torch.cuda.synchronize()\n"
        "print('survived')\n"
    )
    proc = run_python(code, {"TRITON_INTERPRET": None})
    assert "enqueued" in proc.stdout and "survived" not in proc.stdout
    assert proc.returncode != 0
    assert "set_kv_buffer (MHA): KV slot id outside [0, 65)" in proc.stdout + proc.stderr


def test_raise_surfaces_at_check_and_contains(mp, guard):
    guard("raise", poll_every=1000)
    pool = cuda_pool(mp)
    pool.set_kv_buffer(Layer(2), torch.tensor([1, 70, 3], device="cuda"), kv(3), kv(3))
    with pytest.raises(KVOutOfBoundsError, match=r"layer 2: 1 of 3 slot ids outside \[0, 65\): loc\[1\] = 70"):
        sglang_oobguard.check()


def test_raise_surfaces_at_a_later_guarded_call_without_sync(mp, guard):
    guard("raise", poll_every=1)
    pool = cuda_pool(mp)
    pool.set_kv_buffer(Layer(0), torch.tensor([-1], device="cuda"), kv(1), kv(1))  # recorded; mirror copy enqueued
    torch.cuda.synchronize()  # let the copy land; the guard itself never waits
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[0\] = -1"):
        pool.set_kv_buffer(Layer(0), torch.tensor([6], device="cuda"), kv(1), kv(1))


def test_warn_keeps_every_other_row_intact(mp, guard):
    guard("warn")
    pool = cuda_pool(mp)
    before = pool.k_buffer[1].clone()
    k = kv(3)
    pool.set_kv_buffer(Layer(1), torch.tensor([7, HIGH + 9, 8], device="cuda"), k, k)
    sglang_oobguard.check()
    after = pool.k_buffer[1]
    assert torch.equal(after[1:7], before[1:7]) and torch.equal(after[9:], before[9:])
    assert torch.equal(after[7], k[0]) and torch.equal(after[8], k[2])
    (v,) = sglang_oobguard.violations()
    assert (v.pos, v.value) == (1, HIGH + 9)


def test_cuda_graph_replay_checks_again(mp, guard):
    guard("raise", poll_every=1000)
    pool = cuda_pool(mp)
    loc = torch.tensor([1, 2, 3, 4], device="cuda")
    k = kv(4)
    pool.set_kv_buffer(Layer(0), loc, k, k)  # warm-up: compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(0), loc, k, k)
    graph.replay()
    sglang_oobguard.check()  # clean
    loc.copy_(torch.tensor([1, 2, 99, 4], device="cuda"))
    graph.replay()
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[2\] = 99"):
        sglang_oobguard.check()


def test_liveness_on_cuda_catches_a_freed_slot_in_the_probe_and_in_a_graph(mp, guard):
    """One launch checks bound and liveness; a graph replay re-reads the shadow."""
    from sglang.srt.mem_cache import allocator

    guard("raise", poll_every=1000, liveness=True)
    pool = cuda_pool(mp)
    alloc = token_allocator(allocator, pool)
    loc = alloc.alloc(3)
    k = kv(3)
    graph = torch.cuda.CUDAGraph()
    pool.set_kv_buffer(Layer(1), loc, k, k)
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(1), loc, k, k)
    graph.replay()
    sglang_oobguard.check()
    freed = int(loc[2])
    alloc.free(loc[2:])
    graph.replay()  # the same captured write, now to a freed slot
    with pytest.raises(KVOutOfBoundsError, match=rf"layer 1: loc\[2\] = {freed} is not allocated \(freed\)"):
        sglang_oobguard.check()
