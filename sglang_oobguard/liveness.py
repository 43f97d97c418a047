"""Liveness: the allocator side of the liveness guard (SGLANG_OOBGUARD_LIVENESS).

A bound check sees only ids outside the pool; most stale ids are inside it, in a
slot that its request already gave back. So each tracked allocator keeps its pool's
shadow (`probe.Live`, one flag per page): `clear` starts it (every allocator's
constructor calls clear), the alloc methods set the flags of the ids they return,
a free that really gives ids back (not one a free group holds) is checked, every id
must be live, and then clears them. The write probe reads the same shadow.

On a GPU every shadow update is ordered after the write probes already enqueued on
the forward stream (sglang allocates and frees on its scheduling stream), so a free
never clears a flag that a write of the batch in flight still checks.

`allocator_targets` lists what to wrap from `targets.ALLOCATOR_METHODS`; `patch`
installs and uninstalls those wrappers like the pool ones. Only an allocator over a
real KVCache with integer `size` and `page_size` is tracked (sglang's own allocator
tests build them over mocks): the others are named once in the log.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import torch

from . import probe
from .config import Mode
from .discover import Method, by_design, pool_classes
from .guard import Guard, PoolState
from .report import KVOutOfBoundsError, free_site_id, logger
from .targets import (ALLOCATOR_BASE, ALLOCATOR_METHODS, ALLOCATOR_MODULE, BASE_CLASS, MEMORY_POOL,
                      POOL_OF_ALLOCATOR, TOKEN_SLOTS, TRACKED_ALLOCATORS, Role)

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


# -- what each role does around the allocator's own call ------------------------
# A handler gets (guard, allocator, its state, site, call) and returns the result.


class _Call:
    """One allocator call: the wrapped method and its arguments, which a free's
    containment may replace (warn mode on the host: only the live ids go back)."""

    def __init__(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict) -> None:
        self.wrapped, self.args, self.kwargs = wrapped, args, kwargs

    @property
    def ids(self) -> Any:
        return self.args[0] if self.args else next(iter(self.kwargs.values()), None)

    @ids.setter
    def ids(self, value: torch.Tensor) -> None:
        if self.args:
            self.args = (value, *self.args[1:])
        else:
            self.kwargs = {**self.kwargs, next(iter(self.kwargs)): value}

    def __call__(self) -> Any:
        return self.wrapped(*self.args, **self.kwargs)


def _alloc(guard: Guard, allocator: Any, state: PoolState, site: int, call: _Call) -> Any:
    result = call()
    if isinstance(result, torch.Tensor) and state.live is not None:
        _quietly(guard, "alloc", lambda: _update(state, lambda live: probe.mark(live, result)))
    return result


def _backup(guard: Guard, allocator: Any, state: PoolState, site: int, call: _Call) -> Any:
    result = call()
    if state.live is not None:
        _quietly(guard, "backup_state", lambda: _update(
            state, lambda live: guard.mark(allocator, BACKUP_ATTR, live.flags.clone())))
    return result


def _restore(guard: Guard, allocator: Any, state: PoolState, site: int, call: _Call) -> Any:
    result = call()
    saved = allocator.__dict__.get(BACKUP_ATTR)
    if saved is not None and state.live is not None:
        _quietly(guard, "restore_state", lambda: _update(state, lambda live: live.flags.copy_(saved)))
    return result


def _free(guard: Guard, allocator: Any, state: PoolState, site: int, call: _Call, in_pages: bool) -> Any:
    ids = call.ids
    if isinstance(ids, torch.Tensor) and ids.numel() and _releases_now(allocator):
        contained = _checked(guard, lambda: check_free(guard, state, site, ids, in_pages))
        if contained is not None:
            call.ids = contained
    return _counted(guard, allocator, "free", call)


def _group_end(guard: Guard, allocator: Any, state: PoolState, site: int, call: _Call) -> Any:
    group = getattr(allocator, "free_page_ids_group", None) or []
    for i, page_ids in enumerate(group):
        contained = _checked(guard, lambda: check_free(guard, state, site, page_ids, True))
        if contained is not None:
            group[i] = contained
    return _counted(guard, allocator, "group", call)


FAMILIES = {Role.FREE: "free", Role.FREE_PAGES: "free", Role.GROUP_END: "group"}
HANDLERS: dict[Role, Callable[..., Any]] = {
    Role.ALLOC: _alloc,
    Role.FREE: lambda guard, allocator, state, site, call: _free(guard, allocator, state, site, call, False),
    Role.FREE_PAGES: lambda guard, allocator, state, site, call: _free(guard, allocator, state, site, call, True),
    Role.GROUP_END: _group_end,
    Role.BACKUP: _backup,
    Role.RESTORE: _restore,
}


def make_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper for one allocator method. Only the tracked classes
    themselves count (exact type): a subclass may hand slots out its own way."""
    tracked = TRACKED_ALLOCATORS
    role, method = target.role, target.method
    family = FAMILIES.get(role)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if type(instance).__name__ not in tracked:
            return wrapped(*args, **kwargs)
        outer = guard.freeing
        if family is not None and outer is not None and outer[0] is instance and outer[1] == family:
            return wrapped(*args, **kwargs)  # the inner half of a free we check already
        if role is Role.CLEAR:
            result = wrapped(*args, **kwargs)
            _quietly(guard, f"{type(instance).__name__}.clear", lambda: _start(guard, instance))
            return result
        state: Optional[PoolState] = instance.__dict__.get(LIVE_ATTR)
        if state is None or state.live is None:
            return wrapped(*args, **kwargs)
        return HANDLERS[role](guard, instance, state, free_site(method, role, type(instance)),
                              _Call(wrapped, args, kwargs))

    return wrapper


def free_site(method: str, role: Role, cls: type) -> int:
    """The site id of an allocator method, e.g. "free (TokenToKVPoolAllocator)"."""
    return free_site_id(f"{method} ({cls.__name__})", "page_ids" if role is Role.FREE_PAGES else "free_index")


def _counted(guard: Guard, allocator: Any, family: str, call: _Call) -> Any:
    """Run a free with the family marked, so a nested free of the same family
    (free_page_ids calling free) is not checked twice."""
    outer = guard.freeing
    guard.freeing = (allocator, family)
    try:
        return call()
    finally:
        guard.freeing = outer


def _update(state: PoolState, change: Callable[[probe.Live], Any]) -> None:
    """A shadow update, ordered after the write probes enqueued so far."""
    assert state.live is not None
    if state.live.flags.is_cuda:
        state.after_probes()
    change(state.live)


def _quietly(guard: Guard, where: str, work: Callable[[], Any]) -> None:
    """Bookkeeping that must never raise into sglang: a failure is logged once."""
    try:
        work()
    except Exception as exc:
        guard.internal_error(where, exc)


def _checked(guard: Guard, work: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """A free's check: a reported violation raises (strict, raise); anything else the
    guard hits is logged once and the free goes on as sglang asked."""
    try:
        return work()
    except KVOutOfBoundsError:
        raise
    except Exception as exc:
        guard.internal_error("free check", exc)
        return None


def check_free(guard: Guard, state: PoolState, site: int, ids: torch.Tensor, in_pages: bool) -> Optional[torch.Tensor]:
    """Check one real free against the shadow (every id live, none twice where each
    id owns its flag), then clear the flags of what it gives back. `in_pages`: the
    ids are page ids. Returns the ids to free instead, when warn mode contains a bad
    free on the host (the live ones, once each); None: free `ids` as they are."""
    live = state.live
    assert live is not None
    pool_high = live.flags.numel() * live.page
    high = live.flags.numel() if in_pages else pool_high
    if in_pages:
        live = live._replace(page=1)
    if guard.on_host(ids):
        finding = probe.scan_free(ids, high, live)
        contained = None
        if finding is not None:  # strict and raise: raised before the allocator took the ids
            guard.report_now(state, finding.record(site, -1, high, ids.numel(), guard.steps.number, free=True))
            contained = probe.live_only(ids, high, live)
        probe.release_host(ids, high, live)
        return contained
    state.after_probes()
    strict = guard.config.mode is Mode.STRICT
    probe.launch_free(ids, high, site, state.record.tensor, guard.steps.counter(state.device), live,
                      guard.message(site) if strict and ids.is_cuda else None)
    if live.owner is not None:  # [ownership] the free clears the owner (a bad id's page is clamped: reported already)
        live.owner.index_fill_(0, (ids.reshape(-1).to(torch.int64) // live.page).clamp_(0, live.owner.numel() - 1), 0)
    guard.launched(state)
    return None


def _releases_now(allocator: Any) -> bool:
    """Whether a free gives its ids back now, or a free group holds them until
    free_group_end (which frees them again, then for real)."""
    flag = allocator.__dict__.get("is_not_in_free_group")  # before 0.5.19
    return bool(flag) if flag is not None else allocator.__dict__.get("free_group") is None


def _trackable(pool: Any) -> str:
    """Why this allocator's pool cannot carry a shadow, or "" when it can."""
    from .patch import base_class

    base = base_class()
    if isinstance(base, str) or not isinstance(pool, base):
        return f"its kvcache is a {type(pool).__name__}, not a {MEMORY_POOL}.{BASE_CLASS}"
    for name in ("size", "page_size"):
        if not isinstance(pool.__dict__.get(name), int):
            return f"its kvcache's {name} is not an int"
    return ""


def _start(guard: Guard, allocator: Any) -> None:
    """Give the allocator's pool an all-free shadow, in the pool's token-slot space."""
    pool = allocator.__dict__.get(POOL_OF_ALLOCATOR)
    why = _trackable(pool)
    if why:
        name = type(allocator).__name__
        if guard.first_time(f"untracked {name} {why}"):
            logger.warning("sglang_oobguard: liveness not tracked for a %s: %s (bound check only)", name, why)
        return
    state = guard.state(pool, torch.device(allocator.device))
    high, page = TOKEN_SLOTS.high(pool), int(allocator.page_size)
    pages = -(-high // page)
    if state.live is None or state.live.page != page or state.live.flags.numel() != pages:
        state.live = probe.new_live(pages, page, state.device)
        if state.device.type == "cuda":
            _warm_up_frees(guard, state, type(allocator))
    else:
        _update(state, lambda live: (live.flags.zero_(), live.owner is not None and live.owner.zero_()))  # [ownership]
    guard.mark(allocator, LIVE_ATTR, state)
    allocator.__dict__.pop(BACKUP_ATTR, None)


def _warm_up_frees(guard: Guard, state: PoolState, cls: type) -> None:
    """Compile the free kernel's variants this allocator can ask for (empty launches)."""
    assert state.live is not None
    strict = guard.config.mode is Mode.STRICT
    for method, role in ALLOCATOR_METHODS.items():
        if role not in FAMILIES or not hasattr(cls, method):
            continue
        site = free_site(method, role, cls)
        live = state.live if role is Role.FREE else state.live._replace(page=1)
        for dtype in (torch.int64, torch.int32):
            probe.launch_free(torch.empty(0, dtype=dtype, device=state.device), 1, site, state.record.tensor,
                              guard.steps.counter(state.device), live, guard.message(site) if strict else None)
