"""Step map: the forward step's check with the write map, as the guard calls it.

`check_step` is what `Guard.step_begin` calls for the step's out_cache_loc (instead of
the plain bounds / liveness probe of it, which stays the fallback where the map is not
defined): the host check (`writemap.check_host`) for CPU ids, else the one launch of
`stepkernel`. It returns the ids the forward should write with: None (sglang's own,
clean or strict), or the private cleaned copy, which the forward hook binds to the
batch's `out_cache_loc` for that forward only and restores after it, so that every
writer of the step (pool methods, and the fused ones too, through sglang's own copy of
out_cache_loc into its input buffers) writes the contained ids. sglang's tensor is
never changed.

`describe` names both sides of a write-map or owner violation for the report (the owner
lookup, slow: it runs only on a violation). `SKIPPED` counts the forwards skipped by
name (the reason: a mode where the map is not defined); `doctor` can list it.
"""

from __future__ import annotations

from collections import deque
from typing import Any, NamedTuple, Optional

import torch

from . import stepkernel, writemap
from .config import Mode
from .record import Kind, Record
from .report import KVOutOfBoundsError, logger

TABLES_ATTR = "_oobguard_step_tables"  # on a PoolState: its stepkernel.Tables
SKIPPED: dict[str, int] = {}  # reason -> forwards whose write map was not checked
NAMED_KINDS = (Kind.OTHER_REQUEST, Kind.DUPLICATE, Kind.SHARED_ROW, Kind.OWNED)


class Context(NamedTuple):
    """What a late report (the GPU path's) needs to name the owner."""

    step: int
    table: torch.Tensor  # req_to_token
    rows: torch.Tensor  # req_pool_indices (the real rows)
    rids: Optional[list]


_contexts: "deque[Context]" = deque(maxlen=32)


def check_step(guard: Any, runner: Any, batch: Any, pool: Any) -> tuple[bool, Optional[torch.Tensor]]:
    """(handled, ids for the forward): handled False means the write map is not defined
    here (skipped by name) and the caller probes out_cache_loc the plain way."""
    try:
        given = getattr(batch, "out_cache_loc", None)
        if isinstance(given, torch.Tensor) and not given.numel():  # an idle forward writes nothing
            return True, None
        rule = writemap.rule_of(batch, runner)
        if isinstance(rule, str):
            SKIPPED[rule] = SKIPPED.get(rule, 0) + 1
            if guard.first_time(f"write map skipped: {rule}"):
                logger.warning("sglang_oobguard: write map not checked for %s (bounds%s only)", rule,
                               " and liveness" if guard.config.liveness else "")
            return False, None
        loc = rule.ids
        state = guard.state(pool, loc.device)
        high = int(pool.size) + int(pool.page_size)
        rids = getattr(batch, "rids", None)
        _contexts.append(Context(guard.steps.number, rule.table, rule.rows[:rule.batch], rids))
        if guard.on_host(loc):
            finding, cleaned = writemap.check_host(rule, high, state.live)
            if finding is None:
                return True, None
            call = finding.record(guard.step_site, -1, high, loc.numel(), guard.steps.number)
            guard.report_now(state, call, **_named(finding, rule, rids))
            return True, cleaned  # warn mode: the others raised
        tables = _tables(guard, state, rule, high)
        strict = guard.config.mode is Mode.STRICT and loc.is_cuda
        clean = None if strict else stepkernel.clean_view(tables, loc)
        stepkernel.launch(rule, high, guard.step_site, -1, state.record.tensor, guard.steps.counter(state.device),
                          tables, state.live, clean, guard.message(guard.step_site) if strict else None)
        if loc.is_cuda:
            state.saw_stream(loc.device.index)
        return True, clean
    except KVOutOfBoundsError:
        raise
    except Exception as exc:
        guard.internal_error("write map (step check)", exc)
        return False, None


def _tables(guard: Any, state: Any, rule: writemap.Rule, high: int) -> stepkernel.Tables:
    """The pool's stamp tables and copy buffer: made once (grown once if a later table
    or step is larger: never the case within one server's shapes)."""
    tables = state.__dict__.get(TABLES_ATTR)
    rows, n = rule.table.shape[0], rule.ids.numel()
    if tables is None or tables.slot_stamps.numel() < high or tables.row_stamps.numel() < rows \
            or tables.clean.numel() < n:
        capacity = max(n, high, 0 if tables is None else tables.clean.numel())
        fresh = tables is None
        tables = stepkernel.new_tables(high, rows, capacity, rule.ids.device)
        state.__dict__[TABLES_ATTR] = tables
        if fresh and rule.ids.is_cuda:  # compile every variant now, at the pool's first step, not later in serving
            strict = guard.config.mode is Mode.STRICT
            stepkernel.warm_up(tables, rule.ids.device, high, state.live, state.record.tensor,
                               guard.steps.counter(state.device), guard.message(guard.step_site) if strict else None)
    return tables


def _rid(rids: Optional[list], rows: Any, r: int) -> str:
    if rids is not None and 0 <= r < len(rids):
        return str(rids[r])
    return f"req_to_token row {int(rows[r])}"


def _named(finding: writemap.WriteFinding, rule: writemap.Rule, rids: Optional[list]) -> dict:
    """The report's fields for a host finding: the writer, and for the write-map kinds
    the owner (req_to_token's holder of the slot)."""
    rows = rule.rows[:rule.batch]
    fields: dict[str, Any] = {"request": _rid(rids, rows, finding.row), "token": finding.token,
                              "expected": finding.expected}
    if finding.kind in NAMED_KINDS:
        fields.update(_owner(rule.table, rows, rids, finding.value, finding.owner, finding.row, finding.token))
    return fields


def _owner(table: torch.Tensor, rows: torch.Tensor, rids: Optional[list], slot: int, owner_row: int, row: int,
           token: Optional[int]) -> dict:
    skip = (int(rows[row]), int(token)) if 0 <= row < rows.numel() and token is not None else None
    found = writemap.find_owner(table, rows, rids, slot, prefer=owner_row, skip=skip)
    if found is None:
        return {}
    return {"owner": found[0], "owner_token": found[1]}


def describe(record: Record, where: dict) -> dict:
    """The report's extra fields for a record read back from the device (GPU path)."""
    if record.kind not in NAMED_KINDS and record.expected < 0:
        return {}
    fields: dict[str, Any] = {"expected": record.expected}
    context = next((c for c in reversed(_contexts) if c.step == record.step), None)
    if context is None or record.kind not in NAMED_KINDS:
        return fields
    try:
        if 0 <= record.row < context.rows.numel():
            fields["request"] = _rid(context.rids, context.rows, record.row)
        fields.update(_owner(context.table, context.rows, context.rids, record.value, record.owner, record.row,
                             where.get("token")))
    except Exception:  # a report names what it can
        pass
    return fields
