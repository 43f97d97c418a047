"""Owners: who holds a slot in req_to_token, named for a report (the slow path).

Runs only when a write-map or owner violation is reported: it names the writing
request and its token, and the request that holds the slot and its position.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..model.targets import write_map_off
from ..probes.record import Kind
from ..probes.shadow import PAGE_BYTES
from .unit import Found, Unit


def find_owner(req_to_token: torch.Tensor, rows: Any, rids: Optional[list], slot: int, lengths: Any = None,
               prefer: int = -1, skip: Optional[tuple[int, int]] = None) -> Optional[tuple[str, int]]:
    """Who holds `slot` in req_to_token: the row `prefer` first (the owner table's
    row, when liveness knows it), then the batch's rows (`rows`: its
    req_pool_indices, `rids` their request ids; with `lengths`, their seq_lens, only
    a row's first lengths[r] entries at first), then every row of the table. `skip`:
    (row, position) not to count (the writer's own entry). Returns (owner name,
    position): the rid, or "req_to_token row R" for a row that is not in the batch;
    None when no row holds it."""
    table = req_to_token.detach().cpu()
    rows = [int(x) for x in (rows.tolist() if isinstance(rows, torch.Tensor) else (rows or []))]
    lens = None if lengths is None else [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor)
                                                          else lengths)]

    def name(row: int) -> str:
        if rids is not None and row in rows and rows.index(row) < len(rids):
            return str(rids[rows.index(row)])
        return f"req_to_token row {row}"

    def holds(row: int, limit: int) -> Optional[int]:
        if not 0 <= row < table.shape[0]:
            return None
        for pos in (table[row, :max(0, min(limit, table.shape[1]))] == slot).nonzero().flatten().tolist():
            if skip is None or (row, pos) != tuple(skip):
                return pos
        return None

    passes = [[prefer]] if prefer >= 0 else []
    if lens is not None:
        passes.append([(row, lens[i]) for i, row in enumerate(rows) if i < len(lens)])
    passes.append(rows)
    passes.append(range(table.shape[0]))
    for rows_of_pass in passes:
        for item in rows_of_pass:
            row, limit = item if isinstance(item, tuple) else (item, table.shape[1])
            pos = holds(row, limit)
            if pos is not None:
                return name(row), pos
    return None


NAMED_KINDS = (Kind.OTHER_REQUEST, Kind.DUPLICATE, Kind.SHARED_ROW, Kind.OWNED)
READ_KINDS = (Kind.READ_FREED, Kind.READ_REUSED, Kind.REPOINTED)  # the read check's: the reader, not a writer


def named(table: torch.Tensor, rows: torch.Tensor, rids: Optional[list], kind: int, row: int, token: Optional[int],
          slot: int, owner_row: int = -1, expected: int = -1) -> dict[str, Any]:
    """A report's fields for both sides of a write-map or owner violation: the writer
    (its request at `row` of the batch, and its token), the token's own slot, and the
    request that holds `slot` (the owner lookup: slow, on a violation only)."""
    fields: dict[str, Any] = {"expected": expected}
    if 0 <= row < rows.numel():
        fields["request"] = str(rids[row]) if rids is not None and row < len(rids) else \
            f"req_to_token row {int(rows[row])}"
        if token is not None and token >= 0:
            fields["token"] = token
    if kind in NAMED_KINDS:
        skip = (int(rows[row]), int(token)) if 0 <= row < rows.numel() and token is not None and token >= 0 else None
        found = find_owner(table, rows, rids, slot, prefer=owner_row, skip=skip)
        if found is not None:
            fields["owner"], fields["owner_token"] = found
    return fields


def doctor(found: Found) -> list[str]:
    return ["the owner and read checks read the shadow of the ids req_to_token holds (an SWA pool's: its full "
            "sub-pool's); a step pool no shadow holds: both off, said once in the log (WARNING)"]


UNIT = Unit("owners", "a slot is written by the request that owns it", "per step: O(tokens)", ("steps",),
            "the forward step, with the liveness shadow's owner table", where=write_map_off, doctor=doctor,
            memory=lambda pages, rows, context: PAGE_BYTES["owner"] * (pages + 1))
