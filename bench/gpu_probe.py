"""GPU benchmark: our fused probe against upstream's `maybe_detect_oob`, on one GPU.

    python bench/gpu_probe.py             # on an H100/H200-class GPU, under 5 minutes
    python bench/gpu_probe.py --dry-run   # on a CPU: the same code on CPU tensors
                                          # (Triton interpreter, tiny counts); proves it runs,
                                          # its numbers mean nothing

For N = 1, 64, 1024, 8192 slot ids it measures, side by side in one run:
  - launches per call: GPU kernels (memcpys excluded) seen by torch.profiler;
  - eager microseconds per call (CUDA events around 2000 calls);
  - microseconds per call inside a replayed CUDA graph holding 200 calls;
and the added time per step of a synthetic decode step of 80 guarded `set_kv_buffer`
layer writes (real sglang MHA pool, bf16, 8 KV heads x 128, 64 tokens) captured in a
CUDA graph, against the same step unguarded and with upstream's probe.
Both probes run in strict form: upstream's two `torch._assert_async`, our kernel
with its `tl.device_assert`. Targets: 1 launch; at most 1/3 of upstream's time in
graph replay. "ours+live" is the same probe with the liveness shadow
(SGLANG_OOBGUARD_LIVENESS=1): the expectation is one extra byte gather per id inside
the same launch, so still 1 launch and a graph time close to ours; the decode step
adds the same variant with every slot handed out by sglang's own allocator.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Callable

import torch

SIZE, HEADS, DIM, LAYERS, DECODE_TOKENS = 65536, 8, 128, 80, 64
HIGH = SIZE + 1


class Layer:
    """What the pool reads of sglang's RadixAttention: its layer id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


class Clock:
    """CUDA events and graphs on a GPU; perf_counter and plain replays in a dry run."""

    def __init__(self, device: str) -> None:
        self.cuda = device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time_us(self, fn: Callable[[], None], calls: int) -> float:
        fn()
        self.sync()
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(calls):
                fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end) * 1000 / calls
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) * 1e6 / calls

    def graph(self, fn: Callable[[], None]) -> Callable[[], None]:
        """A replayable capture of `fn` (a dry run replays `fn` itself)."""
        if not self.cuda:
            return fn
        fn()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return graph.replay

    def launches(self, fn: Callable[[], None], calls: int) -> float:
        """Device kernels per call (a dry run counts CPU-side aten ops instead)."""
        from torch.profiler import ProfilerActivity, profile

        fn()
        self.sync()
        activity = ProfilerActivity.CUDA if self.cuda else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(calls):
                fn()
            self.sync()
        events = prof.events()
        if self.cuda:
            kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA
                       and "memcpy" not in e.name.lower() and "memset" not in e.name.lower()]
        else:
            kernels = [e for e in events if e.name.startswith("aten::")]
        return len(kernels) / calls


def probe_rows(clock: Clock, device: str, dry: bool) -> list[dict]:
    from sglang.srt.utils.async_probe import maybe_detect_oob
    from sglang_oobguard import probe

    os.environ["SGLANG_ENABLE_ASYNC_ASSERT"] = "1"  # upstream's probe is gated on it
    record = probe.new_record(device)
    live = probe.new_live(HIGH, 1, torch.device(device))
    live.flags.fill_(1)
    message = "sglang_oobguard: set_kv_buffer (MHA): KV slot id outside [0, 65537)"
    rows = []
    for n in (1, 64, 1024, 8192):
        loc = torch.randint(1, SIZE, (n,), device=device)
        ours = lambda: probe.launch(loc, HIGH, 0, 0, record, message)  # noqa: E731
        theirs = lambda: maybe_detect_oob(loc, 0, HIGH, "set_kv_buffer (MHA)")  # noqa: E731
        with_live = lambda: probe.launch(loc, HIGH, 0, 0, record, message, live=live)  # noqa: E731
        calls, in_graph = (3, 2) if dry else (2000, 200)

        def graphed(fn: Callable[[], None]) -> Callable[[], None]:
            return clock.graph(lambda: [fn() for _ in range(in_graph)])

        g_ours, g_theirs, g_live = graphed(ours), graphed(theirs), graphed(with_live)
        rows.append({
            "n": n,
            "launches_ours": clock.launches(ours, 3 if dry else 20),
            "launches_theirs": clock.launches(theirs, 3 if dry else 20),
            "launches_live": clock.launches(with_live, 3 if dry else 20),
            "eager_ours": clock.time_us(ours, calls),
            "eager_theirs": clock.time_us(theirs, calls),
            "graph_ours": clock.time_us(g_ours, 2 if dry else 20) / in_graph,
            "graph_theirs": clock.time_us(g_theirs, 2 if dry else 20) / in_graph,
            "graph_live": clock.time_us(g_live, 2 if dry else 20) / in_graph,
        })
    os.environ.pop("SGLANG_ENABLE_ASYNC_ASSERT")
    return rows


def decode_rows(clock: Clock, device: str, dry: bool) -> dict:
    import sglang_oobguard
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layers = 4 if dry else LAYERS
    pool = MHATokenToKVPool(SIZE, 1, torch.bfloat16, HEADS, DIM, layers, device, False)
    loc = torch.randperm(SIZE, device=device)[:DECODE_TOKENS] + 1
    k = torch.randn(DECODE_TOKENS, HEADS, DIM, dtype=torch.bfloat16, device=device)
    ids = [Layer(i) for i in range(layers)]

    def step() -> None:
        for layer in ids:
            pool.set_kv_buffer(layer, loc, k, k)

    out = {"layers": layers}
    for variant in ("unguarded", "ours", "upstream", "liveness"):
        os.environ.pop("SGLANG_ENABLE_ASYNC_ASSERT", None)
        sglang_oobguard.uninstall()
        if variant == "ours":
            sglang_oobguard.install("strict")
        elif variant == "liveness":
            os.environ["SGLANG_OOBGUARD_LIVENESS"] = "1"
            sglang_oobguard.install("strict")
            os.environ.pop("SGLANG_OOBGUARD_LIVENESS")
            TokenToKVPoolAllocator(SIZE, torch.bfloat16, device, pool, False).alloc(SIZE)  # every slot live
        elif variant == "upstream":
            os.environ["SGLANG_ENABLE_ASYNC_ASSERT"] = "1"
        replay = clock.graph(step)  # the guard's code runs at capture; replays are pure device work
        out[variant] = statistics.median(clock.time_us(replay, 2 if dry else 50) for _ in range(3 if dry else 7))
    os.environ.pop("SGLANG_ENABLE_ASYNC_ASSERT", None)
    sglang_oobguard.uninstall()
    sglang_oobguard.check()
    return out


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, Triton interpreter, tiny counts")
    args = parser.parse_args()
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
        device = "cpu"
    elif not torch.cuda.is_available():
        print("no CUDA GPU here: run with --dry-run", file=sys.stderr)
        return 2
    else:
        device = "cuda"
    clock = Clock(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run: numbers are meaningless)"
    print(f"GPU probe benchmark on {name}, torch {torch.__version__}\n")
    print("| N | launches ours | launches upstream | launches ours+live | eager ours | eager upstream | graph ours "
          "| graph upstream | graph ours/upstream | graph ours+live | ours+live/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in probe_rows(clock, device, args.dry_run):
        ratio = r["graph_ours"] / r["graph_theirs"]
        print(f"| {r['n']} | {r['launches_ours']:.2f} | {r['launches_theirs']:.2f} | {r['launches_live']:.2f} "
              f"| {r['eager_ours']:.2f} us | {r['eager_theirs']:.2f} us | {r['graph_ours']:.2f} us "
              f"| {r['graph_theirs']:.2f} us | {ratio:.2f}x ({'meets' if ratio <= 1 / 3 else 'MISSES'} <= 0.33x) "
              f"| {r['graph_live']:.2f} us | {r['graph_live'] / r['graph_ours']:.2f}x |")
    d = decode_rows(clock, device, args.dry_run)
    print(f"\nDecode step in a CUDA graph ({d['layers']} layer writes, {DECODE_TOKENS} tokens): unguarded "
          f"{d['unguarded']:.1f} us; ours +{(d['ours'] / d['unguarded'] - 1) * 100:.1f}%; upstream "
          f"+{(d['upstream'] / d['unguarded'] - 1) * 100:.1f}%; ours with liveness "
          f"+{(d['liveness'] / d['unguarded'] - 1) * 100:.1f}%")
    return 0


if __name__ == "__main__":
    sys.exit(main())
