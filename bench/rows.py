"""What the row check and the leak sweep's gate cost on the host: sglang's own ReqToTokenPool
and Req, one alloc of BATCH requests and their frees per round, unguarded and with the row
check (strict + liveness, in a fresh interpreter each); and the sweep's count over a shadow
of PAGES pages.

    .venv/bin/python bench/rows.py [--batch 8] [--rounds 2000] [--pages 1000000]

Best of 5 repeats of ROUNDS rounds; the numbers in docs/benchmarks.md came from this script.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROUNDS = """
import array, os, sys, time
if sys.argv[1] == "on":
    import sglang_oobguard
    sglang_oobguard.install("strict")
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
from sglang.srt.sampling.sampling_params import SamplingParams
batch, rounds = int(sys.argv[2]), int(sys.argv[3])
pool = ReqToTokenPool(size=4 * batch, max_context_len=8, device="cpu", enable_memory_saver=False)
reqs = [Req(f"r{i}", "hi", array.array("i", [1]), SamplingParams(max_new_tokens=4)) for i in range(batch)]
best = 1e9
for _ in range(5):
    start = time.perf_counter()
    for _ in range(rounds):
        pool.alloc(reqs)
        for req in reqs:
            pool.free(req)
    best = min(best, (time.perf_counter() - start) / rounds)
print(f"ROUND {best * 1e6:.1f}")
"""


def rows(mode: str, batch: int, rounds: int) -> float:
    env = {**os.environ, "SGLANG_OOBGUARD_LIVENESS": "1" if mode == "on" else "0"}
    out = subprocess.run([sys.executable, "-c", ROUNDS, mode, str(batch), str(rounds)], env=env, text=True,
                         capture_output=True, check=True).stdout
    return float(next(line for line in out.splitlines() if line.startswith("ROUND ")).split()[1])


def gate(pages: int) -> float:
    import numpy as np
    import torch

    flags = torch.zeros(pages + 1, dtype=torch.int32)
    flags[1:pages // 3] = 1
    best = 1e9
    for _ in range(20):
        start = time.perf_counter()
        np.count_nonzero(flags[:pages].cpu().numpy()[1:])
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--pages", type=int, default=1_000_000)
    args = parser.parse_args()
    off, on = rows("off", args.batch, args.rounds), rows("on", args.batch, args.rounds)
    print(f"alloc of {args.batch} requests + {args.batch} frees: {off:.1f} us unguarded, {on:.1f} us with the row "
          f"check: {(on - off) / (args.batch + 1):.1f} us per row call")
    print(f"idle sweep's count gate: {gate(args.pages):.2f} ms per {args.pages} pages")


if __name__ == "__main__":
    main()
