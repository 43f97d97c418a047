"""Probe: find the slot ids of one write that fall outside [0, high).

Two implementations of one contract, folding into one record layout (`record`):

- `scan_host` checks a CPU `loc` at once, in plain torch (no Triton driver needed);
  `cleaned` then makes the private copy a contained write receives;
- `launch` runs `_oob_probe_kernel`, one fused Triton launch that reads `loc` once,
  writes a cleaned copy (bad ids sent to padding slot 0) into a buffer the guard
  owns, and folds the finding into the pool's device record with atomics, with no
  host sync (safe under CUDA-graph capture, and from several streams).

The caller's `loc` is only read. With a liveness shadow (`Live`: one int32 flag per
page of the pool, set while the allocator has the page handed out) an id inside the
bound is also bad when its page is not live; page 0, the padding page that is never
handed out, is exempt. A free is checked the same way (`scan_free` / `launch_free`:
every freed id must be live, and where each id owns its flag, no id twice) and then
clears the flags of the pages it gives back.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs as _knobs

from .record import OFFSET, Kind, Record

# Below this many ids a Python list beats a torch reduction on the host path.
_HOST_LIST_MAX = 32


class Finding(NamedTuple):
    """What one call's scan found: how many ids were bad, the first one and where."""

    bad: int
    pos: int
    value: int

    def record(self, site: int, layer: int, high: int, numel: int, step: int, free: bool = False) -> Record:
        """This call as a record of its own (what `record.fold_host` folds in)."""
        outside = self.value < 0 or self.value >= high
        kind = Kind.BOUNDS if outside else (Kind.DOUBLE_FREE if free else Kind.FREED)
        return Record(self.bad, 1, site, layer, high, self.bad, numel, self.pos, self.value, step, kind)


class Live(NamedTuple):
    """A pool's liveness shadow: flags[id // page] != 0 while that page is handed out."""

    flags: torch.Tensor  # int32 (the free kernel exchanges flags atomically), one per page
    page: int  # ids per flag: the allocator's page size (1: per slot)
    host: Optional[memoryview] = None  # a CPU shadow's memory: the host scan reads it without torch ops
    owner: Optional[torch.Tensor] = None  # [ownership] int32 per page: 0 none, else req_to_token row + 1 (writemap)


def new_live(pages: int, page: int, device: torch.device) -> Live:
    flags = torch.zeros(pages, dtype=torch.int32, device=device)
    owner = torch.zeros(pages, dtype=torch.int32, device=device)  # [ownership]
    return Live(flags, page, None if flags.is_cuda else memoryview(flags.numpy()), owner)  # type: ignore[arg-type]


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
    held = np.frombuffer(live.host, dtype=np.int32)[ids if live.page == 1 else ids // live.page] != 0
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


def _write_mask(loc: torch.Tensor, high: int, lens: torch.Tensor | None, live: Live | None) -> torch.Tensor:
    """Per id of `loc` (flattened): bad and written."""
    bad = _bad(loc.reshape(-1), high, live)
    return bad & _written(loc, lens) if lens is not None else bad


def scan_host(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None,
              live: Live | None = None) -> Finding | None:
    """The immediate CPU check: None when every written id is in [0, high) (and, with
    `live`, on a live page). Host reads are fine here because `loc` already lives in
    host memory. With `lens`, only each row's valid prefix is written, and checked."""
    flat = loc if loc.dim() == 1 else loc.reshape(-1)
    if lens is None and _clean(flat, high, live):
        return None
    return _finding(flat, _write_mask(loc, high, lens, live))


def cleaned(loc: torch.Tensor, high: int, lens: torch.Tensor | None = None,
            live: Live | None = None) -> torch.Tensor:
    """A private copy of `loc` with its bad (written) ids sent to padding slot 0, as
    the kernel's copy; `loc` itself is left as it was."""
    return loc.masked_fill(_write_mask(loc, high, lens, live).reshape(loc.shape), 0)


def mark(live: Live, ids: torch.Tensor) -> None:
    """The allocator handed these ids out: their pages are live (a device scatter)."""
    pages = ids.reshape(-1).to(live.flags.device, torch.int64) // live.page
    live.flags.index_fill_(0, pages, 1)
    if live.owner is not None:  # [ownership] a new allocation has no owner yet
        live.owner.index_fill_(0, pages, 0)


def _repeats(flat: torch.Tensor) -> torch.Tensor:
    """Per id: the same id came earlier in this call (host path)."""
    ids = flat.numpy()
    seen = np.zeros(ids.shape, dtype=bool)
    seen[np.unique(ids, return_index=True)[1]] = True
    return torch.from_numpy(~seen)


def _bad_free(flat: torch.Tensor, high: int, live: Live) -> torch.Tensor:
    """Per freed id: outside [0, high), on a page not live before the call, or, where
    each id owns its flag (page 1: token slots or page ids), named twice in the call.
    Several token ids of one page may share a paged free: it takes the page back once."""
    bad = _bad(flat, high, live, padding_ok=False)
    return bad | _repeats(flat) if live.page == 1 else bad


def scan_free(ids: torch.Tensor, high: int, live: Live) -> Finding | None:
    """The host check of a free: None when every id is in [0, high) on a live page."""
    flat = ids.reshape(-1)
    return _finding(flat, _bad_free(flat, high, live))


def live_only(ids: torch.Tensor, high: int, live: Live) -> torch.Tensor:
    """A free's containment (warn mode, host path): only the ids in [0, high) on a
    live page, each once, so the allocator's free list never takes a slot twice."""
    flat = ids.reshape(-1)
    return flat[~_bad_free(flat, high, live)]


def release_host(ids: torch.Tensor, high: int, live: Live) -> None:
    """The pages of these ids went back to the free list: clear their flags."""
    flat = ids.reshape(-1).to(torch.int64)
    inside = flat[(flat >= 0) & (flat < high)]
    live.flags.index_fill_(0, inside // live.page, 0)
    if live.owner is not None:  # [ownership] the free clears the owner
        live.owner.index_fill_(0, inside // live.page, 0)


# -- the kernels ---------------------------------------------------------------

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
    from the device counter (so a captured probe names the step of its replay)."""
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


@triton.jit
def _id_ptrs(loc_ptr, offs, stride, row_len, row_stride, HAS_LENS: tl.constexpr):
    if HAS_LENS:
        row = offs // row_len
        return loc_ptr + row * row_stride + (offs - row * row_len) * stride
    return loc_ptr + offs * stride


# One compiled variant per constexpr choice and id dtype: no integer is specialized on
# its value and no pointer on its alignment, so serving never meets a new variant.
@triton.jit(do_not_specialize=["n", "stride", "row_len", "row_stride", "high", "site", "layer", "live_page", "chunk"],
            do_not_specialize_on_alignment=["loc_ptr", "lens_ptr", "record_ptr", "scratch_ptr", "step_ptr",
                                            "live_ptr", "clean_ptr"])
def _oob_probe_kernel(
    loc_ptr, n, stride, lens_ptr, row_len, row_stride, high, site, layer,
    record_ptr, scratch_ptr, step_ptr, live_ptr, live_page, clean_ptr, chunk,
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
            held = written & ~bad & (wide >= live_page)
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
        tl.atomic_add(scratch_ptr + 0, total)
        tl.atomic_min(scratch_ptr + 1, pos)
        ticket = tl.atomic_add(scratch_ptr + 2, tl.full([], 1, tl.int64))
        if ticket == tl.num_programs(0) - 1:  # the last program: every other one has added in
            total = tl.atomic_xchg(scratch_ptr + 0, 0)
            pos = tl.atomic_xchg(scratch_ptr + 1, _NO_POS)
            tl.atomic_xchg(scratch_ptr + 2, 0)
            at = _id_ptrs(loc_ptr, tl.minimum(pos, n - 1), stride, row_len, row_stride, HAS_LENS)
            value = tl.load(at, mask=total > 0, other=0).to(tl.int64)
            _conclude(record_ptr, total, pos, value, n, high, site, layer, step_ptr, ASSERT, MESSAGE, 1)


class _Launcher:
    """Launches a kernel variant through its compiled handle once it has one, as torch
    inductor's static launcher does: Triton's `kernel[grid](...)` binds the arguments,
    builds a specialization key and looks the variant up on every call, which is most
    of a probe's host time. The first call of each variant goes the plain way (it
    compiles, or finds the warm-up's compile) and keeps the handle; a Triton whose
    handle lacks what is needed (or its interpreter, which returns none) stays on the
    plain path."""

    def __init__(self) -> None:
        self._compiled: dict[tuple, object] = {}

    def __call__(self, kernel: triton.JITFunction, grid: int, key: tuple, args: tuple, constexprs: dict,
                 debug: bool) -> None:
        compiled = self._compiled.get(key)
        if compiled is not None:
            full = (*args, *constexprs.values())
            stream = torch._C._cuda_getCurrentRawStream(key[0])
            enter = _knobs.runtime.launch_enter_hook
            meta = compiled.launch_metadata((grid, 1, 1), stream, *full) if enter is not None else None
            compiled.run(grid, 1, 1, stream, compiled.function, compiled.packed_metadata, meta, enter,
                         _knobs.runtime.launch_exit_hook, *full)
            return
        handle = kernel[(grid,)](*args, **constexprs, debug=debug)
        if key[0] >= 0 and all(hasattr(handle, name) for name in ("run", "function", "packed_metadata",
                                                                   "launch_metadata")):
            self._compiled[key] = handle


_launch = _Launcher()


def _key(kernel: object, loc: torch.Tensor, lens: torch.Tensor | None, high: int, constexprs: dict) -> tuple:
    """What picks a compiled variant: the device (first: the launch's stream is its),
    the kernel, the pointers' dtypes, whether an integer needs 64 bits, the constexprs."""
    index = loc.device.index if loc.is_cuda and loc.device.index is not None else -1
    return (index, id(kernel), loc.dtype, None if lens is None else lens.dtype,
            high >= 2**31 or loc.numel() >= 2**31, *constexprs.values())


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
           step: torch.Tensor, clean: torch.Tensor | None, message: str | None, lens: torch.Tensor | None = None,
           live: Live | None = None) -> None:
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
            1 if live is None else live.page,
            loc if clean is None else clean,  # unwritten without COPY
            chunk)
    # debug keeps tl.device_assert compiled in
    _launch(_oob_probe_kernel, grid, _key(_oob_probe_kernel, loc, lens, high, constexprs), args, constexprs,
            message is not None)


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
                message: str | None) -> None:
    """Enqueue the check and release of one free (no host sync)."""
    flat = ids if ids.dim() == 1 else ids.reshape(-1)
    constexprs = dict(EXCLUSIVE=live.page == 1, ASSERT=message is not None, MESSAGE=message or "", BLOCK=PROBE_BLOCK)
    args = (flat, flat.numel(), flat.stride(0), high, site, -1, record, step, live.flags, live.page)
    _launch(_free_probe_kernel, 1, _key(_free_probe_kernel, flat, None, high, constexprs), args, constexprs,
            message is not None)
