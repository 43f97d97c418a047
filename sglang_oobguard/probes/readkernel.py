"""Read kernel: the read check of one step in ONE Triton launch (`readmap.check_reads`'s contract).

One program per batch row walks that row's positions [0, seq_len) in BLOCK-wide
chunks: each slot read is checked against the liveness shadow (flags, generation,
owner) and the row's `Seen` (the slot and generation first read there, the positions
already read), exactly as the host path decides (READ_FREED > REPOINTED > READ_REUSED),
then `Seen` is updated in place. Each program with a bad read puts its first into
`Seen.found` (its batch row), adds its counts and its key (row * ncols + position)
into `Seen.scratch` with atomics (`kernels._last_of_programs`), and the last program
to arrive folds the least key's read into the pool's record (`kernels._conclude`):
the first bad read by batch row, then position, whichever program ran first. Record:
kind, the batch row (`row`), the position (`pos`), the slot (`value`), the generation
first read (`expected`) and the slot's owner row (`owner`).

No host value but shapes and the batch size (a host int sglang already has): seq_lens,
req_pool_indices and every table are read on the device; nothing is allocated per step.
One fold per step keeps the record's one-call-per-step count; sum(seq_lens) slots are read.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import device, kernels
from .kernels import _EXPECTED, _KIND, _NO_POS, _OWNER, _ROW
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
                                            "gen_ptr", "seen_slot_ptr", "seen_gen_ptr", "checked_ptr", "found_ptr",
                                            "scratch_ptr", "record_ptr", "step_ptr"])
def _read_kernel(table_ptr, table_stride, ncols, rows_ptr, seq_ptr, prefix_ptr, written, batch, extend, live_ptr,
                 owner_ptr, gen_ptr, live_page, live_high, seen_slot_ptr, seen_gen_ptr, checked_ptr, found_ptr,
                 scratch_ptr, record_ptr, step_ptr, site, high, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)  # this program's batch row (program 0 of an empty batch reads nothing)
    valid = r < batch
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    numel = tl.zeros([BLOCK], dtype=tl.int64)
    first = tl.full([BLOCK], _NO_POS, dtype=tl.int64)  # r * ncols + p of each lane's first bad read
    f_kind = tl.zeros([BLOCK], dtype=tl.int64)
    f_slot = tl.zeros([BLOCK], dtype=tl.int64)
    f_gen = tl.zeros([BLOCK], dtype=tl.int64)
    f_owner = tl.zeros([BLOCK], dtype=tl.int64)
    row = tl.load(rows_ptr + r, mask=valid, other=0).to(tl.int64)
    seq = tl.load(seq_ptr + r, mask=valid, other=0).to(tl.int64)
    n = tl.minimum(seq, ncols)
    prior = tl.load(checked_ptr + row, mask=valid, other=0)
    first_written = tl.where(written == 0, seq - 1, tl.where(written == 2, seq, 0))
    if written == 1:
        first_written = tl.load(prefix_ptr + r, mask=valid, other=0).to(tl.int64)
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
    tl.store(checked_ptr + row, n, mask=valid)
    total = tl.sum(bad_count, axis=0)
    least = tl.min(first, axis=0)
    lane = first == least  # the lane holding this row's first bad read (one: positions differ per lane)
    here = found_ptr + r * 4
    hit = total > 0
    tl.store(here + 0, tl.sum(tl.where(lane, f_kind, 0), axis=0), mask=hit)  # before the arrival (its release)
    tl.store(here + 1, tl.sum(tl.where(lane, f_slot, 0), axis=0), mask=hit)
    tl.store(here + 2, tl.sum(tl.where(lane, f_gen, 0), axis=0), mask=hit)
    tl.store(here + 3, tl.sum(tl.where(lane, f_owner, 0), axis=0), mask=hit)
    tl.atomic_add(scratch_ptr + 3, tl.sum(numel, axis=0))
    last, total, least = kernels._last_of_programs(scratch_ptr, total, least)
    if last:
        reads = tl.atomic_xchg(scratch_ptr + 3, 0)
        any_bad = total > 0
        winner = found_ptr + tl.where(any_bad, least // ncols, 0) * 4  # read by atomics: other programs wrote it
        nothing = tl.zeros([], tl.int64)
        w_kind = tl.atomic_add(winner + 0, nothing, mask=any_bad)
        w_slot = tl.atomic_add(winner + 1, nothing, mask=any_bad)
        w_gen = tl.atomic_add(winner + 2, nothing, mask=any_bad)
        w_owner = tl.atomic_add(winner + 3, nothing, mask=any_bad)
        wrote = kernels._conclude(record_ptr, total, least % ncols, w_slot, reads, high, site, nothing - 1, step_ptr,
                                  False, "", K_READ_FREED)  # the kind, row, generation and owner: below
        tl.store(record_ptr + _KIND, w_kind, mask=wrote)
        tl.store(record_ptr + _ROW, least // ncols, mask=wrote)
        tl.store(record_ptr + _EXPECTED, tl.where(w_kind == K_READ_REUSED, w_gen, -1), mask=wrote)
        tl.store(record_ptr + _OWNER, w_owner, mask=wrote)

def launch(seen: Seen, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, batch: int, extend: bool,
           live: Live, record: torch.Tensor, step: torch.Tensor, site: int, high: int, written: int = WRITTEN_ANY,
           prefix: Optional[torch.Tensor] = None) -> None:
    """Enqueue the read check of one step (no host sync, no allocation). `written`:
    WRITTEN_*; `prefix`: extend_prefix_lens with WRITTEN_PREFIX."""
    assert table.stride(1) == 1 and live.history is not None and live.owner is not None
    args = (table, table.stride(0), table.shape[1], rows, seq_lens, seq_lens if prefix is None else prefix, written,
            batch, int(extend), live.flags, live.owner,
            live.history[GEN], live.page, live.high, seen.slot, seen.gen, seen.checked, seen.found, seen.scratch,
            record, step, site, high)
    device.enqueue(kernels._launch, _read_kernel, max(batch, 1), args, dict(BLOCK=READ_BLOCK), False)


def warm_up(seen: Seen, table: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, live: Live,
            record: torch.Tensor, step: torch.Tensor, site: int, high: int) -> None:
    """Compile the kernel for this server's dtypes (an empty batch) before serving."""
    launch(seen, table, rows, seq_lens, 0, False, live, record, step, site, high)
