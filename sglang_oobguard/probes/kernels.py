"""Kernels: the fused Triton probes, each with its launcher beside it.

`launch` enqueues `_oob_probe_kernel`, one launch per write that reads the ids once,
writes a cleaned copy (bad ids sent to padding slot 0) into a buffer the guard owns,
and folds the finding into the pool's device record with atomics: no host sync,
safe under CUDA-graph capture and from several streams. `launch_free` checks and
releases one free against the liveness shadow. Every integer argument is left
unspecialized and every pointer unaligned-specialized, so one compiled variant
serves each constexpr choice and id dtype: serving never compiles.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from . import device
from .record import OFFSET
from .shadow import Live

# Record offsets, as the kernels see them (one layout: record.Record).
_TOTAL_BAD = tl.constexpr(OFFSET["total_bad"])
_CALLS = tl.constexpr(OFFSET["calls"])
_SITE = tl.constexpr(OFFSET["site"])
_LAYER = tl.constexpr(OFFSET["layer"])
_HIGH = tl.constexpr(OFFSET["high"])
_BAD = tl.constexpr(OFFSET["bad"])
_NUMEL = tl.constexpr(OFFSET["numel"])
_POS = tl.constexpr(OFFSET["pos"])
_VALUE = tl.constexpr(OFFSET["value"])
_STEP = tl.constexpr(OFFSET["step"])
_KIND = tl.constexpr(OFFSET["kind"])
_ROW = tl.constexpr(OFFSET["row"])
_EXPECTED = tl.constexpr(OFFSET["expected"])
_OWNER = tl.constexpr(OFFSET["owner"])
_NO_POS = tl.constexpr(2**62)  # "no bad id": above any position
# The per-call scratch of a probe split over several programs (one such probe at a
# time per pool): summed bad ids, the least bad position, and the ticket that elects
# the last program to conclude; the last one puts it back as it found it.
SCRATCH_INIT = (0, 2**62, 0)


@triton.jit
def _tally(bad, wide, offs, bad_count, first_pos, first_val):
    """Fold one block into the per-lane tallies: bad ids, and the first one's place and value."""
    fresh = bad & (first_pos == _NO_POS)
    return bad_count + bad.to(tl.int64), tl.where(fresh, offs, first_pos), tl.where(fresh, wide, first_val)


@triton.jit
def _conclude(record_ptr, total, pos, value, n, high, site, layer, step_ptr,
              ASSERT: tl.constexpr, MESSAGE: tl.constexpr, IN_RANGE_KIND: tl.constexpr):
    """Assert (strict on a GPU), then fold one call into the record with atomics, so
    probes on several streams neither lose counts nor mix two first violations: the
    call that takes `calls` from 0 writes the details, with the step number it reads
    from the device counter (so a captured probe names the step of its replay).
    Returns whether this call wrote the details (a caller adds fields of its own)."""
    if ASSERT:
        tl.device_assert(total == 0, MESSAGE)
    hit = total > 0
    tl.atomic_add(record_ptr + _TOTAL_BAD, total, mask=hit)
    calls = tl.atomic_add(record_ptr + _CALLS, tl.full([], 1, tl.int64), mask=hit)
    first = hit & (calls == 0)
    tl.store(record_ptr + _SITE, site.to(tl.int64), mask=first)
    tl.store(record_ptr + _LAYER, layer.to(tl.int64), mask=first)
    tl.store(record_ptr + _HIGH, high.to(tl.int64), mask=first)
    tl.store(record_ptr + _BAD, total, mask=first)
    tl.store(record_ptr + _NUMEL, n.to(tl.int64), mask=first)
    tl.store(record_ptr + _POS, pos, mask=first)
    tl.store(record_ptr + _VALUE, value, mask=first)
    tl.store(record_ptr + _STEP, tl.load(step_ptr, mask=first, other=-1), mask=first)
    outside = (value < 0) | (value >= high)
    tl.store(record_ptr + _KIND, tl.where(outside, 0, IN_RANGE_KIND).to(tl.int64), mask=first)
    none = tl.full([], -1, tl.int64)
    tl.store(record_ptr + _ROW, none, mask=first)
    tl.store(record_ptr + _EXPECTED, none, mask=first)
    tl.store(record_ptr + _OWNER, none, mask=first)
    return first


@triton.jit
def _last_of_programs(scratch_ptr, total, pos):
    """A probe split over several programs: each adds its count and least position into
    the scratch; the last to arrive (every other one has added in) takes the sums and
    puts the scratch back as it found it. Returns (this is the last, total, position)."""
    tl.atomic_add(scratch_ptr + 0, total)
    tl.atomic_min(scratch_ptr + 1, pos)
    ticket = tl.atomic_add(scratch_ptr + 2, tl.full([], 1, tl.int64))
    last = ticket == tl.num_programs(0) - 1
    if last:
        total = tl.atomic_xchg(scratch_ptr + 0, 0)
        pos = tl.atomic_xchg(scratch_ptr + 1, _NO_POS)
        tl.atomic_xchg(scratch_ptr + 2, 0)
    return last, total, pos


@triton.jit
def _id_ptrs(loc_ptr, offs, stride, row_len, row_stride, HAS_LENS: tl.constexpr):
    if HAS_LENS:
        row = offs // row_len
        return loc_ptr + row * row_stride + (offs - row * row_len) * stride
    return loc_ptr + offs * stride


# One compiled variant per constexpr choice and id dtype: no integer is specialized on
# its value and no pointer on its alignment, so serving never meets a new variant.
@triton.jit(do_not_specialize=["n", "stride", "row_len", "row_stride", "high", "site", "layer", "live_page", "live_high",
                               "chunk"],
            do_not_specialize_on_alignment=["loc_ptr", "lens_ptr", "record_ptr", "scratch_ptr", "step_ptr",
                                            "live_ptr", "clean_ptr"])
def _oob_probe_kernel(
    loc_ptr, n, stride, lens_ptr, row_len, row_stride, high, site, layer,
    record_ptr, scratch_ptr, step_ptr, live_ptr, live_page, live_high, clean_ptr, chunk,
    HAS_LENS: tl.constexpr,
    HAS_LIVE: tl.constexpr,
    COPY: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each program walks `chunk` ids of `loc` in BLOCK-wide steps, keeps per-lane
    tallies and reduces once. One program concludes at once; several sum into the
    scratch and the last to finish concludes. With HAS_LENS, `loc` is (rows,
    row_len) and only the first lens[row] ids of each row are written. With
    HAS_LIVE, an in-bound id past page 0 is also bad when its page's flag is 0 (one
    extra gather). With COPY, every id goes to `clean_ptr` (contiguous), bad ones as 0."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    first_pos = tl.full([BLOCK], _NO_POS, dtype=tl.int64)
    first_val = tl.zeros([BLOCK], dtype=tl.int64)
    begin = pid.to(tl.int64) * chunk
    end = tl.minimum(begin + chunk, n)
    for start in range(begin, end, BLOCK):
        offs = start + lanes
        inside = offs < end
        ptrs = _id_ptrs(loc_ptr, offs, stride, row_len, row_stride, HAS_LENS)
        ids = tl.load(ptrs, mask=inside, other=0)
        written = inside
        if HAS_LENS:
            written = inside & ((offs % row_len) < tl.load(lens_ptr + offs // row_len, mask=inside, other=0))
        wide = ids.to(tl.int64)
        bad = written & ((wide < 0) | (wide >= high))
        if HAS_LIVE:
            held = written & ~bad & (wide >= live_page) & (wide < live_high)
            flag = tl.load(live_ptr + wide // live_page, mask=held, other=1)
            bad = bad | (held & (flag == 0))
        bad_count, first_pos, first_val = _tally(bad, wide, offs, bad_count, first_pos, first_val)
        if COPY:
            tl.store(clean_ptr + offs, tl.where(bad, tl.zeros_like(ids), ids), mask=inside)
    total = tl.sum(bad_count, axis=0)
    pos = tl.min(first_pos, axis=0)
    if tl.num_programs(0) == 1:
        value = tl.sum(tl.where(first_pos == pos, first_val, 0), axis=0)
        _conclude(record_ptr, total, pos, value, n, high, site, layer, step_ptr, ASSERT, MESSAGE, 1)
    else:
        last, total, pos = _last_of_programs(scratch_ptr, total, pos)
        if last:
            at = _id_ptrs(loc_ptr, tl.minimum(pos, n - 1), stride, row_len, row_stride, HAS_LENS)
            value = tl.load(at, mask=total > 0, other=0).to(tl.int64)
            _conclude(record_ptr, total, pos, value, n, high, site, layer, step_ptr, ASSERT, MESSAGE, 1)


def _launch(kernel: triton.JITFunction, grid: int, args: tuple, constexprs: dict, debug: bool) -> None:
    """Launch one kernel variant (`device.enqueue` puts it on the current stream); debug
    keeps tl.device_assert compiled in."""
    kernel[(grid,)](*args, **constexprs, debug=debug)


PROBE_BLOCK = 1024
SPLIT_ABOVE = 8192  # more ids than this: several programs (a 64k prefill chunk is 16 of them)
SPLIT_CHUNK = 4096  # ids per program when split (bench/gpu_probe.py measures one program against the split)


def programs(n: int) -> tuple[int, int]:
    """(programs, ids per program) for a probe of n ids."""
    if n <= SPLIT_ABOVE:
        return 1, max(n, 1)
    grid = -(-n // SPLIT_CHUNK)
    return grid, SPLIT_CHUNK


def launch(loc: torch.Tensor, high: int, site: int, layer: int, record: torch.Tensor, scratch: torch.Tensor,
           step: torch.Tensor, clean: Optional[torch.Tensor], message: Optional[str], lens: Optional[torch.Tensor] = None,
           live: Optional[Live] = None) -> None:
    """Enqueue the probe for one write. `clean` set: a contiguous tensor of loc's
    numel and dtype that receives the cleaned copy. `message` set: a device-side
    assert with that text fails the process on a violation (strict mode on a GPU).
    `lens`: `loc` is (rows, cols) and row i writes only its first lens[i] ids.
    `live`: also check that each id's page is live. `step`: the device's step counter."""
    if lens is not None:
        row_len, row_stride, stride = loc.shape[1], loc.stride(0), loc.stride(1)
    else:
        loc = loc if loc.dim() == 1 else loc.view(-1)
        row_len, row_stride, stride = 1, 0, loc.stride(0)
    n = loc.numel()
    grid, chunk = programs(n)
    constexprs = dict(HAS_LENS=lens is not None, HAS_LIVE=live is not None, COPY=clean is not None,
                      ASSERT=message is not None, MESSAGE=message or "", BLOCK=PROBE_BLOCK)
    args = (loc, n, stride,
            loc if lens is None else lens,  # unread without HAS_LENS
            row_len, row_stride, high, site, layer, record, scratch, step,
            record if live is None else live.flags,  # unread without HAS_LIVE
            1 if live is None else live.page, 0 if live is None else live.high,
            loc if clean is None else clean,  # unwritten without COPY
            chunk)
    device.enqueue(_launch, _oob_probe_kernel, grid, args, constexprs, message is not None)


@triton.jit(do_not_specialize=["n", "stride", "high", "site", "layer", "live_page"],
            do_not_specialize_on_alignment=["ids_ptr", "record_ptr", "step_ptr", "live_ptr"])
def _free_probe_kernel(
    ids_ptr, n, stride, high, site, layer, record_ptr, step_ptr, live_ptr, live_page,
    EXCLUSIVE: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A free: every id must lie in [0, high) on a live page; then the pages go back
    (flags cleared). EXCLUSIVE (each id owns its flag): one pass that exchanges each
    flag for 0, so an id named twice, in this call or an earlier one, finds 0.
    Otherwise (token ids of a paged allocator, several per page): every flag is read
    first, then cleared, so a page named by several ids of one call counts once."""
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    bad_count = tl.zeros([BLOCK], dtype=tl.int64)
    first_pos = tl.full([BLOCK], _NO_POS, dtype=tl.int64)
    first_val = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + lanes
        inside = offs < n
        wide = tl.load(ids_ptr + offs * stride, mask=inside, other=0).to(tl.int64)
        keep = inside & (wide >= 0) & (wide < high)
        if EXCLUSIVE:
            flag = tl.atomic_xchg(live_ptr + wide // live_page, tl.zeros([BLOCK], dtype=tl.int32), mask=keep)
        else:
            flag = tl.load(live_ptr + wide // live_page, mask=keep, other=0)
        bad = inside & (~keep | (flag == 0))
        bad_count, first_pos, first_val = _tally(bad, wide, offs, bad_count, first_pos, first_val)
    total = tl.sum(bad_count, axis=0)
    pos = tl.min(first_pos, axis=0)
    value = tl.sum(tl.where(first_pos == pos, first_val, 0), axis=0)
    _conclude(record_ptr, total, pos, value, n, high, site, layer, step_ptr, ASSERT, MESSAGE, 2)
    if not EXCLUSIVE:
        tl.debug_barrier()  # every flag read above before any is cleared below
        for start in range(0, n, BLOCK):
            offs = start + lanes
            inside = offs < n
            wide = tl.load(ids_ptr + offs * stride, mask=inside, other=0).to(tl.int64)
            keep = inside & (wide >= 0) & (wide < high)
            tl.store(live_ptr + wide // live_page, tl.zeros([BLOCK], dtype=tl.int32), mask=keep)


def launch_free(ids: torch.Tensor, high: int, site: int, record: torch.Tensor, step: torch.Tensor, live: Live,
                message: Optional[str]) -> None:
    """Enqueue the check and release of one free (no host sync)."""
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    constexprs = dict(EXCLUSIVE=live.page == 1, ASSERT=message is not None, MESSAGE=message or "", BLOCK=PROBE_BLOCK)
    args = (flat, flat.numel(), flat.stride(0), high, site, -1, record, step, live.flags, live.page)
    device.enqueue(_launch, _free_probe_kernel, 1, args, constexprs, message is not None)
