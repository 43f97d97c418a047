"""`python -m sglang_oobguard demo`: a stale slot id written into a real sglang KV pool
on this machine, first unguarded (the damage), then guarded (the report)."""

from __future__ import annotations

import torch

from . import patch
from .report import KVOutOfBoundsError

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


def _rows_written(pool) -> list[int]:
    return [i for i in range(HIGH) if pool.k_buffer[1][i].abs().sum() > 0]


def run() -> int:
    """Prints the story; returns 0 when every step behaved as described."""
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

    patch.install("raise")
    try:
        print("\n3. Guarded (SGLANG_OOBGUARD_MODE=raise), the same -1 batch:")
        pool = _pool()
        try:
            _write(pool, [5, 6, -1])
            ok = False
        except KVOutOfBoundsError as exc:
            print(f"   KVOutOfBoundsError: {exc}")
        rows = _rows_written(pool)
        print(f"   rows written: {rows or 'none'}  <- rejected before anything was written")
        ok &= rows == []

        patch.uninstall()
        patch.install("warn")
        print("\n4. Guarded (SGLANG_OOBGUARD_MODE=warn), slots [5, 6, -1, 70]: contained, logged, served:")
        pool = _pool()
        _write(pool, [5, 6, -1, HIGH + 5])
        rows = _rows_written(pool)
        print(f"   rows written: {rows}  <- bad ids went to padding slot 0; row {HIGH - 1} intact")
        ok &= rows == [0, 5, 6]
        print(f"   sglang_oobguard.violations(): {[str(v) for v in patch.violations()]}")
    finally:
        patch.uninstall()
    print("\nDemo " + ("finished as described." if ok else "did NOT behave as described."))
    return 0 if ok else 1
