"""Step map: the step check of out_cache_loc with the write map, host scan or kernel.

`check_step` is what the step check (`stepcheck`) runs for the step's out_cache_loc:
bounds, liveness, the write map (each token's slot is the one sglang's req_to_token
gives it), duplicates, shared rows and, with liveness on, the owner check: the host
check (`hostmap.check_host`) for CPU ids, else the one launch of `stepkernel`. It
returns the ids the step's pool-method writes get (the caller's, or a cleaned copy in
the pool's copy buffer), or None where the map is not defined for this forward
(skipped by name: said once in the log), and the caller checks bounds and liveness
alone. The step check binds a cleaned copy to the batch for the forward
(`stepcheck`), so the writers that take out_cache_loc from the batch get it too.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..model import writemap
from ..model.config import Mode
from ..model.log import logger
from ..model.targets import write_map_off
from ..probes import device, hostmap, stepkernel
from ..probes.pools import RING, STATE_ATTR, PoolState, region
from . import owners, positions
from .guard import Guard

WRITE_MAP_OFF = write_map_off()  # the installed sglang's: read once
TABLES_ATTR = "_oobguard_step_tables"  # on a PoolState: its stepkernel.Tables


def check_step(guard: Guard, runner: Any, batch: Any, pool: Any, high: int,
               draft_step: int = -1) -> Optional[tuple[torch.Tensor, int, Optional[list]]]:
    """(the ids the step's writes get, their copy region or -1, the checked ids as a
    list when they were a few on the host), or None: the map is not defined here.
    With the position check on, the step's positions too (`draft_step`: an EAGLE draft
    decode's, -1 elsewhere)."""
    given = getattr(batch, "out_cache_loc", None)
    if isinstance(given, torch.Tensor) and not given.numel():  # an idle forward writes nothing
        return given, -1, []
    positioned = "positions" in guard.config.checks
    rule = WRITE_MAP_OFF or writemap.rule_of(batch, runner, draft_step, positioned)
    if isinstance(rule, str):
        if guard.first_time(f"write map skipped: {rule}"):
            logger.warning("sglang_oobguard: write map not checked for %s (bounds%s only)", rule,
                           " and liveness" if guard.config.liveness else "")
        return None
    loc = rule.ids
    state = guard.state(pool, loc)
    if guard.on_host(loc):
        finding, cleaned, few = hostmap.check_host(rule, high, state.live, state.table)
        if finding is not None:  # strict and raise: raised here, before any layer
            call = finding.record(guard.step_site, -1, high, loc.numel(), guard.steps.number)
            rows = rule.rows[:rule.batch]
            where = owners.Lookup(rule.table, rows, getattr(batch, "rids", None))
            guard.report_now(state, call, **owners.named(where, finding.kind, finding.row, finding.token, finding.value,
                                                           finding.owner, finding.expected))
        if positioned:  # after the map: a slot it contained is reported as a slot first
            positions.check_host(guard, state, rule, batch, runner)
        return cleaned, -1, few
    strict = guard.config.mode is Mode.STRICT and device.is_gpu(loc)
    where = region(guard.steps.number % RING, 0)
    clean = None if strict else state.copy_for(where, loc)
    stepkernel.launch(rule, high, guard.step_site, -1, state.record.tensor, guard.steps.counter(state.device),
                      _tables(guard, state, rule, high), state.live, clean,
                      guard.message(guard.step_site) if strict else None, positions.POSITION_SITE)
    if rule.expect:  # the kernel checked the positions too
        guard.counts.n[positions.STEPS] += 1
    if device.is_gpu(loc):
        state.order.probed(loc.device)
    guard.launched(state)  # inside the step: its record is read at the next boundary
    if clean is None:
        return loc, -1, None
    state.copied_for[where] = loc
    return clean, where, None


def check_decode(guard: Guard, runner: Any, batch: Any, pool: Any, loc: torch.Tensor, high: int) -> Optional[list]:
    """A plain decode step of a few host ids (`writemap.plain_decode`), checked in the
    fewest steps (`hostmap.check_decode`): the ids as a list when clean; None: check the
    step in full (`check_step`, which finds, reports and contains the same)."""
    state = pool.__dict__.get(STATE_ATTR)
    size = getattr(batch, "batch_size", None)
    plain = None if WRITE_MAP_OFF is not None or state is None or type(size) is not int or size > hostmap.FEW \
        or loc.shape != (size,) else writemap.plain_decode(batch, runner)
    if plain is None:
        return None
    rows, seq_lens, table = plain
    return hostmap.check_decode(loc, rows, seq_lens, table, high, state.live, state.table)


def _tables(guard: Guard, state: PoolState, rule: writemap.Rule, high: int) -> stepkernel.Tables:
    """The pool's stamp tables: made at its first step (sglang's warm-up forward, before
    any capture), with every kernel variant compiled then; remade once only if a later
    req_to_token or bound is larger, which one server's shapes never are."""
    tables = state.__dict__.get(TABLES_ATTR)
    rows = rule.table.shape[0]
    if tables is None or tables.slot_stamps.numel() < high or tables.row_stamps.numel() < rows:
        fresh = tables is None
        if not fresh:
            device.retain(tables)  # a graph may still point into the old ones
        tables = stepkernel.new_tables(high, rows, rule.ids.device)
        state.__dict__[TABLES_ATTR] = tables
        if fresh and device.is_gpu(rule.ids):
            strict = guard.config.mode is Mode.STRICT
            stepkernel.warm_up(tables, rule.ids.device, high, state.live, state.record.tensor,
                               guard.steps.counter(state.device), guard.message(guard.step_site) if strict else None)
    return tables
