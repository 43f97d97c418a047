"""Value kernel: the fused Triton check that a KV write stores finite values, and its launcher.

One launch per value part of a write (K, V, MLA's latent and rope parts, a scale
tensor), enqueued beside the id probe on the same stream: it reads the values the
write is about to store once, counts the NaN and +-Inf among them, and folds the
first one (its token, that token's slot, its head, what it is) into the pool's
record with the id probe's atomics (`kernels._conclude`): no host sync, no
allocation, safe under CUDA-graph capture (a captured check re-reads the values at
every replay). Large parts split over programs that sum into the pool's scratch,
the last one concluding, as the id probe does. Strict mode compiles the device-side
assert in, with one text for every site (`violation.FINITE_ASSERT`), so the variants
are one per value dtype, id dtype and layout: a pool's warm-up compiles them all.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..model.finite import VALUE_DTYPES
from ..model.violation import FINITE_ASSERT, Kind, part_id
from . import device
from .kernels import _NO_POS, PROBE_BLOCK, _conclude, _last_of_programs, _launch
from .record import OFFSET

_KIND = tl.constexpr(OFFSET["kind"])
_HEAD = tl.constexpr(OFFSET["head"])
_ELEM = tl.constexpr(OFFSET["elem"])
_PART = tl.constexpr(OFFSET["part"])
_NONFINITE = tl.constexpr(int(Kind.NONFINITE))
CHUNK = 16384  # values per program: a decode write of 16 tokens x 8 heads x 128 is one program
DTYPES = tuple(getattr(torch, name) for name in VALUE_DTYPES)  # what a warm-up compiles


@triton.jit
def _conclude_value(record_ptr, val_ptr, loc_ptr, loc_stride, total, pos, n, row_len, row_stride, head_len, rows,
                    high, site, layer, part, step_ptr, PER_TOKEN: tl.constexpr, ASSERT: tl.constexpr,
                    MESSAGE: tl.constexpr):
    """Fold one call: the first non-finite value's token (its row), slot, head and element."""
    hit = total > 0
    at = tl.maximum(tl.minimum(pos, n - 1), 0)
    row = at // row_len
    within = at - row * row_len
    x = tl.load(val_ptr + row * row_stride + within, mask=hit, other=0.0).to(tl.float32)
    elem = tl.where(x != x, 0, tl.where(x > 0, 1, 2)).to(tl.int64)
    if PER_TOKEN:
        token = row
        slot = tl.load(loc_ptr + row * loc_stride, mask=hit, other=0).to(tl.int64)
        head = tl.where(head_len > 0, within // tl.maximum(head_len, 1), -1).to(tl.int64)
    else:
        token = tl.full([], -1, tl.int64)
        slot = tl.full([], -1, tl.int64)
        head = tl.full([], -1, tl.int64)
    first = _conclude(record_ptr, total, token, slot, rows, high, site, layer, step_ptr, ASSERT, MESSAGE, _NONFINITE)
    tl.store(record_ptr + _KIND, tl.full([], _NONFINITE, tl.int64), mask=first)  # a slot outside reads as bounds there
    tl.store(record_ptr + _HEAD, head, mask=first)
    tl.store(record_ptr + _ELEM, elem, mask=first)
    tl.store(record_ptr + _PART, part.to(tl.int64), mask=first)


@triton.jit(do_not_specialize=["n", "row_len", "row_stride", "head_len", "loc_stride", "rows", "high", "site",
                               "layer", "part", "chunk"],
            do_not_specialize_on_alignment=["val_ptr", "loc_ptr", "record_ptr", "scratch_ptr", "step_ptr"])
def _finite_probe_kernel(
    val_ptr, n, row_len, row_stride, head_len, loc_ptr, loc_stride, rows, high, site, layer, part,
    record_ptr, scratch_ptr, step_ptr, chunk,
    PER_TOKEN: tl.constexpr,
    ASSERT: tl.constexpr,
    MESSAGE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Each program walks `chunk` of the part's n values (rows of row_len contiguous
    values, row_stride apart) in BLOCK-wide steps and reduces once; several programs
    sum into the scratch and the last to finish concludes."""
    pid = tl.program_id(0)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    count = tl.zeros([BLOCK], dtype=tl.int64)
    first = tl.full([BLOCK], _NO_POS, dtype=tl.int64)
    begin = pid.to(tl.int64) * chunk
    end = tl.minimum(begin + chunk, n)
    for start in range(begin, end, BLOCK):
        offs = start + lanes
        inside = offs < end
        row = offs // row_len
        x = tl.load(val_ptr + row * row_stride + (offs - row * row_len), mask=inside, other=0.0).to(tl.float32)
        bad = inside & ((x != x) | (tl.abs(x) == float("inf")))
        count += bad.to(tl.int64)
        first = tl.minimum(first, tl.where(bad, offs, _NO_POS))
    total = tl.sum(count, axis=0)
    pos = tl.min(first, axis=0)
    if tl.num_programs(0) == 1:
        _conclude_value(record_ptr, val_ptr, loc_ptr, loc_stride, total, pos, n, row_len, row_stride, head_len, rows,
                        high, site, layer, part, step_ptr, PER_TOKEN, ASSERT, MESSAGE)
    else:
        last, total, pos = _last_of_programs(scratch_ptr, total, pos)
        if last:
            _conclude_value(record_ptr, val_ptr, loc_ptr, loc_stride, total, pos, n, row_len, row_stride, head_len,
                            rows, high, site, layer, part, step_ptr, PER_TOKEN, ASSERT, MESSAGE)


def layout(values: torch.Tensor) -> Optional[tuple[int, int, int]]:
    """(rows, row_len, row_stride) of a part whose rows hold contiguous values; None
    for another layout (the kernel reads it in place: no copy on the guarded path)."""
    if values.dim() <= 1:
        return values.numel(), 1, values.stride(0) if values.dim() else 0
    inner, expected = values.shape[1:], 1
    for size, stride in zip(reversed(inner), reversed(values.stride()[1:])):
        if size != 1 and stride != expected:
            return None
        expected *= size
    return values.shape[0], expected, values.stride(0)


def launch_values(values: torch.Tensor, loc: torch.Tensor, high: int, site: int, layer: int, part: str,
                  record: torch.Tensor, scratch: torch.Tensor, step: torch.Tensor, strict: bool) -> bool:
    """Enqueue the check of one value part of a write whose ids are `loc`; False (nothing
    enqueued) for a layout the kernel cannot read in place or a dtype not in DTYPES. `strict`: a device-side
    assert fails the process on a non-finite value (a GPU; the interpreter asserts nothing)."""
    shape = layout(values) if values.dtype in DTYPES else None
    if shape is None:  # another dtype would compile while serving
        return False
    rows, row_len, row_stride = shape
    flat = loc if loc.dim() == 1 else loc.view(-1) if loc.is_contiguous() else None  # view: no copy
    per_token = flat is not None and values.dim() >= 1 and rows == flat.numel()
    flat = loc.as_strided((0,), (1,)) if flat is None else flat  # a strided 2-D loc: a view, never read
    head_len = row_len // values.shape[1] if per_token and values.dim() >= 3 and values.shape[1] else 0
    n = values.numel()
    grid = max(-(-n // CHUNK), 1)
    constexprs = dict(PER_TOKEN=per_token, ASSERT=strict, MESSAGE=FINITE_ASSERT if strict else "", BLOCK=PROBE_BLOCK)
    args = (values, n, max(row_len, 1), row_stride, head_len, flat, flat.stride(0), loc.numel(), high, site, layer,
            part_id(part), record, scratch, step, CHUNK)
    device.enqueue(_launch, _finite_probe_kernel, grid, args, constexprs, strict)
    return True


def warm_up(record: torch.Tensor, scratch: torch.Tensor, counter: torch.Tensor, strict: bool) -> None:
    """Compile, by launches over no token and one finite scale, every variant a pool's
    writes can ask for (value dtype, id dtype, per token or not), so that serving and
    graph capture never compile."""
    where = record.device
    for dtype in DTYPES:
        for ids in (torch.int64, torch.int32):
            loc = torch.empty(0, dtype=ids, device=where)
            for values in (torch.empty(0, 1, 1, dtype=dtype, device=where), torch.zeros(1, dtype=dtype, device=where)):
                launch_values(values, loc, 1, 0, -1, "cache_k", record, scratch, counter, strict)
