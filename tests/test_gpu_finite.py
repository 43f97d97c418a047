"""GPU-only: the value check (SGLANG_OOBGUARD_FINITE) on CUDA tensors: strict's device-side
assert, a NaN written inside a captured CUDA graph found at its replay, and no compile
after a pool's warm-up. Skipped without CUDA (ci/gpu-check.sh runs it on the GPU machine);
on the CPU tests/test_finite.py runs the same kernel in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import Layer, cuda_kv, cuda_pool, run_python
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.violation import FINITE_ASSERT
from test_gpu import triton_compiles

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_strict_traps_in_the_value_kernel_before_the_write():
    code = (
        "import torch, sglang_oobguard\n"
        "from sglang.srt.mem_cache import memory_pool as mp\n"
        "sglang_oobguard.install('strict')\n"
        "pool = mp.MHATokenToKVPool(64, 1, torch.bfloat16, 8, 128, 4, 'cuda', False)\n"
        "class L: layer_id = 2\n"
        "k = torch.randn(2, 8, 128, dtype=torch.bfloat16, device='cuda')\n"
        "k[1, 3, 5] = float('nan')\n"
        "pool.set_kv_buffer(L, torch.tensor([1, 2], device='cuda'), k, k)\n"
        "print('enqueued', flush=True)\n"
        "torch.cuda.synchronize()\n"
        "print('survived')\n"
    )
    proc = run_python(code, {"TRITON_INTERPRET": None, "SGLANG_OOBGUARD_FINITE": "1"})
    assert "enqueued" in proc.stdout and "survived" not in proc.stdout and proc.returncode != 0
    assert FINITE_ASSERT[:60] in proc.stdout + proc.stderr


def test_a_nan_written_in_a_captured_graph_is_found_at_its_replay(mp, guard):
    guard("raise", poll_every=1000, finite=True)
    pool = cuda_pool(mp)
    loc = torch.tensor([1, 2, 3, 4], device="cuda")
    k, v = cuda_kv(4), cuda_kv(4)
    pool.set_kv_buffer(Layer(0), loc, k, v)  # sglang's eager warm-up before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(0), loc, k, v)
    graph.replay()
    sglang_oobguard.check()  # clean
    v[2, 5, 7] = float("-inf")
    graph.replay()
    with pytest.raises(KVOutOfBoundsError, match=r"layer 0: cache_v of loc\[2\] \(slot 3\) head 5 is -inf"):
        sglang_oobguard.check()
    assert torch.isneginf(pool.v_buffer[0][3, 5, 7])  # written unchanged


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_no_compile_after_a_pools_warm_up(mp, guard, mode):
    guard(mode, poll_every=1, finite=True)
    pool = cuda_pool(mp)  # built here: its warm-up compiles every value variant
    torch.cuda.synchronize()
    with triton_compiles() as later:
        for n in (1, 7, 300):
            for dtype in (torch.bfloat16, torch.float16, torch.float32):
                kv = torch.randn(n, 8, 128, dtype=dtype, device="cuda")
                for ids in (torch.int32, torch.int64):
                    pool.set_kv_buffer(Layer(1), torch.arange(1, n + 1, device="cuda", dtype=ids), kv, kv)
        torch.cuda.synchronize()
    ours = [name for name in later if name.startswith("sglang_oobguard")]
    assert ours == [], ours
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []
