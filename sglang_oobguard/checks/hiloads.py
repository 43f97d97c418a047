"""HiCache loads: the device slots of a host -> device load, checked against the request that holds them.

`hicache` probes each load's device ids for the bound and the shadow: a load into a live
slot of another running request passes there (the slot is handed out). What a load is for
is known above the host pool: `HiCacheController.start_loading` runs the queued load-backs
(each into a tree node's fresh slots, from the controller's `load`; the radix cache's
`load_back` names the request that asked), and `restore_kv_cache` loads a retracted
request's KV back into its own req_to_token row (`transfertargets.HICACHE_LOAD_HOOKS`).
So, with liveness and the shadow on the host, each load's device ids are looked up in
the owner table (`shadow.Live.owner`: the req_to_token row that wrote the slot since it
was last handed out). A load-back's fresh slot has no owner yet; a restored slot is its
own row's (or a prefix it shares, which its row holds too). Any other owner is a running
request whose KV the load would overwrite: reported with the slot, what the load is for,
the holder (rid and position) and the slot's history; contained in warn mode (those ids to
padding slot 0). A slot freed under its request and handed to a load has no owner any
more: the read check names its reader at the next step. On a GPU the owner table is
device memory: not read here (no host sync).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..model.violation import Kind
from ..probes.pools import STATE_ATTR
from ..probes.record import Record
from . import owners
from .guard import Guard

# What each HICACHE_LOAD_HOOKS method tells the check (doctor's words).
LOAD_ROLES = {"loads": "the load-backs it starts: each into a tree node's fresh slots (no owner yet)",
              "asked": "the request that asked for a tree node's load-back (named in a report)",
              "restore": "a retracted request's restore: into its own req_to_token row"}


@dataclasses.dataclass(eq=False)
class Loading:
    """What the loads now running are for: a restore's request and row, or the load-backs."""

    rid: Optional[str] = None  # restore: the request
    row: int = -1  # restore: its own req_to_token row
    table: Any = None  # restore: sglang's req_to_token (the row's slots pass)
    ops: list = dataclasses.field(default_factory=list)  # load-backs: sglang's CacheOperations, in queue order
    asked: dict = dataclasses.field(default_factory=dict)  # load-backs: tree node -> the request that asked
    done: list = dataclasses.field(default_factory=list)  # (device ids checked, the ids the load got): per layer once


class Loads:
    """The guard's view of the HiCache loads in progress."""

    def __init__(self) -> None:
        self.now: Optional[Loading] = None
        self.asked: dict[int, Optional[str]] = {}  # tree node -> rid, from load_back until its load starts


def _rid(req: Any) -> Optional[str]:
    rid = getattr(req, "rid", None)
    return None if rid is None else str(rid)


def _loading(book: Loads, kind: str, instance: Any, args: tuple, kwargs: dict) -> Optional[Loading]:
    """What the loads inside this call are for (None: a load_back, which only names its asker)."""
    if kind == "asked":
        node = args[0] if args else kwargs.get("node_id")
        book.asked[int(node)] = _rid(kwargs.get("req", args[2] if len(args) > 2 else None))
        return None
    if kind == "restore":
        req = args[0] if args else kwargs["req"]
        row = getattr(getattr(req, "kv", req), "req_pool_idx", None)
        return Loading(_rid(req), -1 if row is None else int(row), instance.req_to_token_pool.req_to_token)
    loading = Loading(ops=list(getattr(instance, "load_queue", ())), asked=book.asked)  # the queued load-backs start
    book.asked = {}
    return loading


def make_hook(kind: str, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper of one HICACHE_LOAD_HOOKS method: it says what the loads inside
    it are for; its own work never raises into sglang."""
    book: Loads = guard.held["hicache"]

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if not on(guard.config.checks):
            return wrapped(*args, **kwargs)
        try:
            loading = _loading(book, kind, instance, args, kwargs)
        except Exception as exc:
            guard.internal_error(f"HiCache {kind}", exc)
            loading = None
        if loading is None:
            return wrapped(*args, **kwargs)
        outer, book.now = book.now, loading
        try:
            return wrapped(*args, **kwargs)
        finally:
            book.now = outer

    return wrapper


def on(checks: frozenset) -> bool:
    """Whether the loads are looked up in the owner table: HiCache's check on, with owners."""
    return "hicache" in checks and "owners" in checks


def check(guard: Guard, device_pool: Any, site: int, host_ids: Any, ids: torch.Tensor, layer: int) -> torch.Tensor:
    """The device ids of one load call against the slots' owners; returns the ids the
    load gets (warn mode: another request's slots sent to padding slot 0)."""
    now: Optional[Loading] = guard.held["hicache"].now
    state = device_pool.__dict__.get(STATE_ATTR)
    live = None if state is None else state.live
    if now is None or live is None or live.owner is None or live.owner.is_cuda or ids.is_cuda:
        return ids
    for seen, passed in now.done:  # every layer's call gets the same ids: checked at the first
        if seen is ids:
            return passed
    try:
        flat = ids.reshape(-1).to(torch.int64).numpy()
        owner = owners.owner_rows(live, flat)  # page 0 is padding; outside: the bound's report
        bad = (owner >= 0) & (owner != now.row)
        if bad.any() and now.row >= 0:  # a prefix the restored row shares: its own slot too
            bad &= ~np.isin(flat, now.table[now.row].numpy())
    except Exception as exc:
        guard.internal_error("HiCache load owners", exc)
        return ids
    passed = ids
    if bad.any():
        pos = int(np.argmax(bad))
        try:
            where = _named(guard, now, host_ids, pos, int(flat[pos]), int(owner[pos]))
        except Exception as exc:  # a report names what it can
            guard.internal_error("HiCache load naming", exc)
            where = {}
        count = int(bad.sum())
        record = Record.ownership(site=site, layer=layer, high=live.high, numel=flat.size, bad=count, pos=pos,
                                  value=int(flat[pos]), step=guard.steps.number, kind=Kind.HELD,
                                  owner=int(owner[pos]))
        guard.report_now(state, record, **where)
        passed = ids.clone()
        passed.view(-1)[torch.from_numpy(bad)] = 0
    now.done.append((ids, passed))
    return passed


def _named(guard: Guard, now: Loading, host_ids: Any, pos: int, slot: int, row: int) -> dict[str, Any]:
    """The report's fields: what the load is for (request, tree node) and who holds the slot."""
    fields: dict[str, Any] = {"request": now.rid}
    if now.row < 0 and isinstance(host_ids, torch.Tensor) and not host_ids.is_cuda:
        host = int(host_ids.reshape(-1)[pos])
        for op in now.ops:
            if bool((op.host_indices == host).any()):
                node = op.node_ids[0] if op.node_ids else -1
                fields.update(node=int(node), request=now.asked.get(node))
                break
    fields["owner"], fields["owner_token"] = owners.held_by_row(guard.steps.recent(), row, slot, now.table)
    return fields
