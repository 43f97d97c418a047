"""Step kernel: the write map, duplicates, shared rows, bounds, liveness and ownership of
one forward, in ONE Triton launch (the GPU path of `hostmap.check_host`'s contract).

One program walks the step's ids in BLOCK-wide chunks, twice:
- pass 1 stamps, for each real token, its slot in a per-pool int64 table (`slot_stamps`,
  one entry per slot of [0, high)) and its request's req_to_token row in another
  (`row_stamps`, one per row), with atomic_max of (tag << 32 | (2^31 - 1 - index)):
  after the pass the entry holds the smallest index that stamped it this step. The tag
  is the device step counter + 1 (no host value: graph-safe), so the tables are never
  cleared and nothing is allocated per step;
- pass 2 (after a barrier) re-reads each token's row and slot, reads both stamps
  (atomically: the stamps live in L2), and decides per token, the first matching kind:
  BOUNDS > FREED > OTHER_REQUEST > SHARED_ROW > DUPLICATE > OWNED, where the owner
  check claims an unowned page with atomic_cas(owner, 0, row + 1). It writes the cleaned
  copy (bad ids -> 0) into the caller's buffer and folds the first bad token into the
  record as `kernels._conclude` does (same layout), with kind, row, expected and owner.

Token -> (row, position) per family (constexpr FAMILY): 0 extend (binary search of the
token in extend_start_loc, `search` halvings), 1 decode (seq_lens - 1 + encoder_lens),
2 draft decode (seq_lens + draft_step, or positions where the step is not known, + lane *
lane stride), 3 target verify (seq_lens + j).

The position check (`pos_mode`, a runtime value: no variant of its own) folds into pass 2:
each token's positions[i] against its range (`hostpos`'s contract); the first such token
is recorded, kind POSITION, only when no token's slot was bad (one record per call), and
is not cleaned (its slot is right).
Padding is exempt by count: tokens past the real total (extend: the last row's start +
count; others: batch * width), rows past the batch.

Ordering among lanes of one block on the same unowned page (page > 1, two rows writing
one page in one step: itself a bug) is the hardware's: which of the two is reported may
differ from the host path's token order. With page 1 a page is a slot, and a second
writer of a slot is a DUPLICATE before it is an owner.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import triton
import triton.language as tl

from ..model.writemap import FAMILIES, Rule
from . import device, kernels
from .kernels import (_BAD, _CALLS, _EXPECTED, _HIGH, _KIND, _LAYER, _NO_POS, _NUMEL, _OWNER, _POS, _ROW, _SITE, _STEP,
                      _TOTAL_BAD, _VALUE)
from .record import OFFSET, Kind
from .shadow import Live

_LOW_MASK = tl.constexpr(2**31 - 1)

K_BOUNDS = tl.constexpr(int(Kind.BOUNDS))
K_FREED = tl.constexpr(int(Kind.FREED))
K_OTHER = tl.constexpr(int(Kind.OTHER_REQUEST))
K_DUP = tl.constexpr(int(Kind.DUPLICATE))
K_SHARED = tl.constexpr(int(Kind.SHARED_ROW))
K_OWNED = tl.constexpr(int(Kind.OWNED))
K_POSITION = tl.constexpr(int(Kind.POSITION))
_HEAD = tl.constexpr(OFFSET["head"])

STEP_BLOCK = 256


class Tables(NamedTuple):
    """A pool's stamp tables, made at its first step: no allocation per step. (The
    cleaned copy goes to the pool's own copy buffers: `pools.PoolState.copy_for`.)"""

    slot_stamps: torch.Tensor  # int64 per slot of [0, high)
    row_stamps: torch.Tensor  # int64 per req_to_token row


def new_tables(high: int, rows: int, where: torch.device) -> Tables:
    return Tables(torch.zeros(high, dtype=torch.int64, device=where),
                  torch.zeros(max(rows, 1), dtype=torch.int64, device=where))


@triton.jit
def _token_map(offs, n, batch, search, FAMILY: tl.constexpr, width, steps, page, draft_step,
               starts_ptr, counts_ptr, prefix_ptr, seq_ptr, offset_ptr, pos_ptr, HAS_OFFSET: tl.constexpr):
    """(real, r, p) per token offset: real = a token of a real row."""
    inside = offs < n
    if FAMILY == 0:  # extend: the last row whose start is at or before the token
        lo = tl.zeros_like(offs)
        hi = tl.zeros_like(offs) + batch  # the answer lies in [lo, hi)
        for _ in range(search):
            active = hi - lo > 1
            mid = (lo + hi) // 2
            st = tl.load(starts_ptr + mid, mask=inside & active, other=0).to(tl.int64)
            go = active & (st <= offs)
            lo = tl.where(go, mid, lo)
            hi = tl.where(active & ~go, mid, hi)
        r = lo
        has = inside & (batch > 0)
        st0 = tl.load(starts_ptr + r, mask=has, other=0).to(tl.int64)
        cnt = tl.load(counts_ptr + r, mask=has, other=0).to(tl.int64)
        j = offs - st0
        real = has & (j >= 0) & (j < cnt)
        p = tl.load(prefix_ptr + r, mask=real, other=0).to(tl.int64) + j
    else:
        r = offs // width
        j = offs - r * width
        real = inside & (r < batch)
        seq = tl.load(seq_ptr + r, mask=real, other=0).to(tl.int64)
        if FAMILY == 1:  # decode
            p = seq - 1
            if HAS_OFFSET:
                p += tl.load(offset_ptr + r, mask=real, other=0).to(tl.int64)
        elif FAMILY == 2:  # draft decode: lane j of row r, at its draft step (else its positions)
            lane = (seq % page + steps + page - 1) // page * page
            given = tl.load(pos_ptr + offs, mask=real & (draft_step < 0), other=0).to(tl.int64)
            p = tl.where(draft_step >= 0, seq + draft_step, given) + j * lane
        else:  # target verify
            p = seq + j
    return real, r, p


@triton.jit
def _position_range(offs, real, r, p, FAMILY: tl.constexpr, width, draft_step, pos_mode, seq_ptr, pos_ptr):
    """(bad, given, lo, hi): the token's positions[i] and the range it must lie in."""
    on = real & (pos_mode > 0)
    given = tl.load(pos_ptr + offs, mask=on, other=0).to(tl.int64)
    if FAMILY == 2:  # a draft step s: seq_lens + s on every lane
        lo = tl.load(seq_ptr + r, mask=on, other=0).to(tl.int64) + draft_step
        hi = lo
    elif FAMILY == 3:  # verify: p = seq_lens + j; a tree's within [seq_lens, p]
        hi = p
        lo = tl.where(pos_mode == 2, p - (offs - r * width), p)
    else:
        lo = p
        hi = p
    return on & ((given < lo) | (given > hi)), given, lo, hi


@triton.jit
def _read_token(raw, offs, real, r, p, virt_ptr, virt_stride, rows_ptr, table_ptr, table_stride, nrows, ncols,
                HAS_VIRT: tl.constexpr):
    """A token's slot, the id compared with req_to_token (its virtual id when set), its
    request's row, and the slot req_to_token gives it (-1 outside the table)."""
    val = raw.to(tl.int64)
    if HAS_VIRT:
        virt = tl.load(virt_ptr + offs * virt_stride, mask=real, other=0).to(tl.int64)
    else:
        virt = val
    rpi = tl.load(rows_ptr + r, mask=real, other=0).to(tl.int64)
    in_table = real & (rpi >= 0) & (rpi < nrows) & (p >= 0) & (p < ncols)
    expected = tl.where(in_table, tl.load(table_ptr + rpi * table_stride + p, mask=in_table, other=-1).to(tl.int64), -1)
    return val, virt, rpi, expected


@triton.jit(do_not_specialize=["n", "batch", "search", "width", "steps", "page", "draft_step", "pos_mode", "pos_site",
                               "high", "site", "layer",
                               "live_page", "live_high", "ncols", "nrows", "ids_stride", "virt_stride", "table_stride"],
            do_not_specialize_on_alignment=["ids_ptr", "virt_ptr", "table_ptr", "rows_ptr", "seq_ptr", "starts_ptr",
                                            "counts_ptr", "prefix_ptr", "offset_ptr", "pos_ptr", "live_ptr",
                                            "owner_ptr", "slot_stamp_ptr", "row_stamp_ptr", "record_ptr", "step_ptr",
                                            "clean_ptr"])
def _step_kernel(
    ids_ptr, ids_stride, virt_ptr, virt_stride, n, table_ptr, table_stride, ncols, nrows, rows_ptr, batch, seq_ptr,
    starts_ptr, counts_ptr, prefix_ptr, offset_ptr, pos_ptr, search, width, steps, page, draft_step, pos_mode, pos_site,
    high, site, layer, live_ptr, owner_ptr, live_page, live_high,
    slot_stamp_ptr, row_stamp_ptr, record_ptr, step_ptr, clean_ptr,
    FAMILY: tl.constexpr,
    HAS_OFFSET: tl.constexpr,
    HAS_VIRT: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    HAS_OWNER: tl.constexpr,
    COPY: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    tag = (tl.load(step_ptr).to(tl.int64) + 1) << 32
    # pass 1: stamp each real token's slot and row with (tag, its smallest index)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        real, r, p = _token_map(offs, n, batch, search, FAMILY, width, steps, page, draft_step, starts_ptr, counts_ptr,
                                prefix_ptr, seq_ptr, offset_ptr, pos_ptr, HAS_OFFSET)
        val = tl.load(ids_ptr + offs * ids_stride, mask=real, other=0).to(tl.int64)
        ok = real & (val >= 0) & (val < high)
        tl.atomic_max(slot_stamp_ptr + val, tag | (_LOW_MASK - offs), mask=ok)
        rpi = tl.load(rows_ptr + r, mask=real, other=0).to(tl.int64)
        rok = real & (rpi >= 0) & (rpi < nrows)
        tl.atomic_max(row_stamp_ptr + rpi, tag | (_LOW_MASK - r), mask=rok)
    tl.debug_barrier()
    # pass 2: decide, claim, copy, tally
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    first_pos = tl.full([BLOCK], _NO_POS, dtype=tl.int64)
    pos_count = tl.zeros([BLOCK], dtype=tl.int64)  # the position check's
    pos_first = tl.full([BLOCK], _NO_POS, dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inside = offs < n
        real, r, p = _token_map(offs, n, batch, search, FAMILY, width, steps, page, draft_step, starts_ptr, counts_ptr,
                                prefix_ptr, seq_ptr, offset_ptr, pos_ptr, HAS_OFFSET)
        raw = tl.load(ids_ptr + offs * ids_stride, mask=inside, other=0)
        val, virt, rpi, expected = _read_token(raw, offs, real, r, p, virt_ptr, virt_stride, rows_ptr, table_ptr,
                                               table_stride, nrows, ncols, HAS_VIRT)
        out = real & ((val < 0) | (val >= high))
        kind = tl.where(out, K_BOUNDS, -1)
        ok = real & ~out
        if HAS_LIVE:
            held = ok & (val >= live_page) & (val < live_high)
            flag = tl.load(live_ptr + val // live_page, mask=held, other=1)
            kind = tl.where((kind < 0) & held & (flag == 0), K_FREED, kind)
        kind = tl.where((kind < 0) & real & (virt != expected), K_OTHER, kind)
        rok = real & (rpi >= 0) & (rpi < nrows)
        row_stamp = tl.atomic_add(row_stamp_ptr + rpi, tl.zeros([BLOCK], dtype=tl.int64), mask=rok)
        row_first = _LOW_MASK - (row_stamp & _LOW_MASK)
        kind = tl.where((kind < 0) & rok & (row_first != r), K_SHARED, kind)
        slot_stamp = tl.atomic_add(slot_stamp_ptr + val, tl.zeros([BLOCK], dtype=tl.int64), mask=ok)
        slot_first = _LOW_MASK - (slot_stamp & _LOW_MASK)
        kind = tl.where((kind < 0) & ok & (slot_first != offs), K_DUP, kind)
        if HAS_OWNER:  # claim an unowned page (owner 0 -> row + 1); another row's page is OWNED
            claim = (kind < 0) & ok & (val >= live_page) & (val < live_high)
            mine = (rpi + 1).to(tl.int32)
            # atomic_cas takes no mask: a lane that does not claim compares page 0's owner with -7 (never equal)
            old = tl.atomic_cas(owner_ptr + tl.where(claim, val // live_page, 0), tl.where(claim, 0, -7).to(tl.int32),
                                tl.where(claim, mine, -7).to(tl.int32))
            kind = tl.where(claim & (old != 0) & (old != mine), K_OWNED, kind)
        bad = kind >= 0
        if COPY:
            tl.store(clean_ptr + offs, tl.where(bad, tl.zeros_like(raw), raw), mask=inside)
        fresh = bad & (first_pos == _NO_POS)
        bad_count += bad.to(tl.int64)
        first_pos = tl.where(fresh, offs, first_pos)
        moved, _, _, _ = _position_range(offs, real, r, p, FAMILY, width, draft_step, pos_mode, seq_ptr, pos_ptr)
        pos_count += moved.to(tl.int64)
        pos_first = tl.where(moved & (pos_first == _NO_POS), offs, pos_first)
    total = tl.sum(bad_count, axis=0)
    pos = tl.min(first_pos, axis=0)
    pos_total = tl.sum(pos_count, axis=0)
    if ASSERT:
        tl.device_assert(total + pos_total == 0, MESSAGE)
    hit = total > 0
    moved_hit = (total == 0) & (pos_total > 0)  # a position only: recorded when no slot was bad
    tl.debug_barrier()  # every lane's claims made before the owner is read back below
    # the first bad token again (one lane), for its details
    at = tl.where(hit, pos, tl.where(moved_hit, tl.min(pos_first, axis=0), 0)) + tl.zeros([BLOCK], dtype=tl.int64)
    one = (hit | moved_hit) & (lanes == 0)
    real, r, p = _token_map(at, n, batch, search, FAMILY, width, steps, page, draft_step, starts_ptr, counts_ptr,
                            prefix_ptr, seq_ptr, offset_ptr, pos_ptr, HAS_OFFSET)
    raw = tl.load(ids_ptr + at * ids_stride, mask=one, other=0)
    val, virt, rpi, expected = _read_token(raw, at, one, r, p, virt_ptr, virt_stride, rows_ptr, table_ptr,
                                           table_stride, nrows, ncols, HAS_VIRT)
    out = (val < 0) | (val >= high)
    kind = tl.where(out, K_BOUNDS, -1)
    owner_row = tl.full([BLOCK], -1, dtype=tl.int64)
    if HAS_LIVE:
        held = one & ~out & (val >= live_page) & (val < live_high)
        flag = tl.load(live_ptr + val // live_page, mask=held, other=1)
        kind = tl.where((kind < 0) & held & (flag == 0), K_FREED, kind)
    kind = tl.where((kind < 0) & (virt != expected), K_OTHER, kind)
    rok = one & (rpi >= 0) & (rpi < nrows)
    row_stamp = tl.atomic_add(row_stamp_ptr + rpi, tl.zeros([BLOCK], dtype=tl.int64), mask=rok)
    kind = tl.where((kind < 0) & rok & ((_LOW_MASK - (row_stamp & _LOW_MASK)) != r), K_SHARED, kind)
    okv = one & ~out
    slot_stamp = tl.atomic_add(slot_stamp_ptr + val, tl.zeros([BLOCK], dtype=tl.int64), mask=okv)
    kind = tl.where((kind < 0) & okv & ((_LOW_MASK - (slot_stamp & _LOW_MASK)) != at), K_DUP, kind)
    if HAS_OWNER:
        held = okv & (val >= live_page) & (val < live_high)
        cur = tl.atomic_add(owner_ptr + val // live_page, tl.zeros([BLOCK], dtype=tl.int32), mask=held)
        cur = tl.where(held, cur, 0).to(tl.int64)
        kind = tl.where(kind < 0, K_OWNED, kind)  # nothing else was wrong with it: its owner was
        owner_row = tl.where(held & (cur != 0), cur - 1, -1)
    # a position's record: its positions[i], the highest position allowed, the draft step, the lowest (a tree)
    _, given, lo, hi = _position_range(at, one & real, r, p, FAMILY, width, draft_step, pos_mode, seq_ptr, pos_ptr)
    kind = tl.where(moved_hit, K_POSITION, kind)
    either = hit | moved_hit
    calls = tl.atomic_add(record_ptr + _CALLS, tl.full([], 1, tl.int64), mask=either)
    tl.atomic_add(record_ptr + _TOTAL_BAD, total + pos_total, mask=either)
    first = either & (calls == 0)
    lane0 = one & first
    tl.store(record_ptr + _SITE + lanes * 0, tl.where(moved_hit, pos_site, site).to(tl.int64) + lanes * 0, mask=lane0)
    tl.store(record_ptr + _LAYER + lanes * 0, layer.to(tl.int64) + lanes * 0, mask=lane0)
    tl.store(record_ptr + _HIGH + lanes * 0, tl.where(moved_hit, 0, high).to(tl.int64) + lanes * 0, mask=lane0)
    tl.store(record_ptr + _BAD + lanes * 0, tl.where(moved_hit, pos_total, total) + lanes * 0, mask=lane0)
    tl.store(record_ptr + _NUMEL + lanes * 0, n.to(tl.int64) + lanes * 0, mask=lane0)
    tl.store(record_ptr + _POS + lanes * 0, at, mask=lane0)
    tl.store(record_ptr + _VALUE + lanes * 0, tl.where(moved_hit, given, val), mask=lane0)
    tl.store(record_ptr + _STEP + lanes * 0, tl.load(step_ptr + lanes * 0, mask=lane0, other=-1), mask=lane0)
    tl.store(record_ptr + _KIND + lanes * 0, kind.to(tl.int64), mask=lane0)
    tl.store(record_ptr + _ROW + lanes * 0, r, mask=lane0)
    tl.store(record_ptr + _EXPECTED + lanes * 0, tl.where(moved_hit, hi, expected), mask=lane0)
    if FAMILY == 2:  # a position's record keeps its draft step in `owner`
        owner_row = tl.where(moved_hit, draft_step + lanes * 0, owner_row)
    else:
        owner_row = tl.where(moved_hit, -1, owner_row)
    tl.store(record_ptr + _OWNER + lanes * 0, owner_row, mask=lane0)
    tl.store(record_ptr + _HEAD + lanes * 0, tl.where(moved_hit & (pos_mode == 2), lo, tl.where(moved_hit, -1, 0)),
             mask=lane0)



def launch(rule: Rule, high: int, site: int, layer: int, record: torch.Tensor, step: torch.Tensor,
           tables: Tables, live: Optional[Live], clean: Optional[torch.Tensor],
           message: Optional[str], pos_site: int = 0) -> None:
    """Enqueue the step check of one forward (no host sync, no allocation). `clean`: a
    contiguous tensor of the ids' numel and dtype that receives the cleaned copy.
    `message`: a device-side assert with that text (strict mode on a GPU). `pos_site`:
    a position report's site (with `rule.expect`: the position check runs)."""
    ids = rule.ids
    n = ids.numel()
    family = FAMILIES.index(rule.family)
    table = rule.table
    assert table.stride(1) == 1, "req_to_token's rows are contiguous"
    assert tables.row_stamps.numel() >= table.shape[0] and tables.slot_stamps.numel() >= high
    has_offset = rule.offset is not None
    has_virt = rule.virtual is not rule.ids
    has_owner = live is not None and live.owner is not None
    constexprs = dict(FAMILY=family, HAS_OFFSET=has_offset, HAS_VIRT=has_virt, HAS_LIVE=live is not None,
                      HAS_OWNER=has_owner, COPY=clean is not None, ASSERT=message is not None, MESSAGE=message or "",
                      BLOCK=STEP_BLOCK)
    seq = rule.seq_lens
    starts = rule.starts if rule.starts is not None else seq
    args = (ids, ids.stride(0), rule.virtual, rule.virtual.stride(0), n, table, table.stride(0), table.shape[1],
            table.shape[0], rule.rows, rule.batch, seq,
            starts, rule.counts if rule.counts is not None else seq, rule.prefix if rule.prefix is not None else seq,
            rule.offset if has_offset else seq, rule.positions if rule.positions is not None else seq,
            max(rule.batch, 1).bit_length(), rule.width, rule.steps, rule.page, rule.draft_step, rule.expect, pos_site,
            high, site, layer, live.flags if live is not None else record,
            live.owner if has_owner else record, live.page if live is not None else 1,
            live.high if live is not None else 0,
            tables.slot_stamps, tables.row_stamps, record, step, ids if clean is None else clean)
    device.enqueue(kernels._launch, _step_kernel, 1, args, constexprs, message is not None)


def warm_up(tables: Tables, where: torch.device, high: int, live: Optional[Live], record: torch.Tensor,
            step: torch.Tensor, message: Optional[str], ids_dtypes: tuple = (torch.int64, torch.int32)) -> None:
    """Compile, by empty launches, the variants a server's steps ask for (each family,
    decode with and without encoder_lens, with and without out_cache_loc_virtual, in
    sglang's dtypes: int32 req_to_token and extend lengths, int64 req_pool_indices,
    seq_lens and positions), so that serving never compiles. `message` set: strict."""
    table = torch.zeros(1, 1, dtype=torch.int32, device=where)
    i64 = torch.zeros(1, dtype=torch.int64, device=where)
    i32 = torch.zeros(1, dtype=torch.int32, device=where)
    for dtype in ids_dtypes:
        ids = torch.empty(0, dtype=dtype, device=where)
        clean = None if message is not None else ids
        for family in FAMILIES:
            for virt in (False, True):
                for offset in ((False, True) if family == "decode" else (False,)):
                    rule = Rule(family, ids, ids.clone() if virt else ids, table, i64, 0, i64,
                                starts=i32 if family == "extend" else None, counts=i32 if family == "extend" else None,
                                prefix=i32 if family == "extend" else None, offset=i64 if offset else None,
                                positions=i64)
                    launch(rule, high, 0, -1, record, step, tables, live, clean, message)
