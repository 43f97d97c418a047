"""Rows: a shadow of sglang's request rows (`ReqToTokenPool`'s `req_pool_idx`), checked at each hand-out and free.

A request's row maps its positions to KV slots; attention reads the whole row. The rows
have their own allocator, which the KV shadow (`liveness`) does not see, and a row given
back while its request still runs is handed to the next request: both then write and read
one row, and the write map agrees with the corrupted table (sglang #18744). So each tracked
`ReqToTokenPool` keeps a book (`Book`): which rows are handed out, to which request, and
each row's last hand-out and free (step and call site, as a slot's history). Reported:

- a row freed while not handed out, or freed for a request while another request that
  still has it holds it (`row_double_free`), at the free: in warn mode that free is dropped;
- a row handed to a request while the running request it was handed to before still has it
  (`row_reused`), at the hand-out, naming both requests and the row (reported only).

A forward step whose batch holds one row twice is the write map's `shared_row` (`stepcheck`):
not checked again here. The book is made at the pool's first call, from its `free_slots`
(`leaktargets` reads each release's methods); its reports go through a state of their own
(`Rows`), whose `value` is the row.
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, Optional

import torch

from ..model import callsite
from ..model.config import Mode
from ..model.leaktargets import ROW_METHODS, ROWS_CLASS, ROWS_MODULE, TRACKED_ROWS, row_of
from ..model.violation import Kind, site_id
from ..probes import shadow
from ..probes.pools import NAME_ATTR
from ..probes.record import Record
from ..report.reporter import KVOutOfBoundsError
from . import claims
from .guard import Guard
from .unit import Found, Unit, Wrap, defines

BOOK_ATTR = "_oobguard_rows"  # on a tracked ReqToTokenPool: its Book
HAND_OUT = site_id("alloc (ReqToTokenPool rows)")
FREE = site_id("free (ReqToTokenPool rows)")
KEPT = 8  # hand-outs remembered per row: (serial, rid), for the leak sweep's naming


class Rows:
    """What a PoolState needs of its pool, for the rows' reports: a size, a name."""

    page_size = 1

    def __init__(self, size: int) -> None:
        self.size = size
        self.__dict__[NAME_ATTR] = "ReqToTokenPool (request rows)"


class Book:
    """One pool's rows: live flags, each row's holder (weakly), its last hand-out and free."""

    def __init__(self, guard: Guard, pool: Any) -> None:
        self.cls = type(pool)  # the call sites' label
        table = getattr(pool, "req_to_token", None)
        self.size = int(table.shape[0]) if isinstance(table, torch.Tensor) else int(pool.size) + 1
        self.live = bytearray([1]) * self.size  # a row not on the free list now: handed out (or padding row 0)
        self.start(pool)
        self.holder: list[Optional[weakref.ref]] = [None] * self.size
        self.rid: list[Optional[str]] = [None] * self.size
        self.handed = [callsite.NONE] * self.size  # callsite.pack(step, site) of each row's last hand-out
        self.freed = [callsite.NONE] * self.size
        self.serials: list[list[tuple[int, Optional[str]]]] = [[] for _ in range(self.size)]
        self.owner = Rows(self.size)
        self.state = guard.attach(self.owner, torch.device("cpu"))
        guard.name_site(HAND_OUT, "the rows handed out", in_steps=False)
        guard.name_site(FREE, "the rows handed out", in_steps=False)

    def start(self, pool: Any) -> None:
        """Every row on sglang's free list is free, every other handed out (made at the first call; clear)."""
        for row in getattr(pool, "free_slots", ()):
            if 0 <= int(row) < self.size:
                self.live[int(row)] = 0

    def holding(self, row: int) -> Optional[Any]:
        """The request the row was last handed to, if it is still running and still has the row."""
        ref = self.holder[row]
        req = ref() if ref is not None else None
        if req is None or row_of(req) != row or getattr(req, "finished", lambda: True)():
            return None
        return req

    def holder_at(self, row: int, serial: int) -> Optional[str]:
        """The rid the row was handed to last before `serial` (a page's generation), if remembered."""
        before = [rid for at, rid in self.serials[row] if at < serial] if 0 <= row < self.size else []
        return before[-1] if before else None


def book_of(guard: Guard, pool: Any) -> Book:
    book = pool.__dict__.get(BOOK_ATTR)
    if book is None:
        book = Book(guard, pool)
        guard.mark(pool, BOOK_ATTR, book)
    return book


def _event(guard: Guard, book: "Book", method: str) -> int:
    """A hand-out's or free's history entry: the step and the call site (`model.callsite`)."""
    return callsite.pack(guard.steps.number, callsite.here(book.cls, method))


def _history(book: Book, row: int) -> dict[str, Any]:
    (a_step, a_site), (f_step, f_site) = callsite.unpack(book.handed[row]), callsite.unpack(book.freed[row])
    return {"allocated_step": a_step, "allocated_by": callsite.text(a_site), "freed_step": f_step,
            "freed_by": callsite.text(f_site)}


def _report(guard: Guard, book: Book, site: int, kind: Kind, rows: list[int], pos: int, **where: Any) -> None:
    row = rows[pos]
    guard.report_now(book.state, Record.bad_ids(site=site, high=book.size, numel=len(rows), bad=1, pos=pos, value=row,
                                                step=guard.steps.number, kind=kind),
                     **{**_history(book, row), "claimed": True, **where})


def hand_out(guard: Guard, book: Book, given: list[tuple[Any, int]]) -> None:
    """Rows just handed out, each with the request it went to (None: a row without one):
    one a running request still has is reported, then each is the new holder's."""
    guard.counts.add("rows", "allocs")
    event = _event(guard, book, "alloc")
    rows = [row for _, row in given]
    for pos, (req, row) in enumerate(given):
        if not 0 <= row < book.size:
            continue
        running = book.holding(row)
        if running is not None and running is not req:
            _report(guard, book, HAND_OUT, Kind.ROW_REUSED, rows, pos, owner=_rid(running), request=_rid(req))
        rid = _rid(req)
        book.live[row], book.rid[row], book.handed[row] = 1, rid, event
        try:
            book.holder[row] = None if req is None else weakref.ref(req)
        except TypeError:
            book.holder[row] = None
        book.serials[row] = [*book.serials[row][1 - KEPT:], (shadow.serial(), rid)]


def free(guard: Guard, book: Book, rows: list[int], req: Any = None) -> list[int]:
    """Rows given back (`req`: the request they are given back for, when the call names it).
    Reports the first row that is not handed out, or that another running request holds;
    returns the rows to give back: all of them, or in warn mode only the good ones."""
    guard.counts.add("rows", "frees")
    event = _event(guard, book, "free")
    good, reported = [], False
    for pos, row in enumerate(rows):
        if not 0 <= row < book.size:
            good.append(row)
            continue
        running = book.holding(row)
        other = running is not None and req is not None and running is not req
        if (not book.live[row] or other) and not reported:
            reported = True
            _report(guard, book, FREE, Kind.ROW_DOUBLE_FREE, rows, pos,
                    request=_rid(req) if req is not None else claims.claimant(), owner=_rid(running) if other else None)
        if book.live[row] and not other:
            good.append(row)
            book.live[row], book.freed[row] = 0, event
    return good if guard.config.mode is Mode.WARN else rows


def _rid(req: Any) -> Optional[str]:
    rid = getattr(req, "rid", None)
    return None if rid is None else str(rid)


def _rows(value: Any) -> list[int]:
    """Row ids as sglang passes them: one, or a list (a tensor or array's `tolist`)."""
    value = value.tolist() if hasattr(value, "tolist") else value
    return [int(row) for row in value] if isinstance(value, (list, tuple)) else [int(value)]


def make_wrapper(role: str, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper of one ReqToTokenPool method (`leaktargets.ROW_METHODS`). A
    reported violation raises (strict, raise); anything else the guard hits is logged once."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        calls = guard.calls
        if type(instance).__name__ not in TRACKED_ROWS or "rows" not in guard.config.checks or \
                (calls.freeing is not None and calls.freeing[0] is instance):
            return wrapped(*args, **kwargs)  # the inner half of a call the outer one checks
        outer, calls.freeing = calls.freeing, (instance, "rows")
        try:
            return _checked(role, guard, wrapped, instance, args[0] if args else next(iter(kwargs.values()), None),
                            args, kwargs)
        finally:
            calls.freeing = outer

    return wrapper


def _checked(role: str, guard: Guard, wrapped: Callable[..., Any], pool: Any, given: Any, args: tuple,
             kwargs: dict) -> Any:
    book = quietly(guard, lambda: book_of(guard, pool))
    if book is None:
        return wrapped(*args, **kwargs)
    if role == "clear":
        result = wrapped(*args, **kwargs)
        book.live[:] = bytearray([1]) * book.size
        book.start(pool)
        return result
    if role.startswith("alloc"):
        reqs = given if role == "alloc" and isinstance(given, list) else None
        before = [row_of(req) for req in reqs] if reqs is not None else None
        result = wrapped(*args, **kwargs)
        if result is not None:
            new = [(req, row_of(req)) for req, was in zip(reqs, before) if was is None] if reqs is not None else \
                [(None, row) for row in result]
            quietly(guard, lambda: hand_out(guard, book, [(req, int(row)) for req, row in new if row is not None]))
        return result
    req = given if hasattr(given, "rid") or hasattr(given, "kv") else None  # free(req) (0.5.10+), else row ids
    rows = quietly(guard, lambda: _rows([row_of(req)] if req is not None else given))
    if rows is None or None in rows:
        return wrapped(*args, **kwargs)
    kept = quietly(guard, lambda: free(guard, book, rows, req))
    if kept is None or len(kept) == len(rows):
        return wrapped(*args, **kwargs)
    if req is None:  # warn: only the rows that are really handed out go back
        return wrapped(kept, *args[1:], **kwargs) if args else wrapped(**{next(iter(kwargs)): kept})
    kv = getattr(req, "kv", None)  # warn: free(req)'s row is not the request's to give back; it lets go of it
    (kv if kv is not None and hasattr(kv, "req_pool_idx") else req).req_pool_idx = None
    return None


def quietly(guard: Guard, work: Callable[[], Any], where: str = "request rows") -> Any:
    """The guard's bookkeeping: a report raises (strict, raise), any other failure is logged once."""
    try:
        return work()
    except KVOutOfBoundsError:
        raise
    except Exception as exc:
        guard.internal_error(where, exc)
        return None


def hook(module: Any, guard: Guard, wrap: Wrap) -> None:
    """Wrap ReqToTokenPool's row methods, where the class defines each."""
    cls = getattr(module, ROWS_CLASS, None)
    for method, role in ROW_METHODS.items() if cls is not None else ():
        if method in cls.__dict__:
            wrap(cls, method, make_wrapper(role, guard))


def doctor(found: Found) -> list[str]:
    return [f"request rows ({ROWS_CLASS}, exact type; PD decode's DecodeReqToTokenPool and the hybrid pools keep "
            "theirs another way: not tracked):",
            *(f"  {ROWS_CLASS + '.' + method:48} {found(ROWS_MODULE, ROWS_CLASS, method)}" for method in ROW_METHODS),
            "  a batch holding one row twice is the map check's shared_row; on 0.4.x (alloc takes a count) a "
            "hand-out names no request, so a row reused under its request is not seen there"]


def where() -> Optional[str]:
    """Why the check does not run on this sglang (read from its classes), or None."""
    return f"this sglang has no {ROWS_CLASS}.free" if defines(ROWS_MODULE, ROWS_CLASS, "free") is False else None


UNIT = Unit("rows", "request rows (req_pool_idx): a row freed twice, or handed to a request while a running request "
            "still has it", "per hand-out and free: O(its rows)", ("allocs", "frees"),
            f"{ROWS_CLASS}'s alloc and free", where=where, modules=(ROWS_MODULE,), hook=hook, doctor=doctor)
