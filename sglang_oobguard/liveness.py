"""Liveness: the allocator side of the liveness guard (SGLANG_OOBGUARD_LIVENESS).

A bound check sees only ids outside the pool; most stale ids are inside it, in a
slot that its request already gave back. So each tracked allocator keeps its pool's
shadow (`probe.Live`, one flag per page): `clear` starts it (every allocator's
constructor calls clear), the alloc methods set the flags of the ids they return,
a free that really gives ids back (not one a free group holds) is checked, every id
must be live, and then clears them. The write probe reads the same shadow.

`allocator_targets` lists what to wrap from `targets.ALLOCATOR_METHODS`; `patch`
installs and uninstalls those wrappers like the pool ones.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Union

import torch

from . import probe
from .discover import Method, by_design, pool_classes
from .guard import Guard, PoolState
from .report import free_site_id
from .targets import (ALLOCATOR_BASE, ALLOCATOR_METHODS, ALLOCATOR_MODULE, POOL_OF_ALLOCATOR,
                      TRACKED_ALLOCATORS, Role, TOKEN_SLOTS)

LIVE_ATTR = "_oobguard_live"  # on a tracked allocator: its pool's PoolState
BACKUP_ATTR = "_oobguard_backup"  # on a tracked allocator: the shadow as backup_state() saw it


@dataclass(frozen=True)
class AllocatorMethod(Method):
    """One allocator method to wrap (where it is defined) and what it does."""

    original: Callable[..., Any]
    role: Role


def allocator_targets() -> Union[tuple[list[AllocatorMethod], list[str]], str]:
    """The methods of the tracked allocator classes, each where it is defined, and
    the names of the allocator classes that are not tracked; or why there are none."""
    try:
        base = getattr(importlib.import_module(ALLOCATOR_MODULE), ALLOCATOR_BASE)
    except (ImportError, AttributeError) as exc:
        return f"{ALLOCATOR_MODULE}.{ALLOCATOR_BASE} is not importable: {type(exc).__name__}: {exc}"
    classes = [cls for cls in pool_classes(base) if cls is not base]
    tracked = [cls for cls in classes if cls.__name__ in TRACKED_ALLOCATORS]
    methods: dict[tuple[type, str], AllocatorMethod] = {}
    for cls in tracked:
        for name, role in ALLOCATOR_METHODS.items():
            owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
            if owner is None or (owner, name) in methods:
                continue
            original = owner.__dict__[name]
            original = getattr(original, "__wrapped__", original)
            if not by_design(original):  # e.g. the token allocator's alloc_extend: raises, hands out nothing
                methods[owner, name] = AllocatorMethod(owner, name, original, role)
    return list(methods.values()), [cls.__name__ for cls in classes if cls not in tracked]


def make_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper for one allocator method. Only the tracked classes
    themselves count (exact type): a subclass may hand slots out its own way."""
    tracked = TRACKED_ALLOCATORS
    role, method = target.role, target.method
    sites: dict[type, int] = {}

    def site_of(cls: type) -> int:
        if cls not in sites:
            sites[cls] = free_site_id(f"{method} ({cls.__name__})",
                                      "page_ids" if role is Role.FREE_PAGES else "free_index")
        return sites[cls]

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if type(instance).__name__ not in tracked:
            return wrapped(*args, **kwargs)
        if role is Role.CLEAR:
            result = wrapped(*args, **kwargs)
            _start(guard, instance)
            return result
        state: PoolState | None = instance.__dict__.get(LIVE_ATTR)
        if state is None or state.live is None:
            return wrapped(*args, **kwargs)
        if role is Role.ALLOC:
            result = wrapped(*args, **kwargs)
            if isinstance(result, torch.Tensor):
                probe.mark(state.live, result)
            return result
        if role is Role.BACKUP:
            result = wrapped(*args, **kwargs)
            instance.__dict__[BACKUP_ATTR] = state.live.flags.clone()
            return result
        if role is Role.RESTORE:
            result = wrapped(*args, **kwargs)
            saved = instance.__dict__.get(BACKUP_ATTR)
            if saved is not None:
                state.live.flags.copy_(saved)
            return result
        family = "group" if role is Role.GROUP_END else "free"
        outer = guard.freeing
        if outer is not None and outer[0] is instance and outer[1] == family:
            return wrapped(*args, **kwargs)  # the inner half of a free we count already
        if role is Role.GROUP_END:
            group = getattr(instance, "free_page_ids_group", None) or []
            for i, page_ids in enumerate(group):
                contained = guard.check_free(state, site_of(type(instance)), page_ids, in_pages=True)
                if contained is not None:
                    group[i] = contained
        else:
            given = len(args) > 0
            ids = args[0] if given else next(iter(kwargs.values()), None)
            if isinstance(ids, torch.Tensor) and ids.numel() and _releases_now(instance):
                contained = guard.check_free(state, site_of(type(instance)), ids, in_pages=role is Role.FREE_PAGES)
                if contained is not None:  # warn mode on the host: only the live ids go back
                    if given:
                        args = (contained, *args[1:])
                    else:
                        kwargs = {**kwargs, next(iter(kwargs)): contained}
        guard.freeing = (instance, family)
        try:
            return wrapped(*args, **kwargs)
        finally:
            guard.freeing = outer

    return wrapper


def _releases_now(allocator: Any) -> bool:
    """Whether a free gives its ids back now, or a free group holds them until
    free_group_end (which frees them again, then for real)."""
    flag = allocator.__dict__.get("is_not_in_free_group")  # before 0.5.19
    return bool(flag) if flag is not None else allocator.__dict__.get("free_group") is None


def _start(guard: Guard, allocator: Any) -> None:
    """Give the allocator's pool an all-free shadow, in the pool's token-slot space."""
    pool = allocator.__dict__.get(POOL_OF_ALLOCATOR)
    if pool is None:
        return
    state = guard.start_shadow(pool, torch.device(allocator.device), TOKEN_SLOTS.high(pool), allocator.page_size)
    allocator.__dict__[LIVE_ATTR] = state
    allocator.__dict__.pop(BACKUP_ATTR, None)
