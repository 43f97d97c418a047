"""Owners: who holds a slot, named for a report (the slow path): the one holder look-up.

Runs only when a violation is reported. A slot's holder is read two ways, both here
only: the owner table (`shadow.Live.owner`: the req_to_token row that wrote the slot's
page since it was handed out) and req_to_token itself (the row and position that name
the slot), each row named by its request id where a step's batch holds it. Every
report that names a holder (the write map's, the owner, ownids, SWA, claims, reads and
HiCache checks) comes here with a slot, or a set of slots, and a step.
"""

from __future__ import annotations

from typing import Any, Iterable, NamedTuple, Optional, Union

import numpy as np
import torch

from ..model.targets import write_map_off, write_map_unmeasured
from ..probes import hostscan
from ..probes.record import Kind
from ..probes.shadow import PAGE_BYTES, Live
from .unit import Found, Unit


class Lookup(NamedTuple):
    """Where holders are looked up: req_to_token, a step's batch rows and their request ids."""

    table: torch.Tensor  # req_to_token
    rows: Any  # the batch's req_pool_indices (a tensor or a list)
    rids: Optional[list]  # their request ids (None: rows are named by number)


def of_step(seen: Any) -> Optional[Lookup]:
    """A kept step's look-up (`steps.Seen`); None when it is not kept or has no rows."""
    if seen is None or seen.pool_indices is None:
        return None
    return Lookup(seen.runner.req_to_token_pool.req_to_token, seen.pool_indices[:seen.batch_size], seen.rids)


def holder(where: Optional[Lookup], slots: Union[int, Iterable[int]], prefer: int = -1,
           own: Optional[tuple[int, Optional[int]]] = None) -> Optional[tuple[str, int]]:
    """(request, position) of the first of `slots` (one slot, or several: those naming
    one page) that a row of `where` holds, in `find_owner`'s order. `own`: the writer's
    (or reader's) index in the batch and its position, an entry not counted. None: no
    row holds any of them, or nothing to look in."""
    if where is None:
        return None
    skip = None
    if own is not None and 0 <= own[0] < len(where.rows) and own[1] is not None and own[1] >= 0:
        skip = (int(where.rows[own[0]]), int(own[1]))
    for slot in ([slots] if np.ndim(slots) == 0 else slots):
        found = find_owner(where.table, where.rows, where.rids, int(slot), prefer=prefer, skip=skip)
        if found is not None:
            return found
    return None


def held_by_row(recent: Iterable[Any], row: int, slot: int, table: Any = None) -> tuple[str, Optional[int]]:
    """The holder the owner table gives (req_to_token row `row`), for a report: named by
    the latest of the `recent` steps (`Steps.recent`, newest first) whose batch holds the
    row, at the position where it (else any row) holds `slot`. `table`: req_to_token when
    no step is kept. The row alone when nothing holds the slot."""
    where = None
    for seen in recent:
        step = of_step(seen)
        if step is None:
            continue
        table = step.table
        rows = step.rows.tolist()
        if row in rows:
            where = Lookup(table, rows, step.rids)
            break
    if where is None and table is not None:
        where = Lookup(table, [], None)
    return holder(where, slot, prefer=row) or (_row_name(row), None)


def owner_rows(live: Live, ids: np.ndarray) -> np.ndarray:
    """The owner table's row of each host id (the request that wrote its page since it
    was handed out); -1: none yet, the padding page, or outside the shadow."""
    looked = hostscan.look_up(ids, live, low=live.page)
    assert live.owner is not None
    owner = live.owner.numpy().take(looked.page).astype(np.int64)
    return np.where(looked.inside, owner - 1, -1)


def page_owner_rows(live: Live, pages: np.ndarray) -> np.ndarray:
    """The owner table's row of each page (at idle: a copy to the host); -1: none, or no table."""
    if live.owner is None:
        return np.full(pages.size, -1, dtype=np.int64)
    return live.owner[:live.pages].cpu().numpy()[pages].astype(np.int64) - 1


def _row_name(row: int) -> str:
    """A holder no step's batch names: its req_to_token row."""
    return f"req_to_token row {row}"


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
        return _row_name(row)

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


def named(where: Optional[Lookup], kind: int, row: int, token: Optional[int], slot: int, owner_row: int = -1,
          expected: int = -1) -> dict[str, Any]:
    """A report's fields for both sides of a write-map or owner violation: the writer
    (its request at `row` of the batch, and its token), the token's own slot, and the
    request that holds `slot` (the owner lookup: slow, on a violation only); {} with
    nothing to look in (a step no longer kept)."""
    if where is None:
        return {}
    fields: dict[str, Any] = {"expected": expected}
    rows, rids = where.rows, where.rids
    if 0 <= row < len(rows):
        fields["request"] = str(rids[row]) if rids is not None and row < len(rids) else _row_name(int(rows[row]))
        if token is not None and token >= 0:
            fields["token"] = token
    if kind in NAMED_KINDS:
        found = holder(where, slot, prefer=owner_row, own=(row, token))
        if found is not None:
            fields["owner"], fields["owner_token"] = found
    return fields


def doctor(found: Found) -> list[str]:
    return ["the owner and read checks read the shadow of the ids req_to_token holds (an SWA pool's: its full "
            "sub-pool's); a step pool no shadow holds: both off, said once in the log (WARNING)",
            *(f"not checked: {name} ({why}: the write map skips them)" for name, why in write_map_unmeasured())]


UNIT = Unit("owners", "a slot is written by the request that owns it", "per step: O(tokens)", ("steps",),
            "the forward step, with the liveness shadow's owner table", where=write_map_off, doctor=doctor,
            memory=lambda pages, rows, context: PAGE_BYTES["owner"] * (pages + 1))
