"""`python -m sglang_oobguard demo`: a stale slot id written into a real sglang KV pool
on this machine, first unguarded (the damage), then guarded (the report), then a slot
written after sglang's own allocator took it back (the liveness guard).
`demo --engine` tells the same story in the real sglang Engine on the CPU."""

from __future__ import annotations

import inspect
import logging
import os
import sys
from pathlib import Path

import torch

from .activate import instrument
from .model.config import LIVENESS_VAR
from .model.discover import Found
from .model.log import logger
from .model.quiet import Captured, quiet
from .report.reporter import KVOutOfBoundsError

SIZE, PAGE = 64, 1
HIGH = SIZE + PAGE


class _Layer:
    """What the pool reads of sglang's RadixAttention: its layer id."""

    layer_id = 1


def _pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(SIZE, PAGE, torch.float32, 2, 4, 2, "cpu", False)


def _write(pool, ids: list[int]) -> torch.Tensor:
    k = torch.full((len(ids), 2, 4), 7.0)
    pool.set_kv_buffer(_Layer, torch.tensor(ids), k, k)
    return k


def _allocator(pool):
    """sglang's own token allocator over `pool` (0.4.x takes no need_sort)."""
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator

    extra = (False,) if "need_sort" in inspect.signature(TokenToKVPoolAllocator).parameters else ()
    return TokenToKVPoolAllocator(SIZE, torch.float32, "cpu", pool, *extra)


def _rows_written(pool) -> list[int]:
    return [i for i in range(HIGH) if pool.k_buffer[1][i].abs().sum() > 0]


def run() -> int:
    """Prints the story, and nothing else: sglang's import-time warnings and the
    guard's own log lines are captured (the warn-mode line is shown in its step).
    Returns 0 when every step behaved as described."""
    with quiet() as said:
        return _story(said)


def _story(said: Captured) -> int:
    ok = True
    print(f"Real sglang MHATokenToKVPool on {torch.device('cpu')}: size={SIZE}, page_size={PAGE}, "
          f"rows 0..{HIGH - 1} (row 0 is the padding slot).\n")

    print("1. Unguarded, a batch for slots [5, 6, -1] (a stale -1 from a padded batch):")
    pool = _pool()
    _write(pool, [5, 6, -1])
    rows = _rows_written(pool)
    print(f"   no error; rows written: {rows}  <- row {HIGH - 1} belongs to another request: silently overwritten")
    ok &= rows == [5, 6, HIGH - 1]

    print(f"\n2. Unguarded, slots [5, {HIGH + 5}] (a slot id past the pool):")
    try:
        _write(_pool(), [5, HIGH + 5])
        print("   no error")
        ok = False
    except IndexError as exc:
        print(f"   torch: {type(exc).__name__}: {str(exc).splitlines()[0]}")
        print("   (on a GPU: an illegal memory access, reported far from its cause, or silence)")

    guarded = sum(isinstance(entry, Found) for entry in instrument.install("raise"))
    try:
        print(f"\n3. Guarded (SGLANG_OOBGUARD_MODE=raise: {guarded} guarded methods, those of the pool classes "
              "sglang has defined so far), the same -1 batch:")
        pool = _pool()
        try:
            _write(pool, [5, 6, -1])
            ok = False
        except KVOutOfBoundsError as exc:
            print(f"   KVOutOfBoundsError: {exc}")
        rows = _rows_written(pool)
        print(f"   rows written: {rows or 'none'}  <- rejected before anything was written")
        ok &= rows == []

        instrument.uninstall()
        instrument.install("warn")
        print("\n4. Guarded (SGLANG_OOBGUARD_MODE=warn), slots [5, 6, -1, 70]: contained, logged, served:")
        pool = _pool()
        _write(pool, [5, 6, -1, HIGH + 5])
        rows = _rows_written(pool)
        print(f"   rows written: {rows}  <- bad ids went to padding slot 0; row {HIGH - 1} intact")
        ok &= rows == [0, 5, 6]
        logged = said.messages(logger.name, logging.WARNING)
        print(f"   logged: {logged[-1] if logged else 'nothing'}")
        ok &= bool(logged)
        print(f"   sglang_oobguard.violations(): {[str(v) for v in instrument.violations()]}")
        ok &= _liveness_story()
    finally:
        instrument.uninstall()
        os.environ.pop(LIVENESS_VAR, None)
    print("\nDemo " + ("finished as described." if ok else "did NOT behave as described."))
    return 0 if ok else 1


def _liveness_story() -> bool:
    instrument.uninstall()
    os.environ[LIVENESS_VAR] = "1"
    instrument.install("raise")
    print(f"\n5. {LIVENESS_VAR}=1 (raise): sglang's allocator hands out 3 slots and takes the last one back;\n"
          "   a stale write to it is in range, so no bound check can see it:")
    pool = _pool()
    allocator = _allocator(pool)
    loc = allocator.alloc(3)
    allocator.free(loc[2:])
    caught = 0
    try:
        _write(pool, loc.tolist())
    except KVOutOfBoundsError as exc:
        print(f"   KVOutOfBoundsError: {exc}")
        caught += 1
    try:
        allocator.free(loc[2:])
    except KVOutOfBoundsError as exc:
        print(f"   and freeing it again: KVOutOfBoundsError: {exc}")
        caught += 1
    rows = _rows_written(pool)
    print(f"   rows written: {rows or 'none'}  <- rejected before anything was written")
    return caught == 2 and rows == []


_STEPS = "step=3,token=1"


def _first(log: str, needle: str) -> str:
    return next((line.strip() for line in log.splitlines() if needle in line), f"(no line with {needle!r})")


def run_engine_story() -> int:
    """Four runs of the real Engine (tiny local Llama, CPU), one stale slot id injected in
    decode step 3 by the test fault-injector plugin. Needs a source checkout (tests/e2e)."""
    tests = Path(__file__).resolve().parents[1] / "tests"
    if not (tests / "e2e" / "harness.py").exists():
        print("demo --engine runs from a source checkout: it needs tests/e2e (tiny model, fault injector)")
        return 2
    sys.path.insert(0, str(tests))
    from e2e.harness import run_engine
    from e2e.tiny_model import build_tiny_llama

    model = build_tiny_llama(tests.parent / ".cache" / "tiny-llama")
    ok = True
    print("The real sglang Engine on this CPU: 4 concurrent prompts, greedy; a stale slot id is injected for "
          "request 2 of 4 in decode step 3 (each run ~30 s).\n")

    run = run_engine(model, {"OOBGUARD_FAULT": f"{_STEPS},value=high+3"})
    print(f"1. Unguarded, slot id past the pool: the engine dies (exit {run.returncode}), the scheduler says only\n"
          f"   {_first(run.log, 'IndexError')}")
    ok &= run.result is None and not run.leftovers

    run = run_engine(model, {"OOBGUARD_FAULT": f"{_STEPS},value=-1"})
    print(f"2. Unguarded, slot id -1: no error at all (exit {run.returncode}); the pool's last row was overwritten")
    ok &= bool(run.result) and "outputs" in run.result

    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "raise", "OOBGUARD_FAULT": f"{_STEPS},value=high+3"})
    print(f"3. SGLANG_OOBGUARD_MODE=raise: stopped before any layer ran, the scheduler log names it all, down to "
          f"the request (exit {run.returncode}):\n   {_first(run.log, 'KVOutOfBoundsError:')}")
    ok &= "KVOutOfBoundsError: out_cache_loc (forward step)" in run.log and "request " in run.log and not run.leftovers

    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "warn", "OOBGUARD_FAULT": f"{_STEPS},value=-1"})
    served = bool(run.result) and all(len(t) == 16 for t in run.result.get("outputs", []))
    print(f"4. SGLANG_OOBGUARD_MODE=warn: contained and served ({'all 4 requests completed' if served else 'FAILED'}):"
          f"\n   {_first(run.log, 'sglang_oobguard: bad KV slot ids')}")
    ok &= served
    print("\nEngine demo " + ("finished as described." if ok else "did NOT behave as described."))
    return 0 if ok else 1
