"""Probe: find the slot ids of one write that fall outside [0, high).

Two implementations of one contract, and the record they both keep:

- `scan_host` checks a CPU `loc` at once, in plain torch (no Triton driver needed);
- `launch` runs `_oob_probe_kernel`, one fused Triton launch that reads `loc` once,
  redirects bad ids to padding slot 0 in place, and folds the finding into a
  per-pool device record, with no host sync (safe under CUDA-graph capture).

The record is an int64 tensor, one per pool, laid out as `Record`'s fields:
running totals, then the first violation seen (site, layer, bound, counts, position,
value). Tests feed both paths the same `loc` and compare the records field by field.
"""

from __future__ import annotations

from typing import NamedTuple

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


def new_record(device: torch.device) -> torch.Tensor:
    return torch.zeros(RECORD_LEN, dtype=torch.int64, device=device)


def _written(loc: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Which ids of a (rows, cols) `loc` are written: the first lens[row] of each row."""
    cols = torch.arange(loc.shape[-1], device=loc.device)
    return (cols[None, :] < lens.to(loc.device, torch.int64)[:, None]).reshape(-1)


def scan_host(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None) -> Finding | None:
    """The immediate CPU check: None when every written id is in [0, high). Host
    reads are fine here because `loc` already lives in host memory. With `lens`,
    only each row's valid prefix is written, and checked."""
    flat = loc if loc.dim() == 1 else loc.reshape(-1)
    if lens is not None:
        bad = _written(loc, lens) & ((flat < 0) | (flat >= high))
        if not bool(bad.any()):
            return None
        pos = int(bad.to(torch.uint8).argmax())
        return Finding(int(bad.sum()), pos, int(flat[pos]))
    if flat.numel() <= _HOST_LIST_MAX:
        ids = flat.tolist()
        if not ids or (min(ids) >= 0 and max(ids) < high):
            return None
    else:
        lo, hi = torch.aminmax(flat)
        if lo.item() >= 0 and hi.item() < high:
            return None
    bad = (flat < 0) | (flat >= high)
    pos = int(bad.to(torch.uint8).argmax())
    return Finding(int(bad.sum()), pos, int(flat[pos]))


def contain_host(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None) -> None:
    """Redirect bad (written) ids to padding slot 0, in place, as the kernel does."""
    bad = (loc < 0) | (loc >= high)
    if lens is not None:
        bad &= _written(loc, lens).reshape(loc.shape)
    loc.masked_fill_(bad, 0)


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


@triton.jit(do_not_specialize=["n", "high", "site", "layer", "row_len"])
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
    HAS_LENS: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One program walks `loc` in BLOCK-wide chunks, keeps per-lane tallies, and
    reduces once at the end; one launch per guarded write. With HAS_LENS, `loc` is
    (rows, row_len) and only the first lens[row] ids of each row are written."""
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
        bad_count += bad.to(tl.int64)
        fresh = bad & (first_pos == n)
        first_val = tl.where(fresh, wide, first_val)
        first_pos = tl.where(fresh, offs, first_pos)
        tl.store(ptrs, tl.zeros_like(ids), mask=bad)  # containment
    total = tl.sum(bad_count, axis=0)
    pos = tl.min(first_pos, axis=0)
    value = tl.sum(tl.where(first_pos == pos, first_val, 0), axis=0)
    if ASSERT:
        tl.device_assert(total == 0, MESSAGE)
    hit = total > 0
    calls = tl.load(record_ptr + 1)
    first = hit & (calls == 0)
    # Offsets follow Record's fields: total_bad, calls, site, layer, high, bad, numel, pos, value.
    tl.store(record_ptr + 0, tl.load(record_ptr + 0) + total, mask=hit)
    tl.store(record_ptr + 1, calls + 1, mask=hit)
    tl.store(record_ptr + 2, site.to(tl.int64), mask=first)
    tl.store(record_ptr + 3, layer.to(tl.int64), mask=first)
    tl.store(record_ptr + 4, high.to(tl.int64), mask=first)
    tl.store(record_ptr + 5, total, mask=first)
    tl.store(record_ptr + 6, n.to(tl.int64), mask=first)
    tl.store(record_ptr + 7, pos, mask=first)
    tl.store(record_ptr + 8, value, mask=first)


PROBE_BLOCK = 1024


def launch(loc: torch.Tensor, high: int, site: int, layer: int, record: torch.Tensor, message: str | None,
           lens: torch.Tensor | None = None) -> None:
    """Enqueue the probe for one write. `message` set: a device-side assert with that
    text fails the process on a violation (strict mode on a GPU). `lens`: `loc` is
    (rows, cols) and row i writes only its first lens[i] ids."""
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
        HAS_LENS=lens is not None,
        ASSERT=message is not None,
        MESSAGE=message or "",
        BLOCK=PROBE_BLOCK,
        debug=message is not None,  # keeps tl.device_assert compiled in
    )
