"""SWA: the sliding-window pools' two id spaces, named and checked (the SWA allocator family's adapter).

`SWAKVPool` holds a full sub-pool and an SWA sub-pool; `SWATokenToKVPoolAllocator`
hands out a full slot and an SWA slot together, keeps the full -> SWA mapping, and
drives two sub-allocators of the tracked kinds, whose shadows (`liveness`) are the
two id spaces' shadows. What the parts cannot see, this adapter adds:

- names: the sub-pools' reports name the SWA pool and the id space, e.g.
  "SWAKVPool.swa_kv_pool (SWA ids)", when an allocator registers its mapping;
- the SWA allocator's frees, checked in the full id space before anything is taken
  back: every full id live (a double free, also within one call, names the full ids,
  not the padding slot 0 their cleared mapping reads as); where upstream requires the
  SWA peer mapped (`swa.peer_mapped`: page 1, and each page of a segment), the peer
  mapped, so padding slot 0 never reaches the SWA free list; and for `free_full`, the
  peer released (`swa.peer_released`), else the SWA slot leaks.

Host ids only (CPU tensors, the torch backend): on a GPU these reads would sync the
scheduler, so there the sub-allocators' own checks stand alone (doctor says so).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..model.discover import AllocatorMethod, by_design
from ..model.swatargets import (FULL_SUBPOOL, MAPPING, PEERS_READ_SINCE, SWA_CHECKED, SWA_METHODS, SWA_POOL_HOOK,
                                SWA_SUBPOOL, SwaMethod, SwaRole, space_name)
from ..model.targets import release_of, version_of_sglang
from ..model.violation import Kind, free_site_id
from ..probes import hostscan
from ..probes.pools import NAME_ATTR, SITES_ATTR, STATE_ATTR
from ..probes.record import Record
from ..probes.shadow import Live
from .claims import SWA_OF_ATTR, full_slots_of, sides
from .guard import Guard
from .liveness import Call, checked, counted
from . import owners
from .calls import argument, replaced
from .unit import Unit, Wrap

FAMILY = "swa"  # the free family an outer SWA free marks, so its inner halves are not checked again


def name_spaces(guard: Guard, pool: Any) -> None:
    """Name the SWA pool and its sub-pools by id space, in their states and for any
    state made later."""
    cls = type(pool).__name__
    parts = [(pool, None)] + [(pool.__dict__.get(sub), sub) for sub in (FULL_SUBPOOL, SWA_SUBPOOL)]
    for part, sub in parts:
        if part is None or "device" not in part.__dict__:
            continue
        name = space_name(cls, sub)
        guard.mark(part, NAME_ATTR, name)
        state = part.__dict__.get(STATE_ATTR)
        if state is not None:
            state.pool_name = name
        if sub == SWA_SUBPOOL:
            guard.mark(part, SWA_OF_ATTR, pool)  # its hand-out reports find the holder through the mapping


def make_mapping_hook(guard: Guard) -> Callable[..., Any]:
    """Wrapper for an SWA pool's `register_mapping` (every SWA allocator's constructor calls it)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        try:
            name_spaces(guard, instance)
        except Exception as exc:
            guard.internal_error(f"{type(instance).__name__}.register_mapping", exc)
        return result

    return wrapper


def make_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper of one SWA allocator free method (exact types of SWA_CHECKED)."""
    spec = SWA_METHODS[target.method]

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if type(instance).__name__ not in SWA_CHECKED or instance.__dict__.get("_swa_req_ring") or \
                "swa" not in guard.config.checks:
            return wrapped(*args, **kwargs)  # a per-request SWA ring: no paged SWA peers; or the check off
        calls = guard.calls
        outer = calls.freeing
        if outer is not None and outer[0] is instance and outer[1] == FAMILY:
            return wrapped(*args, **kwargs)  # free's own free_swa / free_full: checked with it
        call = Call(wrapped, args, kwargs, target.method)
        ids = call.ids
        if not (isinstance(ids, torch.Tensor) and ids.numel() and guard.on_host(ids)):
            return counted(guard, instance, FAMILY, call)
        contained = checked(guard, lambda: check_free(guard, instance, target.method, spec, ids))
        if contained is not None:
            call.ids = contained
        outer, calls.swa_peers = calls.swa_peers, _peers(instance, call.ids)
        try:  # its sub-allocators' reports (liveness) find the full slots of an SWA page here
            return counted(guard, instance, FAMILY, call)
        finally:
            calls.swa_peers = outer

    return wrapper


def _peers(allocator: Any, ids: torch.Tensor) -> Optional[tuple[np.ndarray, np.ndarray]]:
    """(full ids, their SWA peers) as a free begins (host ids), for `claims.full_slots_of`."""
    mapping = allocator.__dict__.get(MAPPING)
    if not isinstance(mapping, torch.Tensor) or not mapping.numel() or not mapping.is_cpu:
        return None
    full = ids.reshape(-1).numpy().astype(np.int64)
    table = mapping.numpy()
    return full, table[np.clip(full, 0, table.size - 1)]



_RELEASE = release_of(version_of_sglang())
PEERS_READ = _RELEASE is None or _RELEASE >= PEERS_READ_SINCE  # an unknown sglang: the newest rules

def _all_good(ids: np.ndarray, live: Live, mapping: np.ndarray, page: int, spec: SwaMethod) -> bool:
    """The fast answer for a clean free, in numpy over the shadow's and the mapping's memory:
    True when no id can be bad; False means "check it in full"."""
    if live.host is None or not ids.size:
        return False
    looked = hostscan.look_up(ids, live)
    if not (looked.live if spec.full else looked.inside).all():  # the full ids go back too: live
        return False
    if spec.full and live.page == 1 and np.unique(ids).size != ids.size:
        return False
    peers = mapping[ids]
    if spec.role is SwaRole.FREE_FULL:
        return not peers.any()
    if spec.role is SwaRole.FREE_SEGMENT:
        return bool((peers[::page] > 0).all())
    return page > 1 or not PEERS_READ or bool((peers > 0).all())


def check_free(guard: Guard, allocator: Any, method: str, spec: SwaMethod, ids: torch.Tensor) -> Optional[torch.Tensor]:
    """Check one SWA free in the full id space; report its first bad id. Returns the
    good ids (warn mode's containment) when some were bad, else None: a segment keeps
    its whole good pages (upstream reads a segment's pages at [::page_size] from its
    page-aligned start), a set its good ids."""
    pool = allocator.__dict__.get("_kvcache")
    full = None if pool is None else pool.__dict__.get(FULL_SUBPOOL)
    state = None if full is None else full.__dict__.get(STATE_ATTR)
    live = None if state is None else state.live
    if live is None:  # the full sub-allocator is not tracked: nothing to check against
        return None
    guard.counts.add("swa", "frees")
    flat = ids.reshape(-1)
    mapping: torch.Tensor = allocator.__dict__[MAPPING]
    page = int(allocator.page_size)
    if _all_good(flat.numpy(), live, mapping.numpy(), page, spec):
        return None
    wide = flat.to(torch.int64)
    # free_swa(_segment) may follow the full slots' own free (the radix cache frees a node's full
    # component first, through the full sub-allocator): only its SWA peers must still be mapped
    bad = hostscan.bad_free(wide, live.high, live) if spec.full else (wide < 0) | (wide >= live.high)
    peers = mapping[wide.clamp(0, mapping.numel() - 2)]
    if spec.role is SwaRole.FREE_FULL:
        peer_bad = ~bad & (peers != 0)
    elif spec.role is SwaRole.FREE_SEGMENT or page == 1 and PEERS_READ:  # where upstream's free reads every peer
        heads = torch.arange(wide.numel()) % page == 0 if spec.role is SwaRole.FREE_SEGMENT else True
        peer_bad = ~bad & (peers <= 0) & heads
    else:
        peer_bad = torch.zeros_like(bad)
    either = bad | peer_bad
    if not bool(either.any()):
        return None
    pos = int(either.to(torch.uint8).argmax())
    value = int(wide[pos])
    kind = Kind.PEER_MAPPED if spec.role is SwaRole.FREE_FULL else Kind.UNMAPPED
    if bad[pos]:
        kind = Kind.DOUBLE_FREE if 0 <= value < live.high else Kind.BOUNDS
    count = int(either.sum())
    site = free_site_id(f"{method} ({type(allocator).__name__})", "free_index")
    record = Record.bad_ids(site=site, high=live.high, numel=flat.numel(), bad=count, pos=pos, value=value,
                            step=guard.steps.number, kind=kind,
                            expected=int(peers[pos]) if kind is Kind.PEER_MAPPED else -1)
    guard.report_now(state, record, **sides(guard, full_slots_of(None, value, page) if value >= 0 else []))
    if spec.segment:
        chunks = torch.arange(flat.numel()) // page  # a page with a bad id stays out whole
        either = torch.zeros(int(chunks[-1]) + 1, dtype=torch.bool).index_put_((chunks,), either, accumulate=True)
        either = either[chunks]
    return flat[~either]


# -- the door: an SWA layer's SWA ids against the step's own full slots ---------------

DOOR_ATTR = "_oobguard_swa_door"  # on an SWA pool: the DoorSite its door's reports are kept on
SEEN_ATTR = "_oobguard_swa_seen"  # on an SWA pool: (step, ids objects) its door found clean in this step


class DoorSite:
    """The record of an SWA pool's door check, apart from the SWA sub-pool's own (whose
    first violation, e.g. a live slot handed out again, stays reported on its own)."""

    page_size = 0

    def __init__(self, pool: Any, site: int) -> None:
        sub = pool.__dict__[SWA_SUBPOOL]
        self.size = int(sub.size) + int(sub.page_size)
        self.__dict__[NAME_ATTR] = f"{space_name(type(pool).__name__, SWA_SUBPOOL)} at {type(pool).__name__}'s door"
        self.__dict__[SITES_ATTR] = {site: False}


def check_door(guard: Guard, pool: Any, site: int, args: tuple, kwargs: dict, position: int, name: str,
               layer_id: int) -> tuple[tuple, dict]:
    """An SWA layer's write at SWAKVPool's door: each token's SWA slot must be the
    translation of its own full slot (`full_to_swa_index_mapping`), and no two tokens
    of the write may share one. Reports both requests; warn mode sends the bad SWA ids
    to padding slot 0 in a private copy. Host ids only; returns the call's arguments."""
    value = argument(args, kwargs, position, name)
    loc, swa_loc = getattr(value, "loc", None), getattr(value, "swa_loc", None)
    mapping = pool.__dict__.get(MAPPING)
    layers = pool.__dict__.get("layers_mapping") or {}
    if not (isinstance(loc, torch.Tensor) and isinstance(swa_loc, torch.Tensor) and isinstance(mapping, torch.Tensor)
            and layers.get(layer_id, (0, False))[1] and guard.on_host(swa_loc) and loc.numel() == swa_loc.numel()):
        return args, kwargs  # the device path ends here: what follows reads the ids on the host
    return _check_door_host(guard, pool, site, args, kwargs, position, name, layer_id, value, mapping)


def _check_door_host(guard: Guard, pool: Any, site: int, args: tuple, kwargs: dict, position: int, name: str,
                     layer_id: int, value: Any, mapping: torch.Tensor) -> tuple[tuple, dict]:
    """`check_door` on host ids (numpy over the ids and the mapping's memory)."""
    loc, swa_loc = value.loc, value.swa_loc
    seen = (guard.steps.number, id(loc), id(swa_loc))  # a step's SWA layers share its ids: checked once
    if guard.calls.depth and pool.__dict__.get(SEEN_ATTR) == seen:
        return args, kwargs
    guard.counts.add("swa", "writes")
    full, ids, table = loc.reshape(-1).numpy(), swa_loc.reshape(-1).numpy(), mapping.numpy()
    inside = (full >= 0) & (full < table.size - 1)
    expected = np.where(inside, table[np.clip(full, 0, table.size - 2)], ids)
    wrong = ids != expected
    mapped = ids[ids > 0]  # padding slot 0: every unmapped token's row
    if not wrong.any() and np.unique(mapped).size == mapped.size:
        if guard.calls.depth and SEEN_ATTR in pool.__dict__:
            pool.__dict__[SEEN_ATTR] = seen
        elif guard.calls.depth:
            guard.mark(pool, SEEN_ATTR, seen)  # once: uninstall takes it off
        return args, kwargs
    repeated = np.ones(ids.size, dtype=bool)
    repeated[np.unique(ids, return_index=True)[1]] = False
    repeated &= ids > 0
    sub = pool.__dict__[SWA_SUBPOOL]
    bad = (wrong | repeated) & (ids >= 0) & (ids < int(sub.size) + int(sub.page_size))  # outside: the sub-pool's report
    if not bad.any():
        return args, kwargs
    pos = int(bad.argmax())
    door = pool.__dict__.get(DOOR_ATTR)
    if door is None:
        door = DoorSite(pool, site)
        guard.mark(pool, DOOR_ATTR, door)
    state = guard.state(door, torch.device(sub.device))
    slot = int(ids[pos])
    kind = Kind.SWA_OTHER if wrong[pos] else Kind.DUPLICATE
    count = int(bad.sum())
    record = Record.ownership(site=site, layer=layer_id, high=int(sub.size) + int(sub.page_size), numel=ids.size,
                              bad=count, pos=pos, value=slot, step=guard.steps.number, kind=kind,
                              expected=int(expected[pos]))
    guard.report_now(state, record, **_owner(guard, record, full, ids, table, pos))
    clean = torch.from_numpy(np.where(bad, 0, ids)).view(swa_loc.shape).to(swa_loc.dtype)
    return replaced(args, kwargs, position, name, len(args) > position, dataclasses.replace(value, swa_loc=clean))


def _owner(guard: Guard, record: Record, full: np.ndarray, ids: np.ndarray, table: np.ndarray,
           pos: int) -> dict[str, Any]:
    """The other side of a bad SWA id: the token of this write that holds the slot, else
    the request whose full slot maps to it (req_to_token), for the report (slow path)."""
    plain = record._replace(kind=Kind.BOUNDS)  # the step's fields of a position, without the full-slot lookup
    earlier = np.flatnonzero(ids[:pos] == ids[pos])
    if earlier.size:
        other = guard.steps.where(plain._replace(pos=int(earlier[0])))
        return {"owner": other.get("request"), "owner_token": other.get("token")}
    seen = guard.steps.find(record.step) if record.step >= 0 else None
    peers = [int(f) for f in np.flatnonzero(table[:-1] == ids[pos]) if f != full[pos]]
    found = owners.holder(owners.of_step(seen), peers[0]) if peers else None
    return {"owner": found[0] if found else None, "owner_token": found[1] if found else None}


def hook_pools(classes: list[type], guard: Guard, wrap: Wrap) -> None:
    """Name the SWA pools' id spaces as their allocators register the mapping (every pool
    class that defines the hook, as it is defined)."""
    for cls in classes:
        hook = cls.__dict__.get(SWA_POOL_HOOK)
        if hook is not None and not by_design(getattr(hook, "__wrapped__", hook)):
            wrap(cls, SWA_POOL_HOOK, make_mapping_hook(guard))


def allocator_wrapper(target: AllocatorMethod, guard: Guard) -> Optional[Callable[..., Any]]:
    """The SWA allocator family's adapter (the other families: liveness's)."""
    return make_wrapper(target, guard) if isinstance(target.role, SwaRole) else None


UNIT = Unit("swa", "sliding-window pools: frees in both id spaces, each token's SWA slot",
            "per SWA free and per door write: O(ids)", ("frees", "writes"),
            "the SWA pools' mapping hook and doors; the SWA allocators' methods (with liveness)",
            feature="sliding-window models", pool_hook=hook_pools, allocators=allocator_wrapper)
