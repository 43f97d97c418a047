"""Read kernel: the read check of one step in ONE Triton launch (`readmap.check_reads`'s contract).

One program walks the batch's rows and, per row, its positions [0, seq_len) in
BLOCK-wide chunks: each slot read is checked against the liveness shadow (flags,
generation, owner) and the row's `Seen` (the slot and generation first read there,
the positions already read), exactly as the host path decides (READ_FREED >
REPOINTED > READ_REUSED), then `Seen` is updated in place. The first bad read (in
row, then position order) is folded into the pool's record as the step kernel does:
kind, the batch row (`row`), the position (`pos`), the slot (`value`), the generation
first read (`expected`) and the slot's owner row (`owner`).

No host value but shapes and the batch size (a host int sglang already has): seq_lens,
req_pool_indices and every table are read on the device; nothing is allocated per step.
One program keeps the record's one-call-per-step count; sum(seq_lens) slots are read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import device, kernels
from .kernels import (_BAD, _CALLS, _EXPECTED, _HIGH, _KIND, _LAYER, _NO_POS, _NUMEL, _OWNER, _POS, _ROW, _SITE, _STEP,
                      _TOTAL_BAD, _VALUE)
from .readmap import Seen
from .record import Kind
from .shadow import GEN, Live

K_READ_FREED = tl.constexpr(int(Kind.READ_FREED))
K_READ_REUSED = tl.constexpr(int(Kind.READ_REUSED))
K_REPOINTED = tl.constexpr(int(Kind.REPOINTED))
READ_BLOCK = 512
# where a request's own slot handed back to it may be read at a new generation: from the
# first position this step writes (decode: its last; an extend: its prefix length), none, any
WRITTEN_DECODE, WRITTEN_PREFIX, WRITTEN_NONE, WRITTEN_ANY = range(4)


@triton.jit(do_not_specialize=["batch", "ncols", "table_stride", "extend", "live_page", "live_high", "site", "high",
                               "written"],
            do_not_specialize_on_alignment=["table_ptr", "rows_ptr", "seq_ptr", "prefix_ptr", "live_ptr", "owner_ptr",
                                            "gen_ptr",
                                            "seen_slot_ptr", "seen_gen_ptr", "checked_ptr", "record_ptr", "step_ptr"])
def _read_kernel(table_ptr, table_stride, ncols, rows_ptr, seq_ptr, prefix_ptr, written, batch, extend, live_ptr,
                 owner_ptr, gen_ptr, live_page, live_high, seen_slot_ptr, seen_gen_ptr, checked_ptr, record_ptr,
                 step_ptr, site, high, BLOCK: tl.constexpr):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    numel = tl.zeros([BLOCK], dtype=tl.int64)
    first = tl.full([BLOCK], _NO_POS, dtype=tl.int64)  # r * ncols + p of each lane's first bad read
    f_kind = tl.zeros([BLOCK], dtype=tl.int64)
    f_slot = tl.zeros([BLOCK], dtype=tl.int64)
    f_gen = tl.zeros([BLOCK], dtype=tl.int64)
    f_owner = tl.zeros([BLOCK], dtype=tl.int64)
    for r in range(0, batch):
        row = tl.load(rows_ptr + r).to(tl.int64)
        n = tl.minimum(tl.load(seq_ptr + r).to(tl.int64), ncols)
        prior = tl.load(checked_ptr + row)
        seq = tl.load(seq_ptr + r).to(tl.int64)
        first_written = tl.where(written == 0, seq - 1, tl.where(written == 2, seq, 0))
        if written == 1:
            first_written = tl.load(prefix_ptr + r).to(tl.int64)
        for start in range(0, n, BLOCK):
            p = start + lanes
            m = p < n
            slot = tl.load(table_ptr + row * table_stride + p, mask=m, other=0).to(tl.int64)
            inside = m & (slot >= live_page) & (slot < live_high)
            page = tl.where(inside, slot // live_page, 0)
            flag = tl.load(live_ptr + page, mask=inside, other=1)
            gen = tl.load(gen_ptr + page, mask=inside, other=0).to(tl.int32)  # modulo 2^32, as Seen keeps it
            at = row * ncols + p
            before = tl.load(seen_slot_ptr + at, mask=m, other=-1).to(tl.int64)
            first_gen = tl.load(seen_gen_ptr + at, mask=m, other=0)
            old = inside & (p < prior)
            changed = before != slot
            freed = inside & (flag == 0)
            was = old & changed & (before >= live_page) & (before < live_high)
            was_page = tl.where(was, before // live_page, 0)
            was_flag = tl.load(live_ptr + was_page, mask=was, other=0)
            was_gen = tl.load(gen_ptr + was_page, mask=was, other=-1).to(tl.int32)
            repointed = was & (extend == 0) & (was_flag != 0) & (was_gen == first_gen)
            own = tl.load(owner_ptr + page, mask=inside, other=0).to(tl.int64)
            mine = (own == row + 1) & (p >= first_written)  # its own slot again, where it writes now
            reused = old & (flag != 0) & ~changed & (gen != first_gen) & ~mine
            bad = freed | repointed | reused
            kind = tl.where(freed, K_READ_FREED, tl.where(repointed, K_REPOINTED, K_READ_REUSED))
            fresh = bad & (first == _NO_POS)
            first = tl.where(fresh, r * ncols + p, first)
            f_kind = tl.where(fresh, kind, f_kind)
            f_slot = tl.where(fresh, slot, f_slot)
            f_gen = tl.where(fresh, first_gen.to(tl.int64), f_gen)
            f_owner = tl.where(fresh, own - 1, f_owner)
            bad_count += bad.to(tl.int64)
            numel += m.to(tl.int64)
            tl.store(seen_slot_ptr + at, slot.to(tl.int32), mask=m)
            tl.store(seen_gen_ptr + at, gen, mask=m)
        tl.store(checked_ptr + row, n)
    total = tl.sum(bad_count, axis=0)
    least = tl.min(first, axis=0)
    hit = total > 0
    mine = hit & (first == least)  # the lane holding the first bad read (one: positions differ per lane)
    calls = tl.atomic_add(record_ptr + _CALLS, tl.full([], 1, tl.int64), mask=hit)
    tl.atomic_add(record_ptr + _TOTAL_BAD, total, mask=hit)
    lane = mine & (calls == 0)
    zero = lanes * 0
    tl.store(record_ptr + _SITE + zero, site.to(tl.int64) + zero, mask=lane)
    tl.store(record_ptr + _LAYER + zero, zero - 1, mask=lane)
    tl.store(record_ptr + _HIGH + zero, high.to(tl.int64) + zero, mask=lane)
    tl.store(record_ptr + _BAD + zero, total + zero, mask=lane)
    tl.store(record_ptr + _NUMEL + zero, tl.sum(numel, axis=0) + zero, mask=lane)
    tl.store(record_ptr + _POS + zero, least % ncols, mask=lane)
    tl.store(record_ptr + _VALUE + zero, f_slot, mask=lane)
    tl.store(record_ptr + _STEP + zero, tl.load(step_ptr + zero, mask=lane, other=-1), mask=lane)
    tl.store(record_ptr + _KIND + zero, f_kind, mask=lane)
    tl.store(record_ptr + _ROW + zero, least // ncols, mask=lane)
    tl.store(record_ptr + _EXPECTED + zero, tl.where(f_kind == K_READ_REUSED, f_gen, -1), mask=lane)
    tl.store(record_ptr + _OWNER + zero, f_owner, mask=lane)


def launch(seen: Seen, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, batch: int, extend: bool,
           live: Live, record: torch.Tensor, step: torch.Tensor, site: int, high: int, written: int = WRITTEN_ANY,
           prefix: Optional[torch.Tensor] = None) -> None:
    """Enqueue the read check of one step (no host sync, no allocation). `written`:
    WRITTEN_*; `prefix`: extend_prefix_lens with WRITTEN_PREFIX."""
    assert table.stride(1) == 1 and live.history is not None and live.owner is not None
    args = (table, table.stride(0), table.shape[1], rows, seq_lens, seq_lens if prefix is None else prefix, written,
            batch, int(extend), live.flags, live.owner,
            live.history[GEN], live.page, live.high, seen.slot, seen.gen, seen.checked, record, step, site, high)
    device.enqueue(kernels._launch, _read_kernel, 1, args, dict(BLOCK=READ_BLOCK), False)


def warm_up(seen: Seen, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, live: Live,
            record: torch.Tensor, step: torch.Tensor, site: int, high: int) -> None:
    """Compile the kernel for this server's dtypes (an empty batch) before serving."""
    launch(seen, table, rows, seq_lens, 0, False, live, record, step, site, high)
