"""Leaks: a request's KV released twice, and at idle the slots nobody holds (LeakSanitizer for the KV cache).

A leak's cause is far from its effect: sglang's own idle check (`self_check_during_idle`,
`on_idle`) finds that the pool's counts do not add up, and says how many tokens are
missing, not whose. Two checks, each where sglang itself acts:

- **Double release** (`release_kv_cache`, every release of a request's KV: finished,
  aborted, retracted, PD's transfers done): a request released a second time without
  holding a row again since its first release (sglang #17797: priority preemption
  released a request that had just finished; its slots freed again, its tree locks
  dropped twice). Reported at the second release, naming the request and where its
  first release happened (step and call site); in warn mode the second release is dropped.
- **Release completeness** (`leakrelease`, after each release): the slots of the request's row
  that the release neither freed nor left to the tree are leaked, reported there (CPU shadows).
- **The idle sweep** (`sweep`, as sglang's scheduler idles, before its own check, when it
  is fully idle): every slot the allocator has handed out (the liveness shadow) must be
  held by a tree node (`all_values_flatten`), a session's row or a KV transfer (no request
  runs at idle). sglang's own accounting decides whether to look: the tree's and the
  sessions' sizes against the shadow's count, O(pool) in numpy; only when they differ is
  the tree walked. The rest is a leak, one report per request the slots were handed out
  for (the page's owner row and the row's holder then, `rows.Book.holder_at`; by
  allocation, the slots' generation, where that is not known): its slots, the first one's
  allocation step and call site and generation (the slot history). Each leaked page is
  reported once. On a GPU the sweep reads the shadow on the host: at
  idle only.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..model import callsite
from ..model.config import Mode
from ..model.leaktargets import IDLE_GATE, RELEASE, RELEASE_HOME, RELEASE_IMPORTERS, RELEASE_SINCE, row_of
from ..model.swatargets import full_space
from ..model.targets import IDLE_HOOK, module_file
from ..model.violation import Kind, site_id
from ..probes.pools import LIVE_ATTR, PoolState
from ..probes.record import Record
from ..probes.shadow import GEN
from ..report.counts import slot
from . import leakrelease, rows
from .owners import page_owner_rows
from .guard import Guard
from .unit import Found, Unit, Wrap

RELEASE_LABEL = f"{RELEASE} (a request's KV released)"
SWEEP_LABEL = "idle sweep (slots no request, tree node or transfer holds)"
MARK = "_oobguard_release"  # on our wrapper: a module that bound the wrapped function already is left alone
_SWEEP, _RELEASE = site_id(SWEEP_LABEL), site_id(RELEASE_LABEL)
_ALLOCS, _FREES = slot("liveness", "allocs"), slot("liveness", "frees")  # the allocators' work: swept after new work
_HOME = type(RELEASE_HOME.rsplit(".", 1)[1], (), {})  # a call site's label: "common.release_kv_cache"
GROUPS = 8  # leaking requests reported per sweep (the rest are counted in each report's total)


class Leaks:
    """The check's state: each released request's first release, what the sweeps reported."""

    def __init__(self) -> None:
        self.released: "weakref.WeakKeyDictionary[Any, tuple[int, int]]" = weakref.WeakKeyDictionary()
        self.reported: set[tuple[int, int, int]] = set()  # (state serial, page, generation)
        self.swept: Optional[tuple[int, int]] = None  # the allocators' work counted at the last sweep


# -- double release ---------------------------------------------------------------


def second_release(guard: Guard, req: Any, tree: Any) -> bool:
    """Before a release: report a second release of `req` (it held no row since its first);
    True: drop it (warn mode)."""
    book: Leaks = guard.held["leaks"]
    try:
        first = book.released.get(req) if row_of(req) is None else None
    except TypeError:  # a request that cannot be a weak key: not followed
        return False
    if first is None or bool(getattr(tree, "supports_mamba", lambda: False)()):
        return False  # sglang allows a release without a row only to a mamba tree
    row, event = first
    step, site = callsite.unpack(event)
    guard.counts.add("leaks", "releases")
    guard.report_now(rows.book_of(guard, tree.req_to_token_pool).state,
                     Record.bad_ids(site=_RELEASE, high=-1, numel=1, bad=1, pos=0, value=row, step=guard.steps.number,
                                    kind=Kind.DOUBLE_RELEASE),
                     request=str(getattr(req, "rid", None)), freed_step=step, freed_by=callsite.text(site),
                     claimed=True)
    return guard.config.mode is Mode.WARN  # dropped: its slots, row and tree locks are given back once


def released(guard: Guard, req: Any, row: Any) -> None:
    """After a release: a request that held a row and holds none now is remembered, with where."""
    if row is not None and row_of(req) is None:  # (a streaming session may keep the row: also a release)
        guard.counts.add("leaks", "releases")
        try:
            event = callsite.pack(guard.steps.number, callsite.here(_HOME, RELEASE))
            guard.held["leaks"].released[req] = (int(row), event)
        except TypeError:  # a request that cannot be a weak key: not followed
            pass


def make_release_wrapper(guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper of release_kv_cache(req, tree_cache, ...). A report raises (strict,
    raise); any other failure of the guard's is logged once and the release goes on."""
    guard.name_site(_RELEASE, "a request's row", in_steps=False)  # outside forward steps: no step's request

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if "leaks" not in guard.config.checks:
            return wrapped(*args, **kwargs)
        req = args[0] if args else kwargs.get("req")
        tree = args[1] if len(args) > 1 else kwargs.get("tree_cache")
        row = row_of(req)
        if rows.quietly(guard, lambda: second_release(guard, req, tree), "release"):
            return None
        start = rows.quietly(guard, lambda: leakrelease.before(req, tree), "release")
        result = wrapped(*args, **kwargs)
        rows.quietly(guard, lambda: released(guard, req, row), "release")
        if start is not None:
            rows.quietly(guard, lambda: _account(guard, req, tree, start), "release")
        return result

    setattr(wrapper, MARK, True)
    return wrapper


def _account(guard: Guard, req: Any, tree: Any, start: leakrelease.Before) -> None:
    """After a release: report the slots of its row it neither freed nor left to the tree (once per page)."""
    found = leakrelease.after(guard, tree, start)
    if found is None:
        return
    leaked, record = found
    live = start.state.live
    assert live is not None
    generations = live.history[GEN, leaked].numpy() if live.history is not None else np.zeros(leaked.size, np.int64)
    guard.held["leaks"].reported.update((start.state.serial, int(page), int(generation))
                                        for page, generation in zip(leaked, generations))
    guard.name_site(record.site, "a request's row", in_steps=False)
    guard.report_now(start.state, record, request=str(getattr(req, "rid", None)), claimed=True)


def hook(module: Any, guard: Guard, wrap: Wrap) -> None:
    """Wrap release_kv_cache where it lives and in each module that bound it by name before
    (one that bound the wrapped one already is left alone)."""
    found = module.__dict__.get(RELEASE)
    if found is not None and not _ours(found):
        wrap(module, RELEASE, make_release_wrapper(guard))


def _ours(function: Any) -> bool:
    """Whether our wrapper is somewhere in this chain of wrappers (another plugin may wrap ours)."""
    for _ in range(8):
        if function is None or getattr(getattr(function, "_self_wrapper", None), MARK, False):
            return function is not None
        function = getattr(function, "__wrapped__", None)
    return False


# -- the idle sweep -----------------------------------------------------------------


def _idle(scheduler: Any) -> bool:
    """Whether sglang would run its own idle leak check now: nothing runs, waits or
    transfers, and no pool keeps pages back by design (HiSparse, deferred releases)."""
    gate = getattr(scheduler, IDLE_GATE, None)
    if gate is None or getattr(scheduler, "enable_hisparse", False):
        return False
    return bool(gate())


def held_pages(scheduler: Any, page: int, swa: bool) -> tuple[int, Callable[[], np.ndarray]]:
    """sglang's own count of what is held at idle, in pages (the tree's evictable and protected
    tokens, the sessions' rows), and how to list those pages (walks the tree: only when needed)."""
    tree = scheduler.tree_cache
    tokens = leakrelease.tree_tokens(tree, swa)
    session_slots = leakrelease.session_slots(tree)
    count = -(-tokens // page) + sum(-(-int(s.numel()) // page) for s in session_slots)

    def listed() -> np.ndarray:
        parts = [tree.all_values_flatten()] if tokens else []
        ids = torch.cat([p.reshape(-1).to("cpu", torch.int64) for p in parts + session_slots]) if parts or \
            session_slots else torch.empty(0, dtype=torch.int64)
        return np.unique(ids.numpy() // page)

    return count, listed


def sweep(guard: Guard, scheduler: Any) -> None:
    """At idle, before sglang's own check: report the slots handed out that nothing holds."""
    book: Leaks = guard.held["leaks"]
    worked = (guard.counts.n[_ALLOCS], guard.counts.n[_FREES])
    if worked == book.swept:
        return  # nothing allocated or freed since the last sweep (sglang calls its idle method in a loop)
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    sub = full_space(allocator) if allocator is not None else None
    state: Optional[PoolState] = getattr(sub, "__dict__", {}).get(LIVE_ATTR)
    pd = guard.held.get("pd")
    if state is None or state.live is None or not _idle(scheduler) or (pd is not None and pd.holding()):
        return  # not idle yet; or warn mode holds pages of transfers in flight back
    book.swept = worked
    guard.counts.add("leaks", "sweeps")
    guard.name_site(_SWEEP, "the pool", in_steps=False)
    live = state.live
    flags = live.flags[:live.pages].cpu().numpy()  # at idle only (on a GPU: one copy, nothing runs)
    count, listed = held_pages(scheduler, live.page, sub is not allocator)
    if np.count_nonzero(flags[1:]) <= count:  # page 0: padding, never handed out
        return
    pages = np.flatnonzero(flags[1:]) + 1
    leaked = np.setdiff1d(pages, listed())
    if leaked.size:
        _report_leaks(guard, state, scheduler, leaked)


def _report_leaks(guard: Guard, state: PoolState, scheduler: Any, leaked: np.ndarray) -> None:
    """One report per request the leaked pages were handed out for (by allocation where none is
    known), each page once; strict and raise stop at the first."""
    live = state.live
    assert live is not None
    book: Leaks = guard.held["leaks"]
    generations = live.history[GEN, :live.pages].cpu().numpy()[leaked] if live.history is not None else \
        np.zeros(leaked.size, dtype=np.int64)
    owners = page_owner_rows(live, leaked)
    pool = getattr(scheduler, "req_to_token_pool", None)
    rows_book = pool.__dict__.get(rows.BOOK_ATTR) if pool is not None else None
    groups: dict[Any, list[tuple[int, int, int]]] = {}
    for page, generation, owner in zip(leaked.tolist(), generations.tolist(), owners.tolist()):
        if (state.serial, page, generation) in book.reported:
            continue
        rid = rows_book.holder_at(owner, generation) if rows_book is not None and owner >= 0 else None
        groups.setdefault(rid or ("allocation", generation), []).append((page, generation, owner))
    total = int(leaked.size) * live.page
    for index, (key, group) in enumerate(list(groups.items())[:GROUPS]):
        book.reported.update((state.serial, page, generation) for page, generation, _ in group)
        page, _, owner = group[0]
        slots = len(group) * live.page
        guard.report_now(state, Record.ownership(site=_SWEEP, high=live.high, numel=total, bad=slots, pos=index,
                                                 value=page * live.page, step=guard.steps.number, kind=Kind.LEAK,
                                                 owner=owner),
                         request=key if isinstance(key, str) else None, claimed=True)


def _has_release() -> Optional[bool]:
    """Whether sglang defines release_kv_cache (None: its module is not imported yet)."""
    loaded = sys.modules.get(RELEASE_HOME)
    if loaded is None:
        return False if module_file(RELEASE_HOME) is None else None
    return RELEASE in vars(loaded)


def where() -> Optional[str]:
    """Why the check does not run on this sglang (read from its code), or None: both halves come with
    release_kv_cache (and Scheduler.is_fully_idle) in 0.5.10."""
    return f"this sglang has no {RELEASE} (sglang {RELEASE_SINCE}+)" if _has_release() is False else None


def doctor(found: Found) -> list[str]:
    return [f"double release: {RELEASE_HOME}.{RELEASE} (sglang {RELEASE_SINCE}+) and each module that binds it: "
            f"{found(RELEASE_HOME, '', RELEASE)}; warn mode drops the second release",
            "release completeness: after each release, the row's committed slots freed or the tree's (sglang's "
            "counts first, the tree walked only when they differ); CPU shadows only (on a GPU: the idle sweep)",
            f"idle sweep: before {IDLE_HOOK.owner}.({' or '.join(IDLE_HOOK.methods)}), while {IDLE_HOOK.owner}."
            f"{IDLE_GATE}(): {found(IDLE_HOOK.module, IDLE_HOOK.owner, IDLE_GATE)}",
            "  the tracked allocators' slots against the tree, the sessions' rows and PD's transfers (sglang's counts "
            "first, the tree walked only when they differ); one report per leaking request (the owner table and the "
            "rows' book name it: owners and rows on), each page once, with its history",
            "  not seen: leaks of untracked allocators (liveness's lines), SWA ids (the full ids are swept), a leak "
            "while requests run that no release shows (until the next idle), on 0.4.x (no release_kv_cache, no "
            "is_fully_idle)"]


UNIT = Unit("leaks", "a request's KV released twice or released with slots left to nobody; at idle, slots no request, "
            "tree node or transfer holds",
            "per release: O(the row); per idle after work: O(pool)", ("releases", "accounted", "sweeps"),
            f"{RELEASE}; the scheduler's idle method", where=where, state=Leaks,
            modules=(RELEASE_HOME, *RELEASE_IMPORTERS), hook=hook, doctor=doctor, idle=sweep)
