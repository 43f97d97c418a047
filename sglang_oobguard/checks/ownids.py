"""Own ids: a layer's write inside a forward step with ids that are not the step's.

The step check maps the step's out_cache_loc (each token's slot is its own). A
writer that computes ids of its own (not that tensor, nor the step check's cleaned
copy) escapes the map: its ids pass the bound and liveness checks as long as they
name a live slot, even another running request's. So inside a step, on the step's
pool, a single-id write with other ids gets the map's check too: each id must be a
slot one of this step's tokens writes (padding slot 0 exempt). Host path: CPU ids.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from ..model.violation import Kind
from ..probes.pools import STATE_ATTR
from ..probes.record import Record
from . import owners
from .guard import Guard


class StepIds(NamedTuple):
    """The step's checked ids on its pool, as the own-ids check compares them."""

    pool: Any
    given: torch.Tensor  # the batch's out_cache_loc
    passed: Optional[torch.Tensor]  # the step check's cleaned copy, when it made one
    values: np.ndarray  # the step's slots, sorted
    page: int
    clean: dict[int, torch.Tensor]  # id -> the ids tensors found clean this step (every layer writes the same)


def remember(guard: Guard, pool: Any, given: torch.Tensor, passed: Optional[torch.Tensor]) -> None:
    """The step's ids (host ones only; None clears it: no check this step)."""
    guard.calls.step_ids = None
    if given.device.type == "cpu" and guard.on_host(given):
        kept = given if passed is None else passed  # contained ids (sent to slot 0) are no step's slots
        guard.calls.step_ids = StepIds(pool, given, passed, np.unique(kept.numpy()), int(pool.page_size), {})


def check(guard: Guard, pool: Any, site: int, loc: torch.Tensor, high: int, layer: Callable[[], int]) -> None:
    """Report the first id of `loc` that no token of the step writes (raises unless warn)."""
    step = guard.calls.step_ids
    if step is None or step.pool is not pool or loc is step.given or loc is step.passed or loc.device.type != "cpu":
        return
    if step.clean.get(id(loc)) is loc:
        return
    ids = loc.reshape(-1).numpy()
    pos = np.searchsorted(step.values, ids).clip(0, max(step.values.size - 1, 0))
    bad = (ids >= step.page) & (ids < high) & ((step.values.size == 0) | (step.values.take(pos) != ids))
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
