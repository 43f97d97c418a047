"""Liveness: the allocator hooks that keep each pool's shadow (SGLANG_OOBGUARD_LIVENESS).

A bound check sees only ids outside the pool; most stale ids are inside it, in a
slot that its request already gave back. So each tracked allocator keeps its pool's
shadow (`shadow.Live`, one flag per page of the allocator's own id space): `clear`
starts it (every allocator's constructor calls clear), the alloc methods set the
flags of the ids they return, a free that really gives ids back (not one a free
group holds) is checked, every id must be live, and then clears them. The write
probes and the step check read the same shadow. Each call also writes its slots'
history (generation, step and call site: `shadow.Live.history`), the call site
interned from the caller's frames on the host (`model.callsite`).

On a GPU every shadow update is ordered after the write probes already enqueued on
the forward stream (sglang allocates and frees on its scheduling stream), so a free
never clears a flag that a write of the batch in flight still checks.

`discover.allocator_targets` lists what to wrap from `targets.ALLOCATOR_METHODS`;
`instrument` installs and uninstalls these wrappers like the pool ones. Only an allocator over a
real KVCache with integer `size` and `page_size` is tracked (sglang's own allocator
tests build them over mocks): the others are named once in the log.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..model import callsite
from ..model.config import Mode
from ..model.discover import AllocatorMethod, base_class
from ..model.log import logger
from ..model.targets import ALLOCATOR_METHODS, BASE_CLASS, MEMORY_POOL, POOL_OF_ALLOCATOR, TRACKED_ALLOCATORS, Role
from ..model.violation import Kind, free_site_id
from ..probes import device, hostscan, kernels, shadow
from ..probes.pools import LIVE_ATTR, PoolState
from ..report.reporter import KVOutOfBoundsError
from . import claims, transfer
from .guard import Guard
from .unit import Unit, kept

BACKUP_ATTR = "_oobguard_backup"  # on a tracked allocator: the shadow as backup_state() saw it


# -- what each role does around the allocator's own call ------------------------
# A handler gets (guard, allocator, its state, site, call) and returns the result.


class Call:
    """One allocator call: the wrapped method and its arguments, which a free's
    containment may replace (warn mode on the host: only the live ids go back)."""

    def __init__(self, wrapped: Callable[..., Any], args: tuple, kwargs: dict, method: str,
                 event: int = callsite.NONE) -> None:
        self.wrapped, self.args, self.kwargs, self.method = wrapped, args, kwargs, method
        self.event = event  # callsite.pack(step, site): the slots' history entry

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


def _alloc(guard: Guard, allocator: Any, state: PoolState, site: int, call: Call) -> Any:
    result = call()
    if isinstance(result, torch.Tensor) and state.live is not None:
        host = guard.on_host(result)
        _count(guard, state, "allocs")
        if result.numel() and host:  # a live page handed out again (the GPU path: not yet)
            checked(guard, lambda: check_hand_out(guard, allocator, state, site, result))
        _quietly(guard, "alloc", lambda: _update(state, lambda live: shadow.mark(live, result, call.event, host)))
    return result


def _backup(guard: Guard, allocator: Any, state: PoolState, site: int, call: Call) -> Any:
    result = call()
    if state.live is not None:
        _quietly(guard, "backup_state", lambda: _backup_into(guard, allocator, state))
    return result


def _backup_into(guard: Guard, allocator: Any, state: PoolState) -> None:
    """[gpu] The backup buffer is made on the host now, its copy enqueued (a device op)."""
    assert state.live is not None
    saved = torch.empty_like(state.live.flags)
    guard.mark(allocator, BACKUP_ATTR, saved)
    _update(state, lambda live: saved.copy_(live.flags))


def _restore(guard: Guard, allocator: Any, state: PoolState, site: int, call: Call) -> Any:
    result = call()
    saved = allocator.__dict__.get(BACKUP_ATTR)
    if saved is not None and state.live is not None:
        _quietly(guard, "restore_state", lambda: _update(state, lambda live: shadow.restore(live, saved)))
    return result


def _free(guard: Guard, allocator: Any, state: PoolState, site: int, call: Call, in_pages: bool) -> Any:
    ids = call.ids
    if isinstance(ids, torch.Tensor) and ids.numel() and releases_now(allocator):
        if guard.on_host(ids):  # pages a KV transfer still writes: reported, and held back in warn mode
            free = getattr(allocator, call.method)
            unheld = checked(guard, lambda: transfer.on_free(guard, state, site, ids, in_pages, free))
            if unheld is not None:
                call.ids = ids = unheld
        pool = allocator.__dict__.get(POOL_OF_ALLOCATOR)
        contained = checked(guard, lambda: check_free(guard, state, site, ids, in_pages, call.event, pool)) \
            if ids.numel() else None
        if contained is not None:
            call.ids = contained
    return counted(guard, allocator, "free", call)


def _group_end(guard: Guard, allocator: Any, state: PoolState, site: int, call: Call) -> Any:
    pool = allocator.__dict__.get(POOL_OF_ALLOCATOR)
    for name, in_pages in END_GROUPS:
        for i, ids in enumerate(group := getattr(allocator, name, None) or []):
            contained = checked(guard, lambda: check_free(guard, state, site, ids, in_pages, call.event, pool))
            if contained is not None:
                group[i] = contained
    return counted(guard, allocator, "group", call)


END_GROUPS = (("free_page_ids_group", True), ("free_page_reps_group", False))  # (list, page ids?) a group's end frees
FAMILIES = {Role.FREE: "free", Role.FREE_SEGMENT: "free", Role.FREE_PAGES: "free", Role.GROUP_END: "group"}
HANDLERS: dict[Role, Callable[..., Any]] = {
    Role.ALLOC: _alloc,
    Role.FREE: lambda guard, allocator, state, site, call: _free(guard, allocator, state, site, call, False),
    Role.FREE_SEGMENT: lambda guard, allocator, state, site, call: _free(guard, allocator, state, site, call, False),
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
        outer = guard.calls.freeing
        if family is not None and outer is not None and outer[0] is instance and outer[1] == family:
            return wrapped(*args, **kwargs)  # the inner half of a free we check already
        if role is Role.CLEAR:
            result = wrapped(*args, **kwargs)
            _quietly(guard, f"{type(instance).__name__}.clear", lambda: _start(guard, instance))
            return result
        state: Optional[PoolState] = instance.__dict__.get(LIVE_ATTR)
        if state is None or state.live is None:
            return wrapped(*args, **kwargs)
        event = callsite.NONE
        if state.live.history is not None:  # slot history on: the caller's frames, interned
            event = callsite.pack(guard.steps.number, callsite.here(type(instance), method))
        return HANDLERS[role](guard, instance, state, free_site(method, role, type(instance)),
                              Call(wrapped, args, kwargs, method, event))

    return wrapper


def free_site(method: str, role: Role, cls: type) -> int:
    """The site id of an allocator method, e.g. "free (TokenToKVPoolAllocator)"."""
    param = {Role.FREE_PAGES: "page_ids", Role.ALLOC: "handed_out"}.get(role, "free_index")
    return free_site_id(f"{method} ({cls.__name__})", param)


def check_hand_out(guard: Guard, allocator: Any, state: PoolState, site: int, ids: torch.Tensor) -> None:
    """Report ids the allocator hands out on pages still handed out (host ids only),
    naming the request that holds the page and the one it is handed to (`claims`)."""
    assert state.live is not None
    finding = hostscan.scan_handed_out(ids, state.live)
    if finding is not None:
        record = finding.record(site, -1, state.live.high, ids.numel(), guard.steps.number)
        held = claims.full_slots_of(allocator.__dict__.get(POOL_OF_ALLOCATOR), record.value, state.live.page)
        guard.report_now(state, record._replace(kind=Kind.HANDED_OUT),
                         **claims.sides(guard, held, record.pos, ids.numel()))


def counted(guard: Guard, allocator: Any, family: str, call: Call) -> Any:
    """Run a free with the family marked, so a nested free of the same family
    (free_page_ids calling free) is not checked twice."""
    calls = guard.calls
    outer = calls.freeing
    calls.freeing = (allocator, family)
    try:
        return call()
    finally:
        calls.freeing = outer


def _count(guard: Guard, state: PoolState, unit: str) -> None:
    """A hand-out or free checked, and the history event it writes."""
    guard.counts.add("liveness", unit)
    if state.live is not None and state.live.history is not None:
        guard.counts.add("history", "events")


def _update(state: PoolState, change: Callable[[shadow.Live], Any]) -> None:
    """A shadow update, ordered after the write probes enqueued so far."""
    assert state.live is not None
    if device.is_gpu(state.live.flags):
        state.after_probes()
    device.enqueue(change, state.live)  # a device op on the current stream


def _quietly(guard: Guard, where: str, work: Callable[[], Any]) -> None:
    """Bookkeeping that must never raise into sglang: a failure is logged once."""
    try:
        work()
    except Exception as exc:
        guard.internal_error(where, exc)


def checked(guard: Guard, work: Callable[[], Optional[torch.Tensor]]) -> Optional[torch.Tensor]:
    """A free's check: a reported violation raises (strict, raise); anything else the
    guard hits is logged once and the free goes on as sglang asked."""
    try:
        return work()
    except KVOutOfBoundsError:
        raise
    except Exception as exc:
        guard.internal_error("free check", exc)
        return None


def check_free(guard: Guard, state: PoolState, site: int, ids: torch.Tensor, in_pages: bool,
               event: int = callsite.NONE, pool: Any = None) -> Optional[torch.Tensor]:
    """Check one real free against the shadow (every id live, none twice where each
    id owns its flag), then clear the flags of what it gives back. `in_pages`: the
    ids are page ids. A host report names both requests (`claims`; `pool`: the
    allocator's, whose slots an SWA mapping may name). Returns the ids to free instead,
    when warn mode contains a bad free on the host (the live ones, once each); None:
    free `ids` as they are."""
    live = state.live
    assert live is not None
    _count(guard, state, "frees")
    if in_pages:
        live = live.as_pages()
    high = live.high
    if guard.on_host(ids):
        finding = hostscan.scan_free(ids, high, live)
        contained = None
        if finding is not None:  # strict and raise: raised before the allocator took the ids
            record = finding.record(site, -1, high, ids.numel(), guard.steps.number, free=True)
            slot = record.value * (state.live.page if in_pages else 1)
            held = claims.full_slots_of(pool, slot, state.live.page, guard.calls.swa_peers) if 0 <= slot else []
            guard.report_now(state, record, **claims.sides(guard, held))
            contained = hostscan.live_only(ids, high, live)
        shadow.release(live, ids, event, host=True)
        return contained
    state.after_probes()
    strict = guard.config.mode is Mode.STRICT
    kernels.launch_free(ids, high, site, state.record.tensor, guard.steps.counter(state.device), live,
                        guard.message(site) if strict and device.is_gpu(ids) else None)
    if live.owner is not None:
        device.enqueue(shadow.release, live, ids, event)  # the owners and history (the kernel cleared the flags)
    guard.launched(state)
    return None


def releases_now(allocator: Any) -> bool:
    """Whether a free gives its ids back now, or a free group holds them until free_group_end."""
    flag = allocator.__dict__.get("is_not_in_free_group")  # before 0.5.19
    return bool(flag) if flag is not None else allocator.__dict__.get("free_group") is None


def _trackable(pool: Any) -> str:
    """Why this allocator's pool cannot carry a shadow, or "" when it can."""
    base = base_class()
    if isinstance(base, str) or not isinstance(pool, base):
        return f"its kvcache is a {type(pool).__name__}, not a {MEMORY_POOL}.{BASE_CLASS}"
    for name in ("size", "page_size"):
        if not isinstance(pool.__dict__.get(name), int):
            return f"its kvcache's {name} is not an int"
    return ""


def _start(guard: Guard, allocator: Any) -> None:
    """Give the allocator's pool an all-free shadow over the allocator's own id space
    (under decode context parallelism it is wider than the pool's rows). A shadow
    that is already big enough is zeroed in place, never reallocated."""
    pool = allocator.__dict__.get(POOL_OF_ALLOCATOR)
    why = _trackable(pool)
    if why:
        name = type(allocator).__name__
        if guard.first_time(f"untracked {name} {why}"):
            logger.warning("sglang_oobguard: liveness not tracked for a %s: %s (bound check only)", name, why)
        return
    state = guard.state(pool, torch.device(allocator.device))
    page = int(allocator.page_size)
    pages = -(-(int(allocator.size) + page) // page)
    owners, history = "owners" in guard.config.checks, "history" in guard.config.checks
    if state.live is None or state.live.page != page or state.live.pages < pages or \
            (state.live.owner is not None, state.live.history is not None) != (owners, history):
        if state.live is not None and device.is_gpu(state.device):  # a graph captured before may still read it
            device.retain(state.live)
            logger.warning("sglang_oobguard: the liveness shadow of %s grew to %d pages: a CUDA graph captured "
                           "before checks the retired shadow until it is captured again", state.pool_name, pages)
        state.live = shadow.new_live(pages, page, state.device, owners, history)
        if kept(guard.units.values(), guard.config.checks, pages):
            logger.info("sglang_oobguard: the checks' memory for %s (%d pages on %s, made with its allocator): %s",
                        state.pool_name, pages, state.device, kept(guard.units.values(), guard.config.checks, pages))
        if device.is_gpu(state.device):
            _warm_up_frees(guard, state, type(allocator))
    else:
        _update(state, shadow.clear)
    guard.mark(allocator, LIVE_ATTR, state)
    book = guard.held.get("pd")  # PD's transfers in flight (`checks.transfer`): none into a cleared pool
    if book is not None:
        book.forget(state)
    allocator.__dict__.pop(BACKUP_ATTR, None)


def _warm_up_frees(guard: Guard, state: PoolState, cls: type) -> None:
    """Compile the free kernel's variants this allocator can ask for (empty launches)."""
    assert state.live is not None
    strict = guard.config.mode is Mode.STRICT
    for method, role in ALLOCATOR_METHODS.items():
        if role not in FAMILIES or not hasattr(cls, method):
            continue
        site = free_site(method, role, cls)
        live = state.live.as_pages() if role is Role.FREE_PAGES else state.live
        for dtype in (torch.int64, torch.int32):
            kernels.launch_free(torch.empty(0, dtype=dtype, device=state.device), 1, site, state.record.tensor,
                                guard.steps.counter(state.device), live, guard.message(site) if strict else None)


def allocator_wrapper(target: AllocatorMethod, guard: Guard) -> Optional[Callable[..., Any]]:
    """The wrapper of a tracked allocator method of the token and paged families."""
    return make_wrapper(target, guard) if isinstance(target.role, Role) else None


UNIT = Unit("liveness", "writes, frees and hand-outs of slots the allocator does not hold as handed out",
            "per allocator call and per write: O(ids)", ("steps", "writes", "frees", "allocs"),
            "the tracked allocators' methods; every guarded write and forward step", allocators=allocator_wrapper,
            memory=lambda pages, rows, context: shadow.PAGE_BYTES["flags"] * (pages + 1))
