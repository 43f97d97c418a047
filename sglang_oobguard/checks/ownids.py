"""Own ids: a layer's write inside a forward step with ids that are not the step's.

The step check maps the step's out_cache_loc (each token's slot is its own). A
writer that computes ids of its own (not that tensor, nor the step check's cleaned
copy) escapes the map: its ids pass the bound and liveness checks as long as they
name a live slot, even another running request's. So inside a step, on the step's
pool, a single-id write with other ids gets the map's check too: each id must be a
slot one of this step's tokens writes (padding slot 0 exempt). Host path: CPU ids.

The same comparison answers the common case first (`covers`): a write whose ids are
all slots the step check passed is covered by that check (bounds, liveness, the map,
the owners) and needs no probe of its own. sglang 0.5.23 copies the step's
out_cache_loc into its runner's buffer before any layer runs, so the layers' ids are
never the object the step check saw.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from ..model.violation import Kind
from ..probes.hostmap import FEW
from ..probes.pools import STATE_ATTR
from ..probes.record import Record
from . import owners
from .guard import Guard


class StepIds(NamedTuple):
    """The step's checked ids on its pool, as the own-ids check compares them."""

    pool: Any
    given: torch.Tensor  # the batch's out_cache_loc
    passed: Optional[torch.Tensor]  # the step check's cleaned copy, when it made one
    values: Optional[np.ndarray]  # the step's slots, sorted (None: see `few`)
    page: int
    clean: dict[int, torch.Tensor]  # id -> the ids tensors found clean this step (every layer writes the same)
    few: Optional[frozenset]  # the slots of a step of a few tokens (decode), as a set


def remember(guard: Guard, pool: Any, given: torch.Tensor, passed: Optional[torch.Tensor],
             checked: Optional[list] = None) -> None:
    """The step's ids (host ones only; None clears it: no check this step). `checked`:
    the ids as the step check read them on the host (a list), when it read a few."""
    calls = guard.calls
    if checked is not None and passed is None:  # the common step: its few ids, as read
        calls.step_ids = StepIds(pool, given, None, None, int(pool.page_size), {}, frozenset(checked))
        return
    calls.step_ids = None
    if given.is_cpu and guard.on_host(given):
        kept = given if passed is None else passed  # contained ids (sent to slot 0) are no step's slots
        few = frozenset(kept.tolist()) if kept.numel() <= FEW and kept.dim() == 1 else None
        values = np.unique(kept.numpy()) if few is None else None
        calls.step_ids = StepIds(pool, given, passed, values, int(pool.page_size), {}, few)


def covers(guard: Guard, pool: Any, loc: torch.Tensor) -> bool:
    """Whether every id of `loc` is a slot the step check passed, or in the padding
    page: that check then holds for this write too."""
    step = guard.calls.step_ids
    if step is None or step.pool is not pool or not loc.is_cpu:
        return False
    few, page = step.few, step.page
    if few is not None:
        shape = loc.shape
        if len(shape) == 1 and shape[0] <= FEW:
            vals = loc.tolist()
            return few.issuperset(vals) or all(v in few or 0 <= v < page for v in vals)
    ids = loc.reshape(-1).numpy()
    return bool((((ids >= 0) & (ids < page)) | _in_step(step, ids)).all())


def _in_step(step: StepIds, ids: np.ndarray) -> np.ndarray:
    """Which of `ids` are the step's slots."""
    values = step.values if step.values is not None else np.array(sorted(step.few), dtype=np.int64)
    pos = np.searchsorted(values, ids).clip(0, max(values.size - 1, 0))
    return (values.size > 0) & (values.take(pos) == ids)


def check(guard: Guard, pool: Any, site: int, loc: torch.Tensor, high: int, layer: Callable[[], int]) -> None:
    """Report the first id of `loc` that no token of the step writes (raises unless warn)."""
    step = guard.calls.step_ids
    if step is None or step.pool is not pool or loc is step.given or loc is step.passed or not loc.is_cpu:
        return
    if step.clean.get(id(loc)) is loc:
        return
    guard.counts.add("ownids", "writes")
    ids = loc.reshape(-1).numpy()
    bad = (ids >= step.page) & (ids < high) & ~_in_step(step, ids)
    if not bad.any():
        step.clean[id(loc)] = loc
        return
    first = int(np.argmax(bad))
    value = int(ids[first])
    state = pool.__dict__[STATE_ATTR]
    record = Record(int(bad.sum()), 1, site, layer(), high, int(bad.sum()), ids.size, first, value,
                    guard.steps.number, int(Kind.NOT_STEP))
    where: dict[str, Any] = {}
    seen = guard.steps.find(guard.steps.number)
    if seen is not None and seen.pool_indices is not None:
        found = owners.find_owner(seen.runner.req_to_token_pool.req_to_token, seen.pool_indices[:seen.batch_size],
                                  seen.rids, value)
        if found is not None:
            where["owner"], where["owner_token"] = found
    guard.report_now(state, record, **where)
