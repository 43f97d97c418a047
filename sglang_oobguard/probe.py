"""Probe: find the slot ids of one write that fall outside [0, high).

Two implementations of one contract, and the record they both keep:

- `scan_host` checks a CPU `loc` at once, in plain torch (no Triton driver needed);
- `launch` runs `_oob_probe_kernel`, one fused Triton launch that reads `loc` once,
  redirects bad ids to padding slot 0 in place, and folds the finding into a
  per-pool device record, with no host sync (safe under CUDA-graph capture).

With a liveness shadow (`Live`: one uint8 flag per page of the pool, set while the
allocator has the page handed out) an id inside the bound is also bad when its page
is not live; page 0, the padding page that is never handed out, is exempt. A free is
checked the same way (`scan_free` / `launch_free`: every freed id must be live) and
then clears the flags of the pages it gives back.

The record is an int64 tensor, one per pool, laid out as `Record`'s fields:
running totals, then the first violation seen (site, layer, bound, counts, position,
value). Tests feed both paths the same `loc` and compare the records field by field.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl


class Record(NamedTuple):
    """A pool's record, read back. The kernel stores these fields at these offsets."""

    total_bad: int  # bad ids, summed over every violating call
    calls: int  # violating calls
    site: int  # first violation: its site id (report.site_label names it)
    layer: int  # first violation: layer id (-1 when unknown)
    high: int  # first violation: the exclusive bound
    bad: int  # first violation: bad ids in that call
    numel: int  # first violation: loc.numel() of that call
    pos: int  # first violation: position of the first bad id
    value: int  # first violation: its value


RECORD_LEN = len(Record._fields)

# Below this many ids a Python list beats a torch reduction on the host path.
_HOST_LIST_MAX = 32


class Finding(NamedTuple):
    """What one call's scan found: how many ids were bad, the first one and where."""

    bad: int
    pos: int
    value: int


class Live(NamedTuple):
    """A pool's liveness shadow: flags[id // page] != 0 while that page is handed out."""

    flags: torch.Tensor  # uint8, one per page of the pool's id space
    page: int  # ids per flag: the allocator's page size (1: per slot)
    host: Optional[memoryview] = None  # a CPU shadow's memory: the host scan reads it without torch ops


def new_live(pages: int, page: int, device: torch.device) -> Live:
    flags = torch.zeros(pages, dtype=torch.uint8, device=device)
    return Live(flags, page, None if flags.is_cuda else memoryview(flags.numpy()))  # type: ignore[arg-type]


def new_record(device: torch.device) -> torch.Tensor:
    return torch.zeros(RECORD_LEN, dtype=torch.int64, device=device)


def _written(loc: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Which ids of a (rows, cols) `loc` are written: the first lens[row] of each row."""
    cols = torch.arange(loc.shape[-1], device=loc.device)
    return (cols[None, :] < lens.to(loc.device, torch.int64)[:, None]).reshape(-1)


def _bad(flat: torch.Tensor, high: int, live: Live | None, padding_ok: bool = True) -> torch.Tensor:
    """Per id: outside [0, high), or (with a shadow) inside on a page that is not live.
    `padding_ok`: page 0 passes (a write may target it; a free may not)."""
    bad = (flat < 0) | (flat >= high)
    if live is not None:
        dead = ~bad & (live.flags.to(flat.device)[flat.clamp(0, high - 1) // live.page] == 0)
        bad |= dead & (flat >= live.page) if padding_ok else dead
    return bad


def _finding(flat: torch.Tensor, bad: torch.Tensor) -> Finding | None:
    """How many ids are bad, and the first one: what a record keeps of a call."""
    if not bool(bad.any()):
        return None
    pos = int(bad.to(torch.uint8).argmax())
    return Finding(int(bad.sum()), pos, int(flat[pos]))


def _all_live(ids: np.ndarray, live: Live) -> bool:
    """Every id (already inside the bound) sits on a live page, or on page 0."""
    assert live.host is not None
    held = np.frombuffer(live.host, dtype=np.uint8)[ids if live.page == 1 else ids // live.page] != 0
    return bool(held.all()) or bool((held | (ids < live.page)).all())


def _clean(flat: torch.Tensor, high: int, live: Live | None) -> bool:
    """The fast answer for a clean call: True when every id is in [0, high) and (with
    `live`) on a live page; False means "scan it in full". Plain Python for a few ids,
    numpy over the shadow's memory or one torch reduction for many."""
    host = None if live is None else live.host
    if live is not None and host is None:
        return False
    if flat.numel() <= _HOST_LIST_MAX:
        few = flat.tolist()
        if few and (min(few) < 0 or max(few) >= high):
            return False
        if live is None or host is None:
            return True
        page = live.page
        return all(i < page or host[i // page] for i in few)
    if live is None:
        lo, hi = torch.aminmax(flat)
        return lo.item() >= 0 and hi.item() < high
    ids = flat.numpy()
    return bool(ids.min() >= 0 and ids.max() < high) and _all_live(ids, live)


def scan_host(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None,
              live: Live | None = None) -> Finding | None:
    """The immediate CPU check: None when every written id is in [0, high) (and, with
    `live`, on a live page). Host reads are fine here because `loc` already lives in
    host memory. With `lens`, only each row's valid prefix is written, and checked."""
    flat = loc if loc.dim() == 1 else loc.reshape(-1)
    if lens is None and _clean(flat, high, live):
        return None
    bad = _bad(flat, high, live)
    if lens is not None:
        bad &= _written(loc, lens)
    return _finding(flat, bad)


def contain_host(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None,
                 live: Live | None = None) -> None:
    """Redirect bad (written) ids to padding slot 0, in place, as the kernel does."""
    bad = _bad(loc.reshape(-1), high, live).reshape(loc.shape)
    if lens is not None:
        bad &= _written(loc, lens).reshape(loc.shape)
    loc.masked_fill_(bad, 0)


def mark(live: Live, ids: torch.Tensor) -> None:
    """The allocator handed these ids out: their pages are live (a device scatter)."""
    live.flags.index_fill_(0, ids.reshape(-1).to(live.flags.device, torch.int64) // live.page, 1)


def scan_free(ids: torch.Tensor, high: int, live: Live) -> Finding | None:
    """The host check of a free: None when every id is in [0, high) on a live page."""
    flat = ids.reshape(-1)
    return _finding(flat, _bad(flat, high, live, padding_ok=False))


def live_only(ids: torch.Tensor, high: int, live: Live) -> torch.Tensor:
    """A free's containment (warn mode, host path): only the ids in [0, high) on a
    live page, so the allocator's free list never takes a slot twice."""
    flat = ids.reshape(-1)
    return flat[~_bad(flat, high, live, padding_ok=False)]


def release_host(ids: torch.Tensor, high: int, live: Live) -> None:
    """The pages of these ids went back to the free list: clear their flags."""
    flat = ids.reshape(-1).to(torch.int64)
    inside = flat[(flat >= 0) & (flat < high)]
    live.flags.index_fill_(0, inside // live.page, 0)


def read(record: torch.Tensor) -> Record:
    """The record's fields (a host read: on a GPU, only from a host mirror or check())."""
    return Record(*record.tolist())


def fold_host(record: torch.Tensor, finding: Finding, site: int, layer: int, high: int, numel: int) -> None:
    """Fold one call's finding into a host record, exactly as the kernel does."""
    old = read(record)
    if old.calls:
        new = old._replace(total_bad=old.total_bad + finding.bad, calls=old.calls + 1)
    else:
        new = Record(finding.bad, 1, site, layer, high, finding.bad, numel, finding.pos, finding.value)
    record.copy_(torch.tensor(new, dtype=torch.int64))


@triton.jit
def _tally(bad, wide, offs, n, bad_count, first_pos, first_val):
    """Fold one block into the per-lane tallies: bad ids, and the first one's place and value."""
    fresh = bad & (first_pos == n)
    return bad_count + bad.to(tl.int64), tl.where(fresh, offs, first_pos), tl.where(fresh, wide, first_val)


@triton.jit
def _conclude(record_ptr, bad_count, first_pos, first_val, n, high, site, layer,
              ASSERT: tl.constexpr, MESSAGE: tl.constexpr):
    """Reduce the tallies once, assert (strict on a GPU), and fold the call into the
    record: running totals, and the first violation's details. Offsets follow Record's fields."""
    total = tl.sum(bad_count, axis=0)
    pos = tl.min(first_pos, axis=0)
    value = tl.sum(tl.where(first_pos == pos, first_val, 0), axis=0)
    if ASSERT:
        tl.device_assert(total == 0, MESSAGE)
    hit = total > 0
    calls = tl.load(record_ptr + 1)
    first = hit & (calls == 0)
    tl.store(record_ptr + 0, tl.load(record_ptr + 0) + total, mask=hit)
    tl.store(record_ptr + 1, calls + 1, mask=hit)
    tl.store(record_ptr + 2, site.to(tl.int64), mask=first)
    tl.store(record_ptr + 3, layer.to(tl.int64), mask=first)
    tl.store(record_ptr + 4, high.to(tl.int64), mask=first)
    tl.store(record_ptr + 5, total, mask=first)
    tl.store(record_ptr + 6, n.to(tl.int64), mask=first)
    tl.store(record_ptr + 7, pos, mask=first)
    tl.store(record_ptr + 8, value, mask=first)


@triton.jit(do_not_specialize=["n", "high", "site", "layer", "row_len", "live_page"])
def _oob_probe_kernel(
    loc_ptr,
    n,
    stride,
    lens_ptr,
    row_len,
    row_stride,
    high,
    site,
    layer,
    record_ptr,
    live_ptr,
    live_page,
    HAS_LENS: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program walks `loc` in BLOCK-wide chunks, keeps per-lane tallies, and
    reduces once at the end; one launch per guarded write. With HAS_LENS, `loc` is
    (rows, row_len) and only the first lens[row] ids of each row are written. With
    HAS_LIVE, an in-bound id past page 0 is also bad when its page's flag is 0: one
    extra gather in the same launch."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    first_pos = tl.full([BLOCK], n, dtype=tl.int64)
    first_val = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inside = offs < n
        if HAS_LENS:
            row = offs // row_len
            col = offs - row * row_len
            ptrs = loc_ptr + row * row_stride + col * stride
            inside = inside & (col < tl.load(lens_ptr + row, mask=inside, other=0))
        else:
            ptrs = loc_ptr + offs * stride
        ids = tl.load(ptrs, mask=inside, other=0)
        wide = ids.to(tl.int64)
        bad = inside & ((wide < 0) | (wide >= high))
        if HAS_LIVE:
            held = inside & ~bad & (wide >= live_page)
            flag = tl.load(live_ptr + wide // live_page, mask=held, other=1)
            bad = bad | (held & (flag == 0))
        bad_count, first_pos, first_val = _tally(bad, wide, offs, n, bad_count, first_pos, first_val)
        tl.store(ptrs, tl.zeros_like(ids), mask=bad)  # containment
    _conclude(record_ptr, bad_count, first_pos, first_val, n, high, site, layer, ASSERT, MESSAGE)


PROBE_BLOCK = 1024


def launch(loc: torch.Tensor, high: int, site: int, layer: int, record: torch.Tensor, message: str | None,
           lens: torch.Tensor | None = None, live: Live | None = None) -> None:
    """Enqueue the probe for one write. `message` set: a device-side assert with that
    text fails the process on a violation (strict mode on a GPU). `lens`: `loc` is
    (rows, cols) and row i writes only its first lens[i] ids. `live`: also check
    that each id's page is live."""
    if lens is not None:
        flat, row_len, row_stride = loc, loc.shape[1], loc.stride(0)
        stride = loc.stride(1)
    else:
        flat = loc if loc.dim() == 1 else loc.view(-1)
        row_len, row_stride, stride = 1, 0, flat.stride(0)
    _oob_probe_kernel[(1,)](
        flat,
        flat.numel(),
        stride,
        flat if lens is None else lens,  # unread without HAS_LENS
        row_len,
        row_stride,
        high,
        site,
        layer,
        record,
        record if live is None else live.flags,  # unread without HAS_LIVE
        1 if live is None else live.page,
        HAS_LENS=lens is not None,
        HAS_LIVE=live is not None,
        ASSERT=message is not None,
        MESSAGE=message or "",
        BLOCK=PROBE_BLOCK,
        debug=message is not None,  # keeps tl.device_assert compiled in
    )


@triton.jit(do_not_specialize=["n", "high", "site", "layer", "live_page"])
def _free_probe_kernel(
    ids_ptr,
    n,
    stride,
    high,
    site,
    layer,
    record_ptr,
    live_ptr,
    live_page,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A free: every id must lie in [0, high) on a live page; then the pages go back
    (flags cleared). Two passes, so a page named by several ids of one call counts
    once, and a page freed twice across calls is caught."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    first_pos = tl.full([BLOCK], n, dtype=tl.int64)
    first_val = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inside = offs < n
        wide = tl.load(ids_ptr + offs * stride, mask=inside, other=0).to(tl.int64)
        outside = (wide < 0) | (wide >= high)
        flag = tl.load(live_ptr + wide // live_page, mask=inside & ~outside, other=0)
        bad = inside & (outside | (flag == 0))
        bad_count, first_pos, first_val = _tally(bad, wide, offs, n, bad_count, first_pos, first_val)
    _conclude(record_ptr, bad_count, first_pos, first_val, n, high, site, layer, ASSERT, MESSAGE)
    tl.debug_barrier()  # every flag read above before any is cleared below
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inside = offs < n
        wide = tl.load(ids_ptr + offs * stride, mask=inside, other=0).to(tl.int64)
        keep = inside & (wide >= 0) & (wide < high)
        tl.store(live_ptr + wide // live_page, tl.zeros([BLOCK], dtype=tl.uint8), mask=keep)


def launch_free(ids: torch.Tensor, high: int, site: int, record: torch.Tensor, live: Live,
                message: str | None) -> None:
    """Enqueue the check and release of one free (no host sync)."""
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    _free_probe_kernel[(1,)](
        flat, flat.numel(), flat.stride(0), high, site, -1, record, live.flags, live.page,
        ASSERT=message is not None, MESSAGE=message or "", BLOCK=PROBE_BLOCK, debug=message is not None,
    )
