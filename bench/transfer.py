"""CPU benchmark of the KV transfer check (checks/transfer.py) and the HiCache check (checks/hicache.py) on sglang's real decode-side send
(`DecodePreallocQueue._send_kv_metadata`, the fake backend's receiver), a real MHA pool and sglang's
token allocator: the cost per transfer (the send check of one request's destination pages) and per
free (a request's alloc and free, the free checked against the transfers in flight), guarded (strict, liveness) against
unguarded and against the guard with no transfer in flight (what liveness alone costs), side by
side in one run; and the cost per HiCache load (one layer of the real MHA host pool, through the
test-only CPU shim tests/hicache_shim.py), guarded against unguarded, outside a load-back (the bound
and liveness probe) and inside one (plus the holder check, checks/hiloads.py: the load's slots
against the owner table; its first layer's call, later layers reuse it).

    .venv/bin/python bench/transfer.py            # ~20 s on 2 cores
    .venv/bin/python bench/transfer.py --quick    # a smoke run (numbers not meaningful)

A benchmark, not a test: it prints per-call times and their ratio (median of per-round ratios).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "bench")]

from run import per_call_us, ratio  # noqa: E402  (bench/run.py's interleaved timing)

IN_FLIGHT = 32  # other requests' transfers in flight while one is sent or freed


def rows(quick: bool) -> list[dict]:
    import sglang_oobguard
    from helpers import DecodeSide
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    out = []
    for tokens in (128, 2048):
        size = tokens * (IN_FLIGHT + 2)
        sides: dict[str, DecodeSide] = {}

        def setup(name: str) -> None:
            sglang_oobguard.uninstall()
            if name != "unguarded":
                os.environ["SGLANG_OOBGUARD_LIVENESS"] = "1"
                sglang_oobguard.install("strict")
            pool = MHATokenToKVPool(size, 1, torch.bfloat16, 8, 128, 1, "cpu", False)
            side = sides[name] = DecodeSide(TokenToKVPoolAllocator(size, torch.bfloat16, "cpu", pool, False),
                                            rows=IN_FLIGHT + 2, context=tokens)
            for row in range(IN_FLIGHT if name == "guarded" else 0):  # transfers in flight beside the measured one
                side.send(*side.request(f"r{row}", row, row, tokens))
            side.mine = side.request("mine", IN_FLIGHT, 1000, tokens)

        def send(name: str) -> None:
            sides[name].send(*sides[name].mine)

        def free(name: str) -> None:  # a request's slots handed out and given back
            side = sides[name]
            side.alloc.free(side.alloc.alloc(tokens))

        calls, rounds = (3, 2) if quick else (50, 15)
        for what, fn in (("send", send), ("free", free)):
            names = ("unguarded", "alone", "guarded")
            samples = per_call_us({name: (lambda n=name: fn(n)) for name in names}, calls, rounds,
                                  {name: (lambda n=name: setup(n)) for name in names})
            out.append({"what": what, "tokens": tokens, **{k: statistics.median(v) for k, v in samples.items()},
                        "x": ratio(samples, "guarded", "unguarded"), "x_alone": ratio(samples, "guarded", "alone")})
        sglang_oobguard.uninstall()
    return out


def load_rows(quick: bool) -> list[dict]:
    """HiCache: one host -> device load of one layer (the real MHA host pool, layer_first, direct; on
    the CPU through tests/hicache_shim.py), unguarded vs guarded (strict, liveness), and guarded inside
    a load-back (what `HiCacheController.start_loading`'s hook sets: the holder check runs)."""
    import hicache_shim
    import sglang_oobguard
    from sglang_oobguard.activate import instrument
    from sglang_oobguard.checks.hiloads import Loading
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    hicache_shim.install()
    out = []
    for tokens in (128, 2048):
        loads: dict[str, tuple] = {}

        def setup(name: str) -> None:
            sglang_oobguard.uninstall()
            if name != "unguarded":
                os.environ["SGLANG_OOBGUARD_LIVENESS"] = "1"
                sglang_oobguard.install("strict")
            if name == "holder":
                assert instrument._active is not None
                instrument._active.guard.held["hicache"].now = Loading()  # a load-back's, as start_loading's hook sets it
            pool = MHATokenToKVPool(2 * tokens, 1, torch.bfloat16, 8, 128, 1, "cpu", False)
            slots = TokenToKVPoolAllocator(2 * tokens, torch.bfloat16, "cpu", pool, False).alloc(tokens)
            host = MHATokenToKVPoolHost(pool._mha_buffer_info(), 2.0, 0, 1, "layer_first", pin_memory=False,
                                        device="cpu", device_capacity_tokens=pool.size, start_layer=0, end_layer=1)
            loads[name] = (host, pool, torch.arange(tokens), slots)

        def load(name: str) -> None:
            host, pool, host_ids, slots = loads[name]
            if name == "holder":  # each call a new load-back's first layer: checked, not served by the memo
                instrument._active.guard.held["hicache"].now.done.clear()
            host.load_to_device_per_layer(pool, host_ids, slots, 0, "direct")

        calls, rounds = (3, 2) if quick else (50, 15)
        names = ("unguarded", "guarded", "holder")
        samples = per_call_us({name: (lambda n=name: load(n)) for name in names}, calls, rounds,
                              {name: (lambda n=name: setup(n)) for name in names})
        out.append({"tokens": tokens, **{k: statistics.median(v) for k, v in samples.items()},
                    "x": ratio(samples, "guarded", "unguarded"), "x_holder": ratio(samples, "holder", "unguarded"),
                    "x_added": ratio(samples, "holder", "guarded"),  # the holder check, per round, back to back:
                    "added_us": statistics.median(h - g for h, g in zip(samples["holder"], samples["guarded"]))})
    sglang_oobguard.uninstall()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    quick = parser.parse_args().quick
    torch.set_num_threads(1)
    print("KV transfer check (PD decode), per call, strict:")
    print("| call | pages | unguarded | guarded, no other in flight | guarded, 32 in flight | ratio to unguarded "
          "| ratio to no other in flight |")
    print("|---|---|---|---|---|---|---|")
    for row in rows(quick):
        label = "send (one transfer)" if row["what"] == "send" else "alloc + free (a request's pages)"
        print(f"| {label} | {row['tokens']} | {row['unguarded']:.1f} us | {row['alone']:.1f} us | "
              f"{row['guarded']:.1f} us | {row['x']:.2f}x | {row['x_alone']:.2f}x |")
    print("\nHiCache host -> device load of one layer (bf16, 8 x 128), per call, strict + liveness:")
    print("| tokens | unguarded | guarded | ratio | guarded in a load-back (+ holder check) | ratio "
          "| holder check per load |")
    print("|---|---|---|---|---|---|---|")
    for row in load_rows(quick):
        print(f"| {row['tokens']} | {row['unguarded']:.1f} us | {row['guarded']:.1f} us | {row['x']:.2f}x | "
              f"{row['holder']:.1f} us | {row['x_holder']:.2f}x | {row['added_us']:+.1f} us "
              f"({row['x_added']:.2f}x of guarded) |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
