"""Slot history and the read check on the host (CPU), measured over sglang's real classes.

1. The history's cost per allocator call, every figure beside its floor in the same
   rounds: sglang's TokenToKVPoolAllocator alloc(1) + free under a wrapt hook that
   captures the call site as the guard's liveness hook does (`callsite.here`, packed),
   beside the same calls under an empty hook; the per-slot writes (generation, last
   allocation / free) beside the liveness shadow's own update; and the whole call
   guarded with liveness on, with the history and without it.
2. The read check's cost per step at batch 1, 8, 64, 256 and contexts 512 to 8k, a
   steady decode step (each request reads one position more than at its last step):
   the full check (`readmap.check_reads`: every slot of req_to_token[row, 0:seq_len] of
   every request looked up) beside the counted path the host runs (`readcount.check`).

    .venv/bin/python bench/history_reads.py [--quick]
    python bench/history_reads.py --gpu   # the read kernel on CUDA (for ci/gpu-check.sh)
"""
import os
import statistics
import sys
import time

os.environ.setdefault("SGLANG_OOBGUARD_MODE", "off")
import numpy as np
import torch

QUICK = "--quick" in sys.argv
torch.set_num_threads(1)
SITE_TARGET_US = 2.0  # issue 46: a call site captured in under 2 us per allocator call


def per_call(fn, reps):
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps * 1e6


def rounds(variants: dict, reps: int, count: int) -> dict[str, list[float]]:
    """us per call of each variant (a function that starts it and returns the call), one
    sample per round, over `count` rounds in alternating order, so drift and noise hit
    them alike."""
    samples: dict[str, list[float]] = {name: [] for name in variants}
    order = list(variants)
    for round_ in range(count):
        for name in order if round_ % 2 == 0 else order[::-1]:
            samples[name].append(per_call(variants[name](), reps))
    return samples


def median(samples: dict[str, list[float]], name: str, less: str = "") -> float:
    """The median of a variant's rounds, or of its differences from `less` round by round."""
    return statistics.median(a - b for a, b in zip(samples[name], samples[less] if less else [0.0] * len(samples[name])))


def history_cost():
    from sglang_oobguard.probes import shadow

    reps, count = (500, 3) if QUICK else (5000, 15)
    ids = torch.tensor([1234])
    full = shadow.new_live(1 << 16, 1, torch.device("cpu"))
    bare = full._replace(history=None, memory=full.memory[:2])  # the flags and owners alone
    writes = rounds({"with": lambda: lambda: (shadow.mark(full, ids, 5, True), shadow.release(full, ids, 5, True)),
                     "without": lambda: lambda: (shadow.mark(bare, ids, host=True), shadow.release(bare, ids, host=True))},
                    reps, count)
    calls = allocator_calls(reps // 2, count)
    empty, hooked = median(calls, "empty") / 2, median(calls, "site") / 2  # per allocator call: alloc, then free
    site, written = median(calls, "site", "empty") / 2, median(writes, "with", "without") / 2
    off = median(calls, "off")
    print("| per allocator call (1 id), medians of interleaved rounds | us |")
    print("|---|---|")
    print(f"| sglang alloc(1) + free under an empty wrapt hook, per call | {empty:.2f} |")
    print(f"| ... under a hook that captures the call site (callsite.here, packed) | {hooked:.2f} "
          f"({hooked / empty:.2f}x of the empty hook) |")
    print(f"| call site: its own cost (the difference, round by round) | {site:.2f} (target < {SITE_TARGET_US:.0f} us: "
          f"{'PASS' if site < SITE_TARGET_US else 'MISS'}) |")
    print(f"| shadow update without history (mark / release, host ids) | {median(writes, 'without') / 2:.2f} |")
    print(f"| shadow update with history | {median(writes, 'with') / 2:.2f} |")
    print(f"| history's cost (call site + its writes) | {site + written:.2f} |")
    print(f"| sglang TokenToKVPoolAllocator alloc(1) + free: unguarded | {off:.2f} |")
    for name, what in (("nohistory", "liveness on, history off (shadow, free check)"),
                       ("liveness", "liveness on (shadow, free check, history)")):  # the read check off in both
        print(f"| ... guarded, {what} | {median(calls, name):.2f} ({median(calls, name) / off:.1f}x) |")
    print(f"history's share of the guarded call: {median(calls, 'liveness', 'nohistory'):.2f} us per alloc(1) + free, "
          f"round by round")


def allocator_calls(reps: int, count: int) -> dict[str, list[float]]:
    """us per alloc(1) + free of sglang's allocator: unguarded; under an empty wrapt hook
    and under one that captures the call site (on alloc and free); guarded with liveness,
    without the history and with it (the read check off in both: it works at the steps)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
    import sglang_oobguard
    import wrapt
    from helpers import mha, token_allocator
    from sglang.srt.mem_cache import allocator, memory_pool
    from sglang_oobguard.model import callsite

    cls = allocator.TokenToKVPoolAllocator
    methods = {name: cls.__dict__[name] for name in ("alloc", "free")}

    def empty(method):
        return lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)

    def site(method):
        def hook(wrapped, instance, args, kwargs):  # the liveness hook's capture, nothing else
            callsite.pack(0, callsite.here(type(instance), method))
            return wrapped(*args, **kwargs)
        return hook

    def start(hook=None, checks=None):
        def go():  # from an uninstalled guard each round, with an allocator (and shadow) of its own
            sglang_oobguard.uninstall()
            for name, method in methods.items():
                setattr(cls, name, method if hook is None else wrapt.FunctionWrapper(method, hook(name)))
            if checks is not None:
                os.environ.update(SGLANG_OOBGUARD_MODE="raise", SGLANG_OOBGUARD_LIVENESS="1",
                                  SGLANG_OOBGUARD_CHECKS=checks)
                sglang_oobguard.install()
            alloc = token_allocator(allocator, mha(memory_pool, 4096))
            return lambda: alloc.free(alloc.alloc(1))
        return go

    try:
        return rounds({"off": start(), "empty": start(empty), "site": start(site),
                       "nohistory": start(checks="+liveness,-reads,-history"), "liveness": start(checks="+liveness,-reads")},
                      reps, count)
    finally:
        sglang_oobguard.uninstall()
        for name, method in methods.items():
            setattr(cls, name, method)


def read_cost():
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang_oobguard.probes import readcount, readmap, shadow

    print()
    print("| batch | context | reads per step | full check us/step | ns per read | counted us/step | full / counted |")
    print("|---|---|---|---|---|---|---|")
    for batch in (1, 8, 64, 256):
        for context in (512, 2048, 8192):
            if QUICK and batch * context > 64 * 2048:
                continue
            pool = ReqToTokenPool(size=batch, max_context_len=context, device="cpu", enable_memory_saver=False)
            table = pool.req_to_token
            slots = batch * context
            table[:batch].copy_(torch.randperm(slots).view(batch, context).to(torch.int32) + 1)
            live = shadow.new_live(slots + 1, 1, torch.device("cpu"))
            shadow.mark(live, torch.arange(1, slots + 1))
            rows, tab = np.arange(batch, dtype=np.int64), table.numpy()
            reps = max(3, min(200, int(2e6 // slots)))
            holders = [f"r{row}" for row in rows]
            paths = {
                "full": lambda seen, lens: readmap.check_reads(seen, tab, rows, lens, False, live, slots + 1),
                "counted": lambda seen, lens: readcount.check(seen, live, tab, rows.tolist(), lens.tolist(), holders,
                                                              False, slots + 1)[0]}
            us = {}
            for name, check in paths.items():  # a steady decode: each step reads one position more per request
                seen = readmap.Seen(*table.shape)
                readmap.forget_changed_holders(seen, rows.tolist(), holders)
                lens = np.full(batch, context - reps - 2, dtype=np.int64)
                assert check(seen, lens) is None  # the first step: every position new

                def step():
                    lens[:] += 1
                    assert check(seen, lens) is None

                us[name] = per_call(step, reps)
            print(f"| {batch} | {context} | {slots} | {us['full']:.0f} | {us['full'] * 1e3 / slots:.1f} | "
                  f"{us['counted']:.0f} | {us['full'] / us['counted']:.1f}x |")
    print("the counted path (probes/readcount, what the host path runs): new positions looked up, old ones compared "
          "with what was read; the full check runs where pages changed hands under a reader")
    print("target (the issue's, a GPU one): under 1% of a decode step at batch 64, 4k context: the read kernel's "
          "time is printed by --gpu on a GPU host; the host path's numbers above are what this run measured")


def read_kernel_cost():
    """--gpu: the read kernel's time per step on CUDA (CUDA events, after a warm-up launch),
    at the same grid; for ci/gpu-check.sh. The decode step it is compared with is
    bench/engine.py --device cuda's."""
    from sglang_oobguard.probes import readkernel, readmap, shadow

    if not torch.cuda.is_available():
        print("read kernel: no CUDA device here (run with --gpu on a GPU host)")
        return
    cuda = torch.device("cuda")
    record, step = torch.zeros(14, dtype=torch.int64, device=cuda), torch.zeros(1, dtype=torch.int64, device=cuda)
    print("| batch | context | reads per step | read kernel us/step (CUDA events) |")
    print("|---|---|---|---|")
    for batch in (1, 8, 64, 256):
        for context in (512, 2048, 4096, 8192):
            slots = batch * context
            table = (torch.randperm(slots, device=cuda).view(batch, context) + 1).to(torch.int32)
            live = shadow.new_live(slots + 1, 1, cuda)
            shadow.mark(live, torch.arange(1, slots + 1, device=cuda))
            seen = readmap.Seen(batch, context, cuda)
            rows = torch.arange(batch, device=cuda)
            lens = torch.full((batch,), context, dtype=torch.int64, device=cuda)
            go = lambda: readkernel.launch(seen, table, rows, lens, batch, False, live, record, step, 0,  # noqa: E731
                                           slots + 1)
            go()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            reps = 20
            start.record()
            for _ in range(reps):
                go()
            end.record()
            end.synchronize()
            print(f"| {batch} | {context} | {slots} | {start.elapsed_time(end) * 1e3 / reps:.1f} |")
    assert int(record[1]) == 0, "a clean table was reported"
    print("target: under 1% of a decode step at batch 64, 4k context (the step: bench/engine.py --device cuda)")


if __name__ == "__main__":
    if "--gpu" in sys.argv:
        read_kernel_cost()
    else:
        history_cost()
        read_cost()
