"""Claims: both requests of a bad free or hand-out, named for a report (the slow path).

A double free, an SWA slot freed twice, a `free_full` whose SWA slot is still mapped
and a live page handed out again each involve two requests: the one that holds (or
held) the slot, found in req_to_token as the owner check finds a writer's owner (an
SWA slot through the full slots that map to it), and the one the free or hand-out is
for, found among the allocator call's callers: sglang passes the request (`req`) down
to its frees and the schedule batch (`batch`, its `reqs` in out_cache_loc's order) to
its allocations. Either may be unknown (a tool that frees behind the scheduler's back
names no request); the report says so. Runs only when a violation is reported.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Optional

import numpy as np
import torch

from ..model.swatargets import MAPPING
from .guard import Guard
from . import owners

SWA_OF_ATTR = "_oobguard_swa_of"  # on an SWA sub-pool: the SWA pool whose mapping translates into it
FRAMES = 24  # callers read for the request a call is for


def full_slots_of(pool: Any, slot: int, page: int, freeing: Optional[tuple[np.ndarray, np.ndarray]] = None) -> list[int]:
    """The full-space ids whose req_to_token entries name the page of `slot`: the page's
    own ids, or, on an SWA sub-pool, the full slots the SWA pool's mapping sends there,
    and those an SWA free in progress (`freeing`: its full ids and their peers as it
    began, `CallState.swa_peers`) found there before sglang cleared their mapping."""
    ids = list(range(slot - slot % page, slot - slot % page + page))
    parent = None if pool is None else pool.__dict__.get(SWA_OF_ATTR)
    mapping = None if parent is None else parent.__dict__.get(MAPPING)
    if not isinstance(mapping, torch.Tensor):
        return ids
    table = mapping.numpy()[:-1]
    found = [int(f) for f in np.flatnonzero(np.isin(table, ids) & (table > 0))]
    if freeing is not None:
        full, peers = freeing
        found += [int(f) for f in full[np.isin(peers, ids) & (peers > 0)] if int(f) not in found]
    return found


def claimant(pos: int = -1, count: int = 0) -> Optional[str]:
    """The request the allocator call in progress is for: the nearest caller's `req`
    (its rid), or, for a hand-out of `count` ids, the schedule batch's request that
    gets id `pos` (extend: each request's extend length in turn; decode: an even share)."""
    frame = sys._getframe(1)
    for _ in range(FRAMES):
        frame = frame.f_back
        if frame is None:
            return None
        local = frame.f_locals
        rid = getattr(local.get("req"), "rid", None)
        if rid is not None:
            return str(rid)
        reqs = getattr(local.get("batch"), "reqs", None)
        if count and pos >= 0 and isinstance(reqs, list) and reqs:
            return _in_batch(local["batch"], reqs, pos, count)
    return None


def _in_batch(batch: Any, reqs: list, pos: int, count: int) -> Optional[str]:
    mode = getattr(batch, "forward_mode", None)
    lens = getattr(batch, "extend_lens", None) if mode is not None and mode.is_extend() else None
    if not lens or sum(lens) != count:
        lens = [count // len(reqs)] * len(reqs) if count % len(reqs) == 0 else None
    if not lens:
        return None
    ends = np.cumsum(lens)
    row = int(np.searchsorted(ends, pos, side="right"))
    return str(reqs[row].rid) if row < len(reqs) else None


def sides(guard: Guard, full_slots: Iterable[int], pos: int = -1, count: int = 0) -> dict[str, Any]:
    """A free's or hand-out's report fields for both requests: `owner` / `owner_token`
    (who holds the slot), `request` (whom the call is for), `claimed` (both looked up)."""
    try:
        found = owners.holder(owners.of_step(guard.steps.find(guard.steps.number)), list(full_slots))
    except Exception:  # a report names what it can
        found = None
    owner, owner_token = found or (None, None)
    return {"owner": owner, "owner_token": owner_token, "request": claimant(pos, count), "claimed": True}
