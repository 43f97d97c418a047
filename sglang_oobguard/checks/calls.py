"""Calls: what the guard knows of the calls in progress, per thread.

sglang 0.4.x runs the forward on a thread of its own, beside the scheduler's, so
nothing of a call in progress may be a process global: each thread has its own
innermost guarded call, free in progress, step depth and per-step memo. Also the two
helpers every wrapper uses to read and replace one argument of a wrapped call.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch


class CallState:
    """One thread's calls in progress (each thread has its own: `PerThread`)."""

    __slots__ = ("current", "freeing", "swa_peers", "depth", "memo", "hot", "capturing", "step_ids", "values")

    def __init__(self) -> None:
        # The guarded write in progress, innermost: (pool, method, ids object passed on).
        # A nested call on the same pool and method with that ids object (a super()
        # call) is not probed again; inside any, upstream's duplicate probe is skipped.
        self.current: Optional[tuple[Any, str, Any]] = None
        # The allocator call in progress that checks frees: (allocator, role family);
        # a nested one of the same family (free_page_ids calling free) is not counted twice.
        self.freeing: Optional[tuple[Any, str]] = None
        # An SWA allocator's free in progress (host ids): (its full ids, their SWA peers as the
        # call found them). sglang clears the mapping before its sub-allocator frees the SWA
        # pages, so a report of that inner free finds the full slots (and their holder) here.
        self.swa_peers: Optional[tuple[Any, Any]] = None
        self.depth = 0  # forward steps in progress on this thread
        # Within one forward step (or one graph capture), the ids objects already probed
        # on a pool: (pool, bound, region, ids, lens, live) -> (ids, what the write got,
        # whether that is a copy in the pool's buffer).
        self.memo: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        # The memo's last answer on the host, looked at first: (pool, ids, what the write got).
        # Every layer of a step writes the same ids object, so it answers all but the first.
        self.hot: Optional[tuple[Any, torch.Tensor, torch.Tensor]] = None
        self.capturing = False  # the memo belongs to a graph capture
        self.step_ids: Any = None  # the step's mapped ids (ownids.StepIds), for writes with ids of their own
        # The value check's small host parts of this forward step's writes, checked at its end (values.Deferred)
        self.values: list = []


    def new_memo(self) -> None:
        """A new step, or a capture begun or ended: nothing probed so far serves."""
        if self.memo:
            self.memo = {}
        self.hot = None


class PerThread(threading.local):
    """Each thread's CallState, made on its first look: a wrapper reads the thread-local
    once (`.calls`), then plain attributes (a thread-local's own cost several times more)."""

    def __init__(self) -> None:
        self.calls = CallState()


def memo_key(pool: Any, high: int, param: int, ids: torch.Tensor, lens: Optional[torch.Tensor], live: bool) -> tuple:
    """The memo's key: ids probed on a pool against a bound, as one id parameter, with
    these lens, with or without the shadow (objects by identity: the memo holds them)."""
    return id(pool), high, param, id(ids), id(lens), live


def replaced(args: tuple, kwargs: dict, position: int, name: str, given: bool, value: Any) -> tuple[tuple, dict]:
    """The call's arguments with one replaced (positional when it was given so)."""
    if given:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """One argument of a wrapped call, given by position or by name."""
    return args[position] if len(args) > position else kwargs.get(name, default)
