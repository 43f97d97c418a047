"""Values: the host check that a KV write stores finite values (SGLANG_OOBGUARD_FINITE).

The clean path is one pass: a sum of the values in their own dtype (float32 for FP8),
which NaN and Inf survive. A half-precision total that overflows is summed once more in
float32, and a float32 total that overflows only sends the call to the full scan, which
then finds nothing. Only a sum that is not finite pays for locating the first
non-finite value: its token row, head and whether it is NaN, +Inf or -Inf.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional, Union

import torch

from ..model.violation import part_id
from .record import Record


class ValueFinding(NamedTuple):
    """The non-finite values of one part of one write, and the first one's place."""

    bad: int  # non-finite values
    row: int  # the first one's token: its row in the write (-1: the part is not one row per token)
    head: int  # its head, dim 1 of a per-token part with 3 or more dims (-1: none)
    elem: int  # violation.ELEMENTS: 0 NaN, 1 +Inf, 2 -Inf

    def record(self, site: int, layer: int, high: int, loc: torch.Tensor, part: str, step: int) -> Record:
        """This call as a record of its own; its value is the token's slot (-1: no token)."""
        slot = int(loc.reshape(-1)[self.row]) if self.row >= 0 else -1
        return Record.nonfinite(site=site, layer=layer, high=high, numel=loc.numel(), bad=self.bad, pos=self.row,
                                slot=slot, step=step, head=self.head, elem=self.elem, part=part_id(part))


_HALF = (torch.float16, torch.bfloat16)
_NATIVE = (*_HALF, torch.float32, torch.float64)  # the dtypes torch sums and tests for finiteness itself


def _sums_finite(values: torch.Tensor) -> bool:
    """True when the values' sum is finite, so every value is (one pass, no copy: a
    half-precision sum in its own dtype is 6-9x faster on a CPU than one into float32)."""
    if values.dtype not in _NATIVE:
        return math.isfinite(torch.sum(values, dtype=torch.float32).item())
    if math.isfinite(values.sum().item()):
        return True
    return values.dtype in _HALF and math.isfinite(torch.sum(values, dtype=torch.float32).item())


def _element(x: float) -> int:
    return 0 if x != x else (1 if x > 0 else 2)


def is_value(value: object) -> bool:
    """A write argument the value check reads: a floating tensor, or a Python float (a scale)."""
    if isinstance(value, torch.Tensor):
        return value.is_floating_point()
    return isinstance(value, float)


def scan_values(values: Union[torch.Tensor, float], rows: int) -> Optional[ValueFinding]:
    """None when every value is finite. `rows`: the write's ids; a tensor part with as
    many rows holds one row per token (K, V, MLA's parts), any other (a scale) none."""
    if not isinstance(values, torch.Tensor):
        return None if math.isfinite(values) else ValueFinding(1, -1, -1, _element(values))
    if not values.numel() or _sums_finite(values):
        return None
    wide = values if values.dtype in _NATIVE else values.float()
    bad = ~torch.isfinite(wide.reshape(-1))  # FP8: isfinite has no kernel for it, its float copy does
    count = int(bad.sum())
    if not count:  # a finite sum's overflow
        return None
    first = int(bad.to(torch.uint8).argmax())
    per_token = values.dim() >= 1 and values.shape[0] == rows
    per_row = max(values[0].numel(), 1) if per_token else 0
    row = first // per_row if per_token else -1
    head = (first % per_row) // (per_row // values.shape[1]) if per_token and values.dim() >= 3 else -1
    return ValueFinding(count, row, head, _element(float(wide.reshape(-1)[first])))
