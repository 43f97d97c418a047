"""Own ids: a layer's write inside a forward step with ids that are not the step's.

The step check maps the step's out_cache_loc (each token's slot is its own). A
writer that computes ids of its own (not that tensor, nor the step check's cleaned
copy) escapes the map: its ids pass the bound and liveness checks as long as they
name a live slot, even another running request's. So inside a step, on the step's
pool, a single-id write with other ids gets the map's check too. A write of the step's
shape (1-d, one id per token of out_cache_loc) is a per-token write: token i's id must
be token i's own slot, the step's checked id at i (a permutation of the step's slots
writes each token into another's: `Kind.OTHER_REQUEST`, both sides named). Any other
shape: each id must be a slot one of this step's tokens writes (`Kind.NOT_STEP`).
Padding (the padding page, slot 0) is exempt in both. Host path: CPU ids.

The same comparison answers the common case first (`covers`): a write whose ids are
the step's checked ids (same shape: position by position; else all slots of the step)
is covered by that check (bounds, liveness, the map, the owners) and needs no probe of
its own. sglang 0.5.23 copies the step's
out_cache_loc into its runner's buffer before any layer runs, so the layers' ids are
never the object the step check saw.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from ..model.targets import write_map_off, write_map_unmeasured
from ..model.violation import Kind
from ..probes.hostmap import FEW
from ..probes.pools import STATE_ATTR
from ..probes.record import Record
from . import owners
from .guard import Guard
from .unit import Found, Unit


class StepIds(NamedTuple):
    """The step's checked ids on its pool, as the own-ids check compares them."""

    pool: Any
    given: torch.Tensor  # the batch's out_cache_loc
    passed: Optional[torch.Tensor]  # the step check's cleaned copy, when it made one
    values: Optional[np.ndarray]  # the step's slots, sorted (None: see `few`)
    page: int
    clean: dict[int, torch.Tensor]  # id -> the ids tensors found clean this step (every layer writes the same)
    few: Optional[frozenset]  # the slots of a step of a few tokens (decode), as a set
    order: Any  # the step's checked ids in token order: a list (a few) or a numpy array


def remember(guard: Guard, pool: Any, given: torch.Tensor, passed: Optional[torch.Tensor],
             checked: Optional[list] = None) -> None:
    """The step's ids (host ones only; None clears it: no check this step). `checked`:
    the ids as the step check read them on the host (a list), when it read a few."""
    calls = guard.calls
    if checked is not None and passed is None:  # the common step: its few ids, as read
        calls.step_ids = StepIds(pool, given, None, None, int(pool.page_size), {}, frozenset(checked), checked)
        return
    calls.step_ids = None
    if given.is_cpu and guard.on_host(given):
        kept = given if passed is None else passed  # contained ids (sent to slot 0) are no step's slots
        listed = kept.tolist() if kept.numel() <= FEW and kept.dim() == 1 else None
        few = None if listed is None else frozenset(listed)
        order = listed if listed is not None else kept.reshape(-1).numpy()
        values = np.unique(order) if few is None else None
        calls.step_ids = StepIds(pool, given, passed, values, int(pool.page_size), {}, few, order)


def covers(guard: Guard, pool: Any, loc: torch.Tensor) -> bool:
    """Whether `loc` writes only what the step check passed, or the padding page: each
    token its own slot (the step's shape), else slots of the step. That check then holds
    for this write too."""
    step = guard.calls.step_ids
    if step is None or step.pool is not pool or not loc.is_cpu:
        return False
    few, page, order = step.few, step.page, step.order
    shape = loc.shape
    if few is not None and len(shape) == 1 and shape[0] <= FEW:
        vals = loc.tolist()
        if len(vals) == len(order):  # a token's write: its own slot (one list compare when clean)
            return vals == order or all(v == o or 0 <= v < page for v, o in zip(vals, order))
        return few.issuperset(vals) or all(v in few or 0 <= v < page for v in vals)
    ids = loc.reshape(-1).numpy()
    return bool((((ids >= 0) & (ids < page)) | _mine(step, loc, ids)).all())


def _mine(step: StepIds, loc: torch.Tensor, ids: np.ndarray) -> np.ndarray:
    """Which of `ids` the step check passed for their place: in the step's shape, the
    token's own slot; else any slot of the step."""
    if loc.dim() == 1 and ids.size == len(step.order):
        return ids == np.asarray(step.order)
    return _in_step(step, ids)


def _in_step(step: StepIds, ids: np.ndarray) -> np.ndarray:
    """Which of `ids` are the step's slots."""
    values = step.values if step.values is not None else np.array(sorted(step.few), dtype=np.int64)
    pos = np.searchsorted(values, ids).clip(0, max(values.size - 1, 0))
    return (values.size > 0) & (values.take(pos) == ids)


def check(guard: Guard, pool: Any, site: int, loc: torch.Tensor, high: int, layer: Callable[[], int]) -> None:
    """Report the first id of `loc` that is not its token's own slot (the step's shape)
    or that no token of the step writes (other shapes); raises unless warn."""
    step = guard.calls.step_ids
    if step is None or step.pool is not pool or loc is step.given or loc is step.passed or not loc.is_cpu:
        return
    if step.clean.get(id(loc)) is loc:
        return
    guard.counts.add("ownids", "writes")
    ids = loc.reshape(-1).numpy()
    per_token = loc.dim() == 1 and ids.size == len(step.order)
    bad = (ids >= step.page) & (ids < high) & ~_mine(step, loc, ids)
    if not bad.any():
        step.clean[id(loc)] = loc
        return
    first = int(np.argmax(bad))
    value = int(ids[first])
    state = pool.__dict__[STATE_ATTR]
    count = int(bad.sum())
    if per_token:  # the token and the owner are named from the step's layout (`Steps.where`)
        record = Record.ownership(site=site, layer=layer(), high=high, numel=ids.size, bad=count, pos=first,
                                  value=value, step=guard.steps.number, kind=Kind.OTHER_REQUEST,
                                  expected=int(step.order[first]))
        guard.report_now(state, record)
        return
    record = Record.ownership(site=site, layer=layer(), high=high, numel=ids.size, bad=count, pos=first, value=value,
                              step=guard.steps.number, kind=Kind.NOT_STEP)
    where: dict[str, Any] = {}
    found = owners.holder(owners.of_step(guard.steps.find(guard.steps.number)), value)
    if found is not None:
        where["owner"], where["owner_token"] = found
    guard.report_now(state, record, **where)


def doctor(found: Found) -> list[str]:
    return ["a layer's write with ids of its own (not the step's out_cache_loc): one id per token, each its token's "
            "own slot; another shape, each id a slot of the step's tokens (CPU ids)",
            *(f"not checked: {name} ({why}: the write map skips them)" for name, why in write_map_unmeasured())]


UNIT = Unit("ownids", "a layer's write with ids of its own writes only its own tokens' slots",
            "per such write: O(ids), on the host", ("writes",), "pool writes whose ids are not the step's",
            where=write_map_off, doctor=doctor)
