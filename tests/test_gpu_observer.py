"""GPU-only: the guard as an observer on real CUDA streams and graphs. Containment
never changes the caller's ids, in eager mode or in a graph replay; the liveness
shadow is updated in stream order (sglang's overlap scheduler frees on its scheduling
stream while the forward stream still writes); the record counts exactly when probes
on two streams fold into it. Skipped cleanly on machines without CUDA."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import Layer, cuda_kv, cuda_pool, run_python, token_allocator
from sglang_oobguard import KVOutOfBoundsError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZE, LAYERS = 64, 4
SLEEP_CYCLES = 200_000_000  # ~0.1 s of GPU time: the forward stream is still busy when the free is issued


@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_graph_replay_contains_into_a_copy_and_the_callers_ids_stay(mp, guard, mode):
    guard(mode, poll_every=1000)
    pool = cuda_pool(mp)
    loc = torch.tensor([1, 2, 3, 4], device="cuda")
    k = cuda_kv(4)
    graph = torch.cuda.CUDAGraph()
    pool.set_kv_buffer(Layer(0), loc, k, k)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(0), loc, k, k)
    graph.replay()
    sglang_oobguard.check()
    loc.copy_(torch.tensor([5, SIZE + 7, 6, -1], device="cuda"))
    last_row = pool.k_buffer[0][SIZE].clone()
    graph.replay()
    torch.cuda.synchronize()
    assert loc.tolist() == [5, SIZE + 7, 6, -1]  # the caller's (sglang's static) buffer is unchanged
    assert torch.equal(pool.k_buffer[0][SIZE], last_row)  # -1 did not write the last row
    assert torch.equal(pool.k_buffer[0][5], k[0]) and torch.equal(pool.k_buffer[0][6], k[2])
    if mode == "raise":
        with pytest.raises(KVOutOfBoundsError, match=rf"2 of 4 slot ids outside \[0, {SIZE + 1}\): loc\[1\] = {SIZE + 7}"):
            sglang_oobguard.check()
    else:
        sglang_oobguard.check()
        (v,) = sglang_oobguard.violations()
        assert (v.bad, v.pos, v.value) == (2, 1, SIZE + 7)


def test_strict_graph_replay_fails_the_process():
    code = (
        "import torch, sglang_oobguard\n"
        "from sglang.srt.mem_cache import memory_pool as mp\n"
        "sglang_oobguard.install('strict')\n"
        f"pool = mp.MHATokenToKVPool({SIZE}, 1, torch.bfloat16, 8, 128, 2, 'cuda', False)\n"
        "class L: layer_id = 1\n"
        "loc = torch.tensor([1, 2], device='cuda')\n"
        "k = torch.randn(2, 8, 128, dtype=torch.bfloat16, device='cuda')\n"
        "pool.set_kv_buffer(L, loc, k, k); torch.cuda.synchronize()\n"
        "g = torch.cuda.CUDAGraph()\n"
        "with torch.cuda.graph(g):\n"
        "    pool.set_kv_buffer(L, loc, k, k)\n"
        "g.replay(); torch.cuda.synchronize(); print('clean replay', flush=True)\n"
        f"loc.fill_({SIZE + 3}); g.replay(); torch.cuda.synchronize()\n"
        "print('survived')\n"
    )
    proc = run_python(code, {"TRITON_INTERPRET": None})
    assert "clean replay" in proc.stdout and "survived" not in proc.stdout and proc.returncode != 0
    assert "set_kv_buffer (MHA): KV slot id outside [0, size + page_size)" in proc.stdout + proc.stderr


def overlap(pool, alloc, loc, free_on, write_on, stale: bool) -> None:
    """The overlap scheduler's two streams: `write_on` runs a long forward (a sleep, then
    one write per layer at `loc`); `free_on` frees loc's last slot. Clean: the free is
    issued right after the writes were enqueued. Stale: the free comes first, and the
    forward stream waits for it (sglang's barrier) before a write to the freed slot."""
    k = cuda_kv(loc.numel())
    if stale:
        with torch.cuda.stream(free_on):
            alloc.free(loc[-1:])
        write_on.wait_stream(free_on)
    with torch.cuda.stream(write_on):
        torch.cuda._sleep(SLEEP_CYCLES)
        for layer in range(LAYERS):
            pool.set_kv_buffer(Layer(layer), loc, k, k)
    if not stale:
        with torch.cuda.stream(free_on):  # no wait on the forward stream here, as in sglang
            alloc.free(loc[-1:])
    torch.cuda.synchronize()


def test_a_free_on_the_scheduling_stream_waits_for_the_forward_streams_probes(mp, guard):
    from sglang.srt.mem_cache import allocator

    guard("strict", poll_every=1, liveness=True)
    pool = cuda_pool(mp)
    alloc = token_allocator(allocator, pool)
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(3):
        with torch.cuda.stream(schedule):
            loc = alloc.alloc(3)
        forward.wait_stream(schedule)
        overlap(pool, alloc, loc, schedule, forward, stale=False)
        alloc.free(loc[:-1])
        torch.cuda.synchronize()
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []


def test_a_real_stale_write_across_streams_is_reported(mp, guard):
    from sglang.srt.mem_cache import allocator

    guard("raise", poll_every=1000, liveness=True)
    pool = cuda_pool(mp)
    alloc = token_allocator(allocator, pool)
    schedule, forward = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(schedule):
        loc = alloc.alloc(3)
    forward.wait_stream(schedule)
    overlap(pool, alloc, loc, schedule, forward, stale=True)
    with pytest.raises(KVOutOfBoundsError, match=rf"loc\[2\] = {int(loc[2])} is not allocated \(freed\)"):
        sglang_oobguard.check()
    (v,) = sglang_oobguard.violations()
    assert v.calls == LAYERS  # every layer's write saw it


def test_probes_on_two_streams_fold_exact_totals(mp, guard):
    """Atomics: no count is lost and the first violation stays one call's, whichever
    stream's probe got there first."""
    guard("warn", poll_every=10**6)
    pool = cuda_pool(mp)
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    bad = {0: torch.tensor([1, SIZE + 1, 2], device="cuda"), 1: torch.tensor([SIZE + 2, SIZE + 3, 3], device="cuda")}
    k = cuda_kv(3)
    torch.cuda.synchronize()
    for i in range(400):
        with torch.cuda.stream(streams[i % 2]):
            pool.set_kv_buffer(Layer(i % LAYERS), bad[i % 2], k, k)
    torch.cuda.synchronize()
    sglang_oobguard.check()
    (v,) = sglang_oobguard.violations()
    assert (v.calls, v.total_bad) == (400, 200 * 1 + 200 * 2)
    assert (v.bad, v.pos, v.value) in ((1, 1, SIZE + 1), (2, 0, SIZE + 2))  # one call's details, not a mix
