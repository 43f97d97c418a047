"""Why N = 256 costs more than the probe: on the CPU, any op run between two KV writes
slows the next write. Times the bare 256-token write of the real MHA pool, and the
same write preceded by other work, interleaved round by round (medians, microseconds).

    .venv/bin/python bench/interleave.py     # ~30 seconds
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


class Layer:
    layer_id = 0


def main() -> None:
    torch.set_num_threads(1)
    import sglang_oobguard
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang_oobguard.probes import hostscan as probe

    pool = MHATokenToKVPool(8192, 1, torch.bfloat16, 8, 128, 1, "cpu", False)
    loc = torch.randperm(8192)[:256] + 1
    k = torch.randn(256, 8, 128, dtype=torch.bfloat16)
    sglang_oobguard.install("strict")
    original = type(pool).__dict__["set_kv_buffer"].__wrapped__

    def write() -> None:
        original(pool, Layer, loc, k, k)

    variants: dict[str, Callable[[], object]] = {
        "bare write": write,
        "torch.empty(1), then the write": lambda: (torch.empty(1), write()),
        "numpy min of loc, then the write": lambda: (loc.numpy().min(), write()),
        "our host scan, then the write": lambda: (probe.scan_host(loc, 8193), write()),
        "the guarded write (wrapper + scan)": lambda: pool.set_kv_buffer(Layer, loc, k, k),
    }
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(15):
        for name, fn in variants.items():
            fn()
            start = time.perf_counter_ns()
            for _ in range(80):
                fn()
            samples[name].append((time.perf_counter_ns() - start) / 80 / 1000)
    start = time.perf_counter_ns()
    for _ in range(2000):
        probe.scan_host(loc, 8193)
    scan_us = (time.perf_counter_ns() - start) / 2000 / 1000
    for name, values in samples.items():
        print(f"{name:40} {statistics.median(values):8.1f} us")
    print(f"{'our host scan alone':40} {scan_us:8.1f} us")
    sglang_oobguard.uninstall()


if __name__ == "__main__":
    main()
