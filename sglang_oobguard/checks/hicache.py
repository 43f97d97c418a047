"""HiCache: the device slots of every host -> device load and device -> host backup, checked.

HiCache (`enable_hierarchical_cache`) copies KV between the device pool and a host pool
with its own transfer ops: a load writes device slots and a backup reads them, and
neither goes through a pool method or `out_cache_loc`. Both take the device slot ids
(`device_indices`) from the cache controller: fresh slots for a load-back, the tree
node's or the request's own for a retraction restore and a backup. So each call of
the host pools' `load_to_device_per_layer` and `backup_from_device_all_layer`
(`transfertargets.HICACHE_POOLS`) is probed like a write of the device pool: the bound
(`POOL_IDS`) and, with liveness, the shadow (a load into a slot the allocator has
taken back); on a GPU by the kernel, without a host sync, and contained in warn and
raise mode (bad ids go to padding slot 0). Which request or node holds a slot is not
known at this level: `hiloads` checks a load's live slots against their owners.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable, Optional

import torch

from ..model.discover import base_class
from ..model.targets import POOL_IDS, write_map_off
from ..model.transfertargets import HICACHE_LOAD_HOOKS, HICACHE_METHODS, HICACHE_POOLS, HICACHE_SINCE
from ..model.violation import site_id
from . import hiloads
from .guard import Guard
from .unit import Found, Unit, Wrap, defines
from .writes import argument, check_write, replaced

DEVICE_IDS = (2, "device_indices")  # position after self, and name, in both methods


def label(method: str, what: str) -> str:
    return f"{method} (HiCache {what}) device_indices"


def make_wrapper(method: str, what: str, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper of one host pool method: probe its device ids, pass on what the probe passed."""
    site = site_id(label(method, what))
    found = base_class()
    pools = found if isinstance(found, type) else ()
    guard.name_site(site, POOL_IDS.rule, in_steps=False)  # the cache controller's copies: no step's request to name

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        device_pool = argument(args, kwargs, 0, "device_pool")
        ids = argument(args, kwargs, *DEVICE_IDS)
        if not isinstance(ids, torch.Tensor) or not isinstance(device_pool, pools):
            return wrapped(*args, **kwargs)  # a device pool that is no KVCache keeps ids of its own
        layer = argument(args, kwargs, 3, "layer_id", -1) if method.startswith("load") else -1
        checks = guard.config.checks
        if "hicache" in checks:  # off: its ids still get the bound check (bounds is never off)
            guard.counts.add("hicache", "loads" if method.startswith("load") else "writes")
        passed = check_write(guard, device_pool, site, 0, ids, POOL_IDS.high(device_pool),
                             lambda: int(layer) if isinstance(layer, int) else -1)
        if method.startswith("load") and hiloads.on(checks):
            passed = hiloads.check(guard, device_pool, site, argument(args, kwargs, 1, "host_indices"), passed,
                                   int(layer) if isinstance(layer, int) else -1)
        if passed is not ids:
            args, kwargs = replaced(args, kwargs, DEVICE_IDS[0], DEVICE_IDS[1], len(args) > DEVICE_IDS[0], passed)
        return wrapped(*args, **kwargs)

    return wrapper


def hook(module: ModuleType, guard: Guard, wrap: Wrap) -> None:
    """Wrap the host pools' copies and what the loads are for, in `module`, as it imports."""
    for where, owner in HICACHE_POOLS:
        cls = getattr(module, owner, None) if where == module.__name__ else None
        for method, what in HICACHE_METHODS if cls is not None else ():
            if method in cls.__dict__:
                wrap(cls, method, make_wrapper(method, what, guard))
    for where, owner, method, kind in HICACHE_LOAD_HOOKS:  # what the loads are for (a release without: unnamed)
        cls = getattr(module, owner, None) if where == module.__name__ else None
        if cls is not None and method in cls.__dict__:
            wrap(cls, method, hiloads.make_hook(kind, guard))


def where() -> Optional[str]:
    """Why the check does not run on this sglang (read from its classes), or None."""
    lacks = [f"{owner}.{HICACHE_METHODS[0][0]}" for module, owner in HICACHE_POOLS
             if defines(module, owner, HICACHE_METHODS[0][0]) is False]
    return f"this sglang has no {' or '.join(lacks)} (sglang {HICACHE_SINCE}+)" if len(lacks) == len(HICACHE_POOLS) \
        else None


def doctor(found: Found) -> list[str]:
    return [f"HiCache (sglang {HICACHE_SINCE}+: the host pool's copies into and out of device slots, probed like a "
            "write of the device pool):",
            *(f"  {owner + '.' + method:48} {what}: device_indices in [0, {POOL_IDS.rule}), live: "
              f"{found(module, owner, method)}" for module, owner in HICACHE_POOLS for method, what in HICACHE_METHODS),
            "  the holder check, with liveness, where the write map runs (" + (write_map_off() or "on here") +
            "): a load's slot another running request owns (the owner table) is reported, naming what the load is "
            "for:",
            *(f"  {owner + '.' + method:48} {hiloads.LOAD_ROLES[kind]}: {found(module, owner, method)}"
              for module, owner, method, kind in HICACHE_LOAD_HOOKS),
            "  not checked: loads on a GPU (the owner table is device memory: no host sync); a slot freed under its "
            "request and handed to a load (the read check names its reader); the other host pools (their ids are "
            "virtual or paged)"]


UNIT = Unit("hicache", "HiCache loads and backups: their slots, and loads into another request's slot",
            "per load or backup call: O(ids)", ("loads", "writes"), "the HiCache host pools' copies; the cache "
            "controller's loads", where=where, feature="HiCache", state=hiloads.Loads,
            modules=(*(module for module, _ in HICACHE_POOLS), *dict.fromkeys(module for module, *_ in HICACHE_LOAD_HOOKS)),
            hook=hook, doctor=doctor)
