"""GPU-only: sglang's default GPU timing on a real device, the parts that
tests/test_gpu_model.py proves under the device model on the CPU: the host a step ahead
of the device (the overlap scheduler) and the report's delay in steps, eager and with
the layers' writes replayed from a CUDA graph; a pool resize and an uninstall after
capture. Skipped cleanly on machines without CUDA; ci/gpu-check.sh runs it."""

from __future__ import annotations

import gc

import pytest
import torch

import sglang_oobguard
from helpers import Layer, as_write_loc, cuda_kv, cuda_pool, decode_batch, model_runner_class, token_allocator
from sglang_oobguard import KVOutOfBoundsError

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

SIZE, LAYERS = 64, 4
BUSY_CYCLES = 50_000_000  # tens of ms of GPU time per step: the device is always behind the host's launches
LAG = 1  # sglang's overlap scheduler: the host launches step N + 1 before it reads step N's results


def captured_write(pool, loc, k):
    """One eager warm-up write (sglang's graph runner runs the model once first), then
    the same write captured in a CUDA graph."""
    pool.set_kv_buffer(Layer(0), loc, k, k)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(0), loc, k, k)
    return graph


def cuda_runner(mp, runner, monkeypatch, pool, graph: bool):
    """sglang's ModelRunner under the step hook; its model is the LAYERS layers' writes at
    out_cache_loc, made eagerly or replayed from a CUDA graph captured as sglang's graph
    runner captures (outside ModelRunner.forward, after one eager warm-up run)."""
    ModelRunner = model_runner_class()

    run = runner(pool)
    k = cuda_kv(3)
    static = torch.tensor([1, 2, 3], device="cuda")

    def layers(loc):
        for layer in range(LAYERS):
            pool.set_kv_buffer(Layer(layer), as_write_loc(mp, loc), k, k)

    if not graph:
        monkeypatch.setattr(ModelRunner.__dict__["forward"], "__wrapped__", lambda self, batch, *a, **kw: layers(batch.out_cache_loc))
        return run
    layers(static)
    torch.cuda.synchronize()
    captured = torch.cuda.CUDAGraph()
    with torch.cuda.graph(captured):
        layers(static)

    def replay(self, batch, *args, **kwargs):
        static.copy_(batch.out_cache_loc, non_blocking=True)
        captured.replay()

    monkeypatch.setattr(ModelRunner.__dict__["forward"], "__wrapped__", replay)
    return run


@pytest.mark.parametrize("graph", [False, True], ids=["eager", "cuda-graph"])
def test_overlap_report_delay_in_steps(mp, guard, runner, monkeypatch, record_property, graph):
    """The host LAG steps ahead of a device kept busy: a violation of step N is reported
    at a step boundary by step N + LAG + 1 (the bound the model proves on the CPU), and
    the hot path never waits for the device."""
    guard("warn")
    run = cuda_runner(mp, runner, monkeypatch, cuda_pool(mp), graph)
    bad, done = 3, []
    reported = -1
    for step in range(bad + LAG + 4):
        torch.cuda._sleep(BUSY_CYCLES)
        loc = torch.tensor([1, 2, SIZE + 5 if step == bad else 3], device="cuda")
        run.forward(decode_batch(loc))
        done.append(torch.cuda.Event())
        done[-1].record()
        if step >= LAG:
            done[step - LAG].synchronize()  # the scheduler reads step N - LAG's results
        if sglang_oobguard.violations():
            reported = step
            break
    record_property("report_delay_steps", reported - bad if reported >= 0 else "never")
    record_property("bound_steps", LAG + 1)
    assert bad + 1 <= reported <= bad + LAG + 1, f"violation of step {bad} reported at step {reported}"
    (v,) = sglang_oobguard.violations()
    assert (v.step, v.value) == (bad, SIZE + 5)


@pytest.mark.parametrize("size", [48, 96], ids=["shrink", "grow"])
def test_a_pool_resize_after_capture_keeps_the_shadow_the_graph_reads(mp, guard, size):
    """sglang sizes the KV pool after capture on some paths, then clears the allocator:
    the captured probe must read the live shadow (every id now free), not a freed one."""
    from sglang.srt.mem_cache import allocator

    guard("raise", poll_every=1000, liveness=True)
    pool = cuda_pool(mp)
    alloc = token_allocator(allocator, pool)
    loc, k = alloc.alloc(3), cuda_kv(3)
    graph = captured_write(pool, loc, k)
    graph.replay()
    sglang_oobguard.check()
    pool.size = alloc.size = size
    alloc.clear()
    gc.collect()
    torch.cuda.empty_cache()
    graph.replay()
    torch.cuda.synchronize()
    with pytest.raises(KVOutOfBoundsError, match=r"is not allocated \(freed\)"):
        sglang_oobguard.check()


def test_uninstall_keeps_what_a_captured_graph_holds(mp, guard):
    """A graph captured with the guard on replays after uninstall (its probe disarmed,
    its buffers kept), and sglang's write still lands."""
    guard("warn", poll_every=1000)
    pool = cuda_pool(mp)
    loc, k = torch.tensor([1, 2, 3], device="cuda"), cuda_kv(3)
    graph = captured_write(pool, loc, k)
    sglang_oobguard.uninstall()
    gc.collect()
    torch.cuda.empty_cache()
    k.copy_(cuda_kv(3))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(pool.k_buffer[0][1:4], k)
