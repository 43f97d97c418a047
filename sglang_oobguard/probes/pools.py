"""Pools: what the guard keeps for each pool, made when the pool is built.

A `PoolState` holds the pool's record, the probe's scratch, the buffers the kernel
writes cleaned copies into, and, with liveness on, the shadow its allocator keeps.
Every buffer is made here, before serving and before any graph capture, and none
is ever grown, moved or freed while the process runs (a captured graph keeps their
addresses): a write with more ids than the buffers hold is probed without
containment instead.
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import torch

from . import device, kernels, valuekernel
from .hostmap import TableView
from .record import PoolRecord
from .shadow import Live

STATE_ATTR = "_oobguard_state"
LIVE_ATTR = "_oobguard_live"  # on a tracked allocator: its pool's PoolState (liveness)
NAME_ATTR = "_oobguard_name"  # a state holder that is no pool (a fused writer's) names itself
SITES_ATTR = "_oobguard_sites"  # ...and the sites its warm-up compiles
RING = 4  # eager copy slots, one per step in flight (the overlap scheduler runs one step ahead)
REGIONS = 2  # id parameters per write (move_kv_cache has two)

_serials = itertools.count()


class Marks:
    """Our attributes on sglang's objects (a pool's state, an allocator's shadow), remembered
    so that uninstall takes every one off again."""

    def __init__(self) -> None:
        super().__init__()
        self._marked: list[tuple[weakref.ref, str]] = []

    def mark(self, obj: Any, attr: str, value: Any) -> None:
        """Set one of our attributes on an object of sglang's, remembered for `unmark`."""
        obj.__dict__[attr] = value
        self._marked.append((weakref.ref(obj), attr))

    def unmark(self) -> None:
        for ref, attr in self._marked:
            obj = ref()
            if obj is not None:
                obj.__dict__.pop(attr, None)
        self._marked.clear()


class PoolState:
    """One pool's record, the kernel's copy buffers and the liveness shadow."""

    def __init__(self, pool: Any, where: torch.device) -> None:
        self.pool_name = pool.__dict__.get(NAME_ATTR) or type(pool).__name__
        self.serial = next(_serials)  # the pool's key in the reporter
        self.device = where
        self.record = PoolRecord(where)
        self.scratch = torch.tensor(kernels.SCRATCH_INIT, dtype=torch.int64, device=where)
        self.live: Optional[Live] = None  # the liveness shadow, when an allocator is tracked
        self.since_poll = 0
        self.order = device.Order()  # the write probes' streams: shadow updates on another stream wait for them
        # Cleaned copies for the kernel: RING eager slots (by step number) and one for
        # graph captures (graphs of one pool replay one at a time), REGIONS regions
        # each, every region as tall as the pool's slots. Made now on a GPU; on a CPU
        # (the kernel runs there only in Triton's interpreter, and no graph exists)
        # at the first copy.
        self.capacity = int(pool.size) + int(pool.page_size)
        self._copies: Optional[torch.Tensor] = self._new_copies() if device.is_gpu(where) else None
        self._views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = {}
        self.copied_for: dict[int, torch.Tensor] = {}  # region index -> the ids its copy was made of
        self.table = TableView()  # the host step check's view of the req_to_token its steps write by

    def for_graphs(self) -> "PoolState":
        """This state as uninstall keeps it, for the graphs that may still replay its
        probes: without its host view of sglang's req_to_token, which no graph reads."""
        self.table = TableView()
        return self

    def copy_for(self, region: int, loc: torch.Tensor) -> Optional[torch.Tensor]:
        """A contiguous tensor like `loc` in copy region `region` (slot * REGIONS + id
        parameter); None when `loc` holds more ids than a region."""
        key = (region, loc.dtype, loc.shape)
        view = self._views.get(key)
        if view is None:
            n = loc.numel()
            if n > self.capacity:
                return None
            if self._copies is None:
                self._copies = self._new_copies()
            base = self._copies[region * self.capacity:(region + 1) * self.capacity]
            view = base.view(loc.dtype)[:n].view(loc.shape)
            if len(self._views) >= 256:
                self._views.clear()
            self._views[key] = view
        return view

    def _new_copies(self) -> torch.Tensor:
        return torch.zeros((RING + 1) * REGIONS * self.capacity, dtype=torch.int64, device=self.device)

    def after_probes(self) -> None:
        """Order what the current stream does next (a shadow update) after every write
        probe enqueued so far: a stream wait (once per batch of probes), no host sync."""
        self.order.after(self.device)


def region(slot: int, param: int) -> int:
    """The copy region of an id parameter in a copy slot."""
    return slot * REGIONS + param


def warm_up(state: PoolState, sites: dict[int, bool], counter: torch.Tensor, strict: bool, liveness: bool,
            message: Any, finite: bool = False) -> None:
    """Compile, by empty launches, every kernel variant this pool's writes can ask
    for, so that serving and graph capture never compile. `sites`: {site: whether it
    takes row lengths}. Strict mode compiles one variant per site (its assert text);
    the others share theirs. `finite`: the value kernel's variants too."""
    if finite:
        valuekernel.warm_up(state.record.tensor, state.scratch, counter, strict)
    if not strict:
        sites = {-1: any(sites.values())}
    lives = (None, Live(state.scratch[:1].view(torch.int32), 1)) if liveness else (None,)
    for dtype in (torch.int64, torch.int32):
        loc = torch.empty(0, dtype=dtype, device=state.device)
        for site, with_lens in sites.items():
            for lens in (None, torch.empty(0, 1, dtype=dtype, device=state.device))[:1 + with_lens]:  # (0, 0): lens[:, 0] fails
                for live in lives:
                    kernels.launch(loc if lens is None else lens, 1, max(site, 0), -1, state.record.tensor,
                                   state.scratch, counter, None if strict else loc,
                                   message(site) if strict else None, None if lens is None else lens[:, 0], live)
