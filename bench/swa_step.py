"""The SWA checks' host cost per decode step at batch 8, on the real SWAKVPool and
SWATokenToKVPoolAllocator (page 1, 4 layers: sliding / full / sliding / full), for
bench/run.py's step table.

One step as sglang runs it: the allocator hands out 8 full slots with their SWA peers,
each layer writes its K/V (the SWA layers at the translated ids), and the 8 SWA slots
that left the window go back (`free_swa`). Guarded is strict with liveness, so every
SWA check runs: the hand-out check of both sub-allocators, the two id spaces' write
checks, the door's SWA-id check and the SWA free check; the SWA checks are also timed alone.
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

BATCH, SIZE, SIZE_SWA, WINDOW = 8, 8192, 4096, 64


def swa_step_row(quick: bool, per_call_us: Callable[..., dict[str, list[float]]],
                 ratio: Callable[..., float]) -> dict:
    import sglang_oobguard
    from helpers import Layer, swa_allocator, swa_pool
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    from sglang_oobguard.checks import liveness, swa
    from sglang_oobguard.model.swatargets import SWA_METHODS
    from sglang_oobguard.probes.pools import STATE_ATTR

    k = torch.randn(BATCH, 2, 4)
    layers = [Layer(i) for i in range(4)]
    made: dict[str, object] = {}

    def build(guarded: bool) -> None:
        sglang_oobguard.uninstall()
        if guarded:
            os.environ["SGLANG_OOBGUARD_LIVENESS"] = "1"
            sglang_oobguard.install("strict")
        pool = swa_pool(1, size=SIZE, size_swa=SIZE_SWA)
        allocator = swa_allocator(pool)
        made.update(pool=pool, allocator=allocator, held=[])

    def step() -> None:
        pool, allocator, held = made["pool"], made["allocator"], made["held"]
        loc = allocator.alloc(BATCH)
        where = KVWriteLoc(loc, swa_loc=allocator.translate_loc_from_full_to_swa(loc))
        for layer in layers:
            pool.set_kv_buffer(layer, where, k, k)
        held.append(loc)
        if len(held) > WINDOW // BATCH:  # the oldest tokens left the window: their SWA slots go back
            allocator.free_swa(held[0])
            allocator.free_full(held.pop(0))

    samples = per_call_us({"unguarded": step, "guarded": step}, 20 if quick else 200, 2 if quick else 15,
                          {"unguarded": lambda: build(False), "guarded": lambda: build(True)})
    build(True)
    for _ in range(WINDOW // BATCH + 1):
        step()
    allocator, guard = made["allocator"], sglang_oobguard.activate.instrument._active.guard
    ids, fresh = made["held"][0], allocator.swa_attn_allocator.free_pages[:BATCH].clone()
    sub_state, sub = made["pool"].swa_kv_pool.__dict__[STATE_ATTR], allocator.swa_attn_allocator
    last = made["held"][-1]
    door_args = (layers[0], KVWriteLoc(last, swa_loc=allocator.translate_loc_from_full_to_swa(last)), k, k)
    adapter = {"free check": lambda: swa.check_free(guard, allocator, "free_swa", SWA_METHODS["free_swa"], ids),
               "hand-out check": lambda: liveness.check_hand_out(guard, sub, sub_state, 0, fresh),
               "door check": lambda: swa.check_door(guard, made["pool"], 0, door_args, {}, 1, "loc_info", 0)}
    alone = per_call_us(adapter, 50 if quick else 2000, 2 if quick else 15, {name: lambda: None for name in adapter})
    sglang_oobguard.uninstall()
    return {"batch": BATCH, **{name: statistics.median(v) for name, v in samples.items()},
            "step_x": ratio(samples, "guarded", "unguarded"),
            **{name: statistics.median(v) for name, v in alone.items()}}
