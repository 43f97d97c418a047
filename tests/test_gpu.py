"""GPU-only: the fused kernel on CUDA tensors, eager and inside a CUDA graph, and
what the guarded path costs the host, counted: syncs, compiles, launches.
Skipped cleanly on machines without CUDA (see bench/gpu_probe.py for the numbers;
ci/gpu-check.sh runs this file on the GPU machine)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import pytest
import torch

import sglang_oobguard
from helpers import Layer, cuda_kv, cuda_pool, run_python, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.violation import FINITE_ASSERT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

HIGH = 65
MODES = ("strict", "raise", "warn")


STRICT_SCRIPT = (
    "import torch, sglang_oobguard\n"
    "from sglang.srt.mem_cache import memory_pool as mp\n"
    "sglang_oobguard.install('strict')\n"
    "pool = mp.MHATokenToKVPool(64, 1, torch.bfloat16, 8, 128, 4, 'cuda', False)\n"
    "class L: layer_id = 2\n"
    "k = torch.randn(2, 8, 128, dtype=torch.bfloat16, device='cuda')\n"
    "{fault}"
    "pool.set_kv_buffer(L, torch.tensor({loc}, device='cuda'), k, k)\n"
    "print('enqueued', flush=True)\n"
    "torch.cuda.synchronize()\n"
    "print('survived')\n"
)


@pytest.mark.parametrize("loc,fault,env,text", [
    ([1, 70], "", {}, "set_kv_buffer (MHA): KV slot id outside [0, size + page_size)"),
    ([1, 2], "k[1, 3, 5] = float('nan')\n", {"SGLANG_OOBGUARD_FINITE": "1"}, FINITE_ASSERT[:60]),  # the value kernel
], ids=["bad id", "nan value"])
def test_strict_fails_the_process_at_the_next_sync_naming_what_was_wrong(loc, fault, env, text):
    proc = run_python(STRICT_SCRIPT.format(fault=fault, loc=loc), {"TRITON_INTERPRET": None, **env})
    assert "enqueued" in proc.stdout and "survived" not in proc.stdout
    assert proc.returncode != 0
    assert text in proc.stdout + proc.stderr


def test_raise_surfaces_at_check_and_contains(mp, guard):
    guard("raise", poll_every=1000)
    pool = cuda_pool(mp)
    pool.set_kv_buffer(Layer(2), torch.tensor([1, 70, 3], device="cuda"), cuda_kv(3), cuda_kv(3))
    with pytest.raises(KVOutOfBoundsError, match=r"layer 2: 1 of 3 slot ids outside \[0, 65\): loc\[1\] = 70"):
        sglang_oobguard.check()


def test_raise_surfaces_at_a_later_guarded_call_without_sync(mp, guard):
    guard("raise", poll_every=1)
    pool = cuda_pool(mp)
    pool.set_kv_buffer(Layer(0), torch.tensor([-1], device="cuda"), cuda_kv(1), cuda_kv(1))  # recorded; mirror copy enqueued
    torch.cuda.synchronize()  # let the copy land; the guard itself never waits
    with pytest.raises(KVOutOfBoundsError, match=r"loc\[0\] = -1"):
        pool.set_kv_buffer(Layer(0), torch.tensor([6], device="cuda"), cuda_kv(1), cuda_kv(1))


def test_warn_keeps_every_other_row_intact(mp, guard):
    guard("warn")
    pool = cuda_pool(mp)
    before = pool.k_buffer[1].clone()
    k = cuda_kv(3)
    pool.set_kv_buffer(Layer(1), torch.tensor([7, HIGH + 9, 8], device="cuda"), k, k)
    sglang_oobguard.check()
    after = pool.k_buffer[1]
    assert torch.equal(after[1:7], before[1:7]) and torch.equal(after[9:], before[9:])
    assert torch.equal(after[7], k[0]) and torch.equal(after[8], k[2])
    (v,) = sglang_oobguard.violations()
    assert (v.pos, v.value) == (1, HIGH + 9)


@pytest.mark.parametrize("finite", [False, True], ids=["bad id", "nan value"])
def test_cuda_graph_replay_checks_again(mp, guard, finite):
    """A captured probe re-reads its ids, and (SGLANG_OOBGUARD_FINITE) the values, at every replay."""
    guard("raise", poll_every=1000, finite=finite)
    pool = cuda_pool(mp)
    loc = torch.tensor([1, 2, 3, 4], device="cuda")
    k, v = cuda_kv(4), cuda_kv(4)
    pool.set_kv_buffer(Layer(0), loc, k, v)  # warm-up: compiles outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pool.set_kv_buffer(Layer(0), loc, k, v)
    graph.replay()
    sglang_oobguard.check()  # clean
    if finite:
        v[2, 5, 7] = float("-inf")
    else:
        loc.copy_(torch.tensor([1, 2, 99, 4], device="cuda"))
    graph.replay()
    expected = r"layer 0: cache_v of loc\[2\] \(slot 3\) head 5 is -inf" if finite else r"loc\[2\] = 99"
    with pytest.raises(KVOutOfBoundsError, match=expected):
        sglang_oobguard.check()
    if finite:
        assert torch.isneginf(pool.v_buffer[0][3, 5, 7])  # written unchanged


def test_liveness_on_cuda_catches_a_freed_slot_in_the_probe_and_in_a_graph(mp, guard):
    """One launch checks bound and liveness; a graph replay re-reads the shadow."""
    from sglang.srt.mem_cache import allocator

    guard("raise", poll_every=1000, liveness=True)
    pool = cuda_pool(mp)
    alloc = token_allocator(allocator, pool)
    loc = alloc.alloc(3)
    k = cuda_kv(3)
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


@contextmanager
def sync_errors() -> Iterator[None]:
    """torch's own sync detector: any host sync in the block raises a RuntimeError."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_the_sync_detector_is_live():
    """The no-sync tests below count on this: a host sync does raise in the block."""
    with pytest.raises(RuntimeError, match="synchroniz"), sync_errors():
        torch.ones(1, device="cuda").item()


@pytest.mark.parametrize("liveness", [False, True], ids=["bound", "liveness"])
@pytest.mark.parametrize("mode", MODES)
def test_the_guarded_path_never_syncs_the_host(mp, guard, mode, liveness, record_property):
    """Writes (and, with liveness, sglang's alloc and free) after warm-up, polling the
    record on every call, under torch's sync detector: sglang's own path first, then
    the guarded one."""
    from sglang.srt.mem_cache import allocator

    pool = cuda_pool(mp)
    k = cuda_kv(4)

    def serve(alloc) -> int:
        """Eight decode-like steps: alloc, write four layers, free every other step; the writes made."""
        writes = 0
        for step in range(8):
            loc = alloc.alloc(4)
            for layer in range(4):
                pool.set_kv_buffer(Layer(layer), loc, k, k)
                writes += 1
            if step % 2:
                alloc.free(loc)
        return writes

    serve(token_allocator(allocator, pool))  # warm-up, unguarded
    with sync_errors():
        serve(token_allocator(allocator, pool))  # sglang's own path must not sync, or this test proves nothing
    guard(mode, poll_every=1, liveness=liveness)
    alloc = token_allocator(allocator, pool)
    serve(alloc)  # warm-up: compiles, the first mirror copies
    torch.cuda.synchronize()
    with sync_errors():
        writes = serve(alloc)
    record_property("guarded_writes_without_sync", writes)
    sglang_oobguard.check()  # a check point may sync: outside the block
    assert sglang_oobguard.violations() == []


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The Triton kernels compiled (or loaded from the disk cache) into this process
    while the block runs, as module.name: triton calls knobs.runtime.jit_post_compile_hook
    after each (triton 3.x)."""
    import triton

    runtime = triton.knobs.runtime
    earlier = runtime.jit_post_compile_hook
    seen: list[str] = []

    def hook(**info):
        seen.append(f"{info['fn'].module}.{info['fn'].name}")
        return earlier(**info) if earlier else None

    runtime.jit_post_compile_hook = hook
    try:
        yield seen
    finally:
        runtime.jit_post_compile_hook = earlier


@pytest.mark.parametrize("mode", MODES)
def test_no_compile_after_one_warm_up_call_per_site(mp, guard, mode, record_property):
    """After install(), pool construction and one warm-up call per site, serving
    compiles nothing: not for another pool's bound, layer, length, or a `loc` that
    is a view at an odd offset (two-batch overlap slices out_cache_loc)."""
    guard(mode, poll_every=1)
    small, large = cuda_pool(mp, 64), cuda_pool(mp, 1000)
    mla = mp.MLATokenToKVPool(64, 1, torch.bfloat16, 16, 16, 2, "cuda", False)

    def bf16(n: int, width: int) -> torch.Tensor:
        return torch.randn(n, 1, width, dtype=torch.bfloat16, device="cuda")

    sites: dict[str, Callable[[object, torch.Tensor, int], None]] = {
        "set_kv_buffer (MHA)": lambda pool, loc, layer: pool.set_kv_buffer(Layer(layer), loc, cuda_kv(len(loc)),
                                                                            cuda_kv(len(loc))),
        "set_kv_buffer (MLA)": lambda pool, loc, layer: pool.set_kv_buffer(Layer(layer), loc, bf16(len(loc), 32),
                                                                            None),
        "set_mla_kv_buffer (MLA)": lambda pool, loc, layer: pool.set_mla_kv_buffer(
            Layer(layer), loc, bf16(len(loc), 16), bf16(len(loc), 16)),
    }
    pools = {"set_kv_buffer (MHA)": (small, large), "set_kv_buffer (MLA)": (mla,), "set_mla_kv_buffer (MLA)": (mla,)}
    with triton_compiles() as warm:
        for label, write in sites.items():
            write(pools[label][0], torch.tensor([1, 2], device="cuda"), 0)
        torch.cuda.synchronize()
    base = torch.arange(0, 64, device="cuda")
    with triton_compiles() as later:
        for label, write in sites.items():
            for pool in pools[label]:
                for loc in (base[1:2], base[1:8], base[3:60], base[5:6].clone(), base.flip(0)[:40]):
                    write(pool, loc, 1)
        torch.cuda.synchronize()
    ours = [name for name in later if name.startswith("sglang_oobguard")]
    record_property("compiles_at_warm_up", len(warm))
    record_property("compiles_after_warm_up_ours", len(ours))
    record_property("compiles_after_warm_up_sglang", len(later) - len(ours))
    assert ours == [], f"{len(ours)} compiles of ours after warm-up: {ours} (warm-up compiled {warm})"
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_the_value_kernel_compiles_nothing_after_a_pools_warm_up(mp, guard, mode):
    """SGLANG_OOBGUARD_FINITE: the pool's construction compiles every value variant (dtype, id dtype)."""
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


def cuda_kernels(fn: Callable[[], None], calls: int = 5) -> tuple[float, list[str]]:
    """GPU kernels per call of `fn` seen by torch.profiler (copies and memsets aside), and their names."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and not any(word in e.name.lower() for word in ("memcpy", "memset"))]
    return len(names) / calls, sorted(set(names))


@pytest.mark.parametrize("mode,liveness", [(m, False) for m in MODES] + [("strict", True)],
                         ids=[*MODES, "strict+liveness"])
def test_one_launch_per_guarded_write_and_per_layer_of_a_decode_step(mp, guard, mode, liveness, record_property):
    """One probe launch per guarded call, on top of sglang's own kernels; so L per
    decode step of an L-layer stack."""
    from sglang.srt.mem_cache import allocator

    layers = 8
    guard(mode, liveness=liveness)
    pool = cuda_pool(mp, layers=layers)
    k = cuda_kv(16)
    # with liveness: slots handed out by sglang's allocator, so the probe reads the shadow too
    loc = token_allocator(allocator, pool).alloc(16) if liveness else torch.arange(1, 17, device="cuda")

    def write() -> None:
        pool.set_kv_buffer(Layer(0), loc, k, k)

    def step() -> None:
        for layer in range(layers):
            pool.set_kv_buffer(Layer(layer), loc, k, k)

    guarded_write, names = cuda_kernels(write)
    guarded_step, _ = cuda_kernels(step)
    sglang_oobguard.check()
    assert sglang_oobguard.violations() == []
    sglang_oobguard.uninstall()  # the same pool, sglang's own methods again
    plain_write, plain_names = cuda_kernels(write)
    plain_step, _ = cuda_kernels(step)
    record_property("launches_per_write", f"{plain_write:g} unguarded, {guarded_write:g} guarded")
    record_property("launches_per_step", f"{plain_step:g} unguarded, {guarded_step:g} guarded ({layers} layers)")
    assert guarded_write - plain_write == 1, f"guarded {names}, unguarded {plain_names}"
    assert guarded_step - plain_step == layers


def test_each_captured_graph_holds_one_probe_after_sglangs_eager_warm_up(mp, guard, monkeypatch, record_property):
    """sglang's capture: per batch size, eager runs with the same buffers, then the
    capture. The eager runs (outside any forward step) probe every write; each capture
    holds exactly one probe for its L layers, and that probe re-checks at every replay."""
    from sglang_oobguard.probes import kernels

    layers = 8
    guard("raise", poll_every=1000)
    pool = cuda_pool(mp, layers=layers)
    k = cuda_kv(4)
    real, launches = kernels.launch, []
    monkeypatch.setattr(kernels, "launch", lambda *a, **kw: launches.append(torch.cuda.is_current_stream_capturing())
                        or real(*a, **kw))
    graphs = {}
    for bs in (2, 4):
        loc = torch.arange(1, bs + 1, device="cuda")

        def step(loc=loc, bs=bs) -> None:
            for layer in range(layers):
                pool.set_kv_buffer(Layer(layer), loc, k[:bs], k[:bs])

        step()
        step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graphs[bs] = (graph, loc)
    record_property("probes_captured", f"{launches.count(True)} in {len(graphs)} graphs of {layers} layers")
    record_property("probes_eager_warm_up", launches.count(False))
    assert launches.count(True) == len(graphs) and launches.count(False) == 2 * len(graphs) * layers
    for bs, (graph, loc) in graphs.items():
        graph.replay()
        sglang_oobguard.check()
        loc[-1] = 64 + 5
        graph.replay()
        with pytest.raises(KVOutOfBoundsError, match=r"= 69"):  # a new violating call (the record keeps the first's details)
            sglang_oobguard.check()
        loc[-1] = bs
