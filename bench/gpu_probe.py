"""GPU benchmark: our fused probe against upstream's `maybe_detect_oob`, on one GPU.

    python bench/gpu_probe.py [--json PATH]            # on an H100/H200-class GPU, about 2 minutes
    python bench/gpu_probe.py --dry-run [--json PATH]  # on a CPU: the same code on CPU tensors
                                                       # (Triton interpreter, tiny counts, N up to
                                                       # 1024); proves it runs, its numbers mean nothing

For N = 1, 64, 1024, 8192 and 65536 slot ids it measures, side by side in one run:
  - the probes alone (ours called directly, upstream's `maybe_detect_oob`): launches
    per call (GPU kernels seen by torch.profiler, memcpy/memset excluded), eager
    microseconds per call (CUDA events around many calls), host microseconds per call
    (perf_counter around many calls, no sync in the loop: what the CPU pays to
    enqueue), and microseconds per call inside a replayed CUDA graph;
  - the public path: a real sglang `MHATokenToKVPool.set_kv_buffer` (bf16, 8 KV heads
    x 128) unguarded, guarded by install("strict"), guarded with liveness (every slot
    handed out by sglang's own allocator), unguarded with upstream's flag
    SGLANG_ENABLE_ASYNC_ASSERT=1, and guarded with SGLANG_OOBGUARD_FINITE=1 (the value
    kernel reads K and V once: its cost against the write's own traffic): host and eager
    microseconds and launches per call;
a synthetic decode step of 80 `set_kv_buffer` layer writes (64 tokens) captured in
a CUDA graph: unguarded, ours (the capture holds one probe for the 80 writes),
upstream's flag, ours with liveness; and, for large prefill chunks (8192 and 65536
ids), the probe as one program against the split over several programs.
Both probes run in strict form: upstream's two `torch._assert_async`, our kernel
with its `tl.device_assert`. Targets: 1 launch; at most 1/3 of upstream's time in
graph replay. "ours+live" is the same probe with the liveness shadow: one extra byte
gather per id inside the same launch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

SIZE, HEADS, DIM, LAYERS, DECODE_TOKENS = 65536, 8, 128, 80, 64
HIGH = SIZE + 1
SIZES = (1, 64, 1024, 8192, 65536)
DRY_SIZES = SIZES[:3]  # the Triton interpreter takes about a second per call at 65536 ids
WRITE_VARIANTS = ("unguarded", "guarded", "liveness", "upstream", "finite")


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
        """Device time per call (CUDA events around `calls` calls)."""
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
        return self.host_us(fn, calls)

    def host_us(self, fn: Callable[[], None], calls: int) -> float:
        """Host time per call: perf_counter around `calls` calls, no sync inside."""
        fn()
        self.sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        elapsed = time.perf_counter() - t0
        self.sync()
        return elapsed * 1e6 / calls

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


def direct_probe(device: str) -> Callable[[torch.Tensor, bool], Callable[[], None]]:
    """Our kernel called directly, in strict form, for the probe-alone rows. The only
    code here that knows `probe`'s internals (record, shadow, launch's signature):
    everything else goes through the public API."""
    from sglang_oobguard.probes import kernels as probe, shadow
    from sglang_oobguard.probes.record import PoolRecord

    record = PoolRecord(torch.device(device)).tensor
    scratch = torch.tensor(probe.SCRATCH_INIT, dtype=torch.int64, device=device)
    step = torch.zeros(1, dtype=torch.int64, device=device)
    live = shadow.new_live(HIGH, 1, torch.device(device))
    live.flags.fill_(1)
    message = "sglang_oobguard: set_kv_buffer (MHA): KV slot id outside [0, size + page_size)"

    def make(loc: torch.Tensor, with_live: bool) -> Callable[[], None]:
        return lambda: probe.launch(loc, HIGH, 0, 0, record, scratch, step, None, message,
                                    live=live if with_live else None)

    return make


def probe_rows(clock: Clock, device: str, dry: bool) -> list[dict]:
    from sglang.srt.utils.async_probe import maybe_detect_oob

    os.environ["SGLANG_ENABLE_ASYNC_ASSERT"] = "1"  # upstream's probe is gated on it
    make = direct_probe(device)
    rows = []
    for n in DRY_SIZES if dry else SIZES:
        loc = torch.randint(1, SIZE, (n,), device=device)
        ours, with_live = make(loc, False), make(loc, True)
        theirs = lambda: maybe_detect_oob(loc, 0, HIGH, "set_kv_buffer (MHA)")  # noqa: E731
        calls, in_graph, replays, profiled = (3, 2, 2, 3) if dry else (2000, 200, 20, 20)

        def graphed(fn: Callable[[], None]) -> Callable[[], None]:
            return clock.graph(lambda: [fn() for _ in range(in_graph)])

        g_ours, g_theirs, g_live = graphed(ours), graphed(theirs), graphed(with_live)
        rows.append({
            "n": n,
            "launches_ours": clock.launches(ours, profiled),
            "launches_theirs": clock.launches(theirs, profiled),
            "launches_live": clock.launches(with_live, profiled),
            "eager_ours": clock.time_us(ours, calls),
            "eager_theirs": clock.time_us(theirs, calls),
            "host_ours": clock.host_us(ours, calls),
            "host_theirs": clock.host_us(theirs, calls),
            "graph_ours": clock.time_us(g_ours, replays) / in_graph,
            "graph_theirs": clock.time_us(g_theirs, replays) / in_graph,
            "graph_live": clock.time_us(g_live, replays) / in_graph,
        })
    os.environ.pop("SGLANG_ENABLE_ASYNC_ASSERT")
    return rows


def split_rows(clock: Clock, device: str, dry: bool) -> list[dict]:
    """Large prefill chunks: the probe as one program walking every id, against the
    split over several programs that fold with atomics (probe.SPLIT_ABOVE), in a graph."""
    from sglang_oobguard.probes import kernels as probe

    make = direct_probe(device)
    rows = []
    defaults = probe.SPLIT_ABOVE, probe.SPLIT_CHUNK
    for n in (1024,) if dry else (8192, 65536):
        loc = torch.randint(1, SIZE, (n,), device=device)
        row: dict = {"n": n}
        for variant, split in (("one_program", (2**62, defaults[1])), ("split", (0, min(defaults[1], n // 4)))):
            probe.SPLIT_ABOVE, probe.SPLIT_CHUNK = split
            fn = make(loc, False)
            replay = clock.graph(lambda fn=fn: [fn() for _ in range(20)])
            row[variant] = clock.time_us(replay, 2 if dry else 50) / 20
            row[f"programs_{variant}"] = probe.programs(n)[0]
        probe.SPLIT_ABOVE, probe.SPLIT_CHUNK = defaults
        rows.append(row)
    return rows


def set_variant(variant: str, pool, device: str) -> None:
    """Put the process in one write variant: no guard, our guard (with or without
    liveness, every slot then handed out by sglang's allocator), or upstream's flag."""
    import sglang_oobguard
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    os.environ.pop("SGLANG_ENABLE_ASYNC_ASSERT", None)
    sglang_oobguard.uninstall()
    if variant == "guarded":
        sglang_oobguard.install("strict")
    elif variant == "liveness":
        os.environ["SGLANG_OOBGUARD_LIVENESS"] = "1"
        sglang_oobguard.install("strict")
        os.environ.pop("SGLANG_OOBGUARD_LIVENESS")
        TokenToKVPoolAllocator(SIZE, torch.bfloat16, device, pool, False).alloc(SIZE)  # every slot live
    elif variant == "upstream":
        os.environ["SGLANG_ENABLE_ASYNC_ASSERT"] = "1"
    elif variant == "finite":  # the value check of K and V too: one more launch per part
        os.environ["SGLANG_OOBGUARD_FINITE"] = "1"
        sglang_oobguard.install("strict")
        os.environ.pop("SGLANG_OOBGUARD_FINITE")


def write_rows(clock: Clock, device: str, dry: bool) -> list[dict]:
    """The public path: one set_kv_buffer per call on a one-layer real sglang pool."""
    import sglang_oobguard
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    pool = MHATokenToKVPool(SIZE, 1, torch.bfloat16, HEADS, DIM, 1, device, False)
    layer = Layer(0)
    inputs = {n: (torch.randperm(SIZE, device=device)[:n] + 1,
                  torch.randn(n, HEADS, DIM, dtype=torch.bfloat16, device=device))
              for n in (DRY_SIZES if dry else SIZES)}
    calls, profiled = (3, 3) if dry else (1000, 20)
    rows = {n: {"n": n} for n in inputs}
    for variant in WRITE_VARIANTS:
        set_variant(variant, pool, device)
        for n, (loc, k) in inputs.items():
            write = lambda: pool.set_kv_buffer(layer, loc, k, k)  # noqa: E731
            rows[n][f"host_{variant}"] = clock.host_us(write, calls)
            rows[n][f"eager_{variant}"] = clock.time_us(write, calls)
            rows[n][f"launches_{variant}"] = clock.launches(write, profiled)
    set_variant("unguarded", pool, device)
    sglang_oobguard.check()
    return list(rows.values())


def decode_rows(clock: Clock, device: str, dry: bool) -> dict:
    import sglang_oobguard
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    layers = 4 if dry else LAYERS
    pool = MHATokenToKVPool(SIZE, 1, torch.bfloat16, HEADS, DIM, layers, device, False)
    loc = torch.randperm(SIZE, device=device)[:DECODE_TOKENS] + 1
    k = torch.randn(DECODE_TOKENS, HEADS, DIM, dtype=torch.bfloat16, device=device)
    ids = [Layer(i) for i in range(layers)]

    def step() -> None:
        for layer in ids:
            pool.set_kv_buffer(layer, loc, k, k)

    out: dict = {"layers": layers, "tokens": DECODE_TOKENS}
    for variant, label in (("unguarded", "unguarded"), ("guarded", "ours"), ("upstream", "upstream"),
                           ("liveness", "liveness")):
        set_variant(variant, pool, device)
        replay = clock.graph(step)  # the guard's code runs at capture; replays are pure device work
        out[label] = statistics.median(clock.time_us(replay, 2 if dry else 50) for _ in range(3 if dry else 7))
    set_variant("unguarded", pool, device)
    sglang_oobguard.check()
    return out


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b > 0 else "n/a"


def print_tables(probes: list[dict], writes: list[dict], d: dict, splits: list[dict]) -> None:
    print("Probes alone (strict form): launches per call; eager = device us per call (events); host = us per "
          "call to enqueue (perf_counter, no sync); graph = us per call in a replayed CUDA graph\n")
    print("| N | launches ours | launches upstream | launches ours+live | eager ours | eager upstream | host ours "
          "| host upstream | host ours/upstream | graph ours | graph upstream | graph ours/upstream | graph ours+live "
          "| ours+live/ours |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in probes:
        g = r["graph_ours"] / r["graph_theirs"]
        print(f"| {r['n']} | {r['launches_ours']:.2f} | {r['launches_theirs']:.2f} | {r['launches_live']:.2f} "
              f"| {r['eager_ours']:.2f} us | {r['eager_theirs']:.2f} us | {r['host_ours']:.2f} us "
              f"| {r['host_theirs']:.2f} us | {ratio(r['host_ours'], r['host_theirs'])} "
              f"| {r['graph_ours']:.2f} us | {r['graph_theirs']:.2f} us "
              f"| {g:.2f}x ({'meets' if g <= 1 / 3 else 'MISSES'} <= 0.33x) "
              f"| {r['graph_live']:.2f} us | {ratio(r['graph_live'], r['graph_ours'])} |")
    print("\nPublic path: sglang MHATokenToKVPool.set_kv_buffer, one layer, bf16 8x128; host / eager us per call, "
          "launches per call; ratios against unguarded\n")
    print("| N | " + " | ".join(f"host {v}" for v in WRITE_VARIANTS) + " | "
          + " | ".join(f"eager {v}" for v in WRITE_VARIANTS) + " | "
          + " | ".join(f"launches {v}" for v in WRITE_VARIANTS) + " |")
    print("|---|" + "---|" * (3 * len(WRITE_VARIANTS)))
    for r in writes:
        cells = [f"{r[f'{m}_{v}']:.2f} us" + ("" if v == "unguarded" else f" ({ratio(r[f'{m}_{v}'], r[f'{m}_unguarded'])})")
                 for m in ("host", "eager") for v in WRITE_VARIANTS]
        cells += [f"{r[f'launches_{v}']:.2f}" for v in WRITE_VARIANTS]
        print(f"| {r['n']} | " + " | ".join(cells) + " |")
    print(f"\nDecode step in a CUDA graph ({d['layers']} layer writes, {d['tokens']} tokens): unguarded "
          f"{d['unguarded']:.1f} us; ours +{(d['ours'] / d['unguarded'] - 1) * 100:.1f}%; upstream "
          f"+{(d['upstream'] / d['unguarded'] - 1) * 100:.1f}%; ours with liveness "
          f"+{(d['liveness'] / d['unguarded'] - 1) * 100:.1f}%")
    print("\nLarge prefill chunks, us per probe in a graph: one program walking every id, against the ids split "
          "over several programs folded with atomics\n")
    print("| N | one program | split | programs | split/one |")
    print("|---|---|---|---|---|")
    for r in splits:
        print(f"| {r['n']} | {r['one_program']:.2f} us | {r['split']:.2f} us | {r['programs_split']} "
              f"| {ratio(r['split'], r['one_program'])} |")


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true", help="CPU tensors, Triton interpreter, tiny counts")
    parser.add_argument("--json", type=Path, help="also write every number measured here to this file")
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
    print(f"GPU probe benchmark on {name}, torch {torch.__version__}\n", flush=True)
    probes = probe_rows(clock, device, args.dry_run)
    writes = write_rows(clock, device, args.dry_run)
    decode = decode_rows(clock, device, args.dry_run)
    splits = split_rows(clock, device, args.dry_run)
    print_tables(probes, writes, decode, splits)
    if args.json:
        import sglang

        args.json.write_text(json.dumps({
            "device": name, "dry_run": args.dry_run, "torch": torch.__version__, "sglang": sglang.__version__,
            "probes": probes, "writes": writes, "decode": decode, "splits": splits,
        }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
