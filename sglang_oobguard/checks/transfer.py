"""Transfer: PD decode's KV destination pages, checked as they are sent and kept in flight until the write ends.

Under PD disaggregation the decode side allocates pages and sends their ids to the
prefill side, whose transfer engine (mooncake, nixl, mori) writes KV into them by
RDMA: no pool method and no out_cache_loc ever sees that write, only the ids. So
(with liveness on) the ids are checked where sglang sends them
(`DecodePreallocQueue._send_kv_metadata`): inside the page space, live, and the
request's own (its req_to_token row). From then on the pages are in flight until the
transfer has really ended (`inflight`: a Success poll, or after a failure the
backend's drain signal; with no drain signal a failed transfer stays in flight).

A free of an in-flight page (the tracked allocators' frees, on the host) is a
violation. Warn mode holds such pages back from the free list until the transfer
ends (`inflight.Transfers.settle`); while it holds any, `has_pending_deferred_releases`
says so, as sglang's own deferred release does, so the idle leak check waits and the
loop keeps resolving.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import numpy as np
import torch

from ..model.config import Mode
from ..model.log import logger
from ..model.swatargets import SWA_CHECKED, SWA_STATE_PAGES, full_space
from ..model.transfertargets import (DRAIN_ARMED, DRAIN_SIGNAL, TRANSFER_ENTRIES, TRANSFER_HOOKS, TRANSFER_MODULES,
                                     TRANSFER_SINCE)
from ..model.violation import Kind, site_id
from ..probes import hostscan
from ..probes.pools import LIVE_ATTR, PoolState
from ..probes.record import Record
from ..report.reporter import KVOutOfBoundsError
from .guard import Guard
from .inflight import Transfer, Transfers
from .unit import Found, Unit, Wrap, defines

SEND_LABEL = "send_metadata (PD decode KV destination pages)"
SOURCE_LABEL = "send (PD prefill KV source pages)"
# What each hook of TRANSFER_HOOKS does (doctor's words).
HOOK_ROLES = {
    "send": "the destination pages: in the page space, live, the request's own row; in flight from here",
    "poll": "Success ends a transfer; Failed ends it once the backend's drain signal says so (none: never)",
    "resolve": "warn mode gives back the pages it held once their transfer ended",
    "pending": "warn mode's held pages count as a deferred release (sglang's idle leak check waits)",
    "prefill": "the source pages each KV sender's send gets: in the page space, live, the request's own row",
}
NO_DRAIN = ("the fake backend (and any with the deferred release off) gives no drain signal: a failed "
            "transfer stays in flight, its free reported as 'may still be in flight (no drain signal)'")


# -- the hooks on sglang's decode queues ---------------------------------------------


def send(guard: Guard, queue: Any, decode_req: Any, kv_indices: Any, page_size: int, *rest: Any,
         **kwargs: Any) -> None:
    """Check the destination pages of one request as `_send_kv_metadata` sends them,
    then count them in flight."""
    if getattr(kwargs.get("destination"), "name", "DEVICE") == "HOST":
        return  # host staging buffers, not the device pool's pages
    state = _shadow(guard, queue.token_to_kv_pool_allocator)
    if state is None:
        return
    if page_size != state.live.page:
        if guard.first_time("transfer page size"):
            logger.warning("sglang_oobguard: KV transfer pages of %d tokens on a pool paged by %d: not checked",
                           page_size, state.live.page)
        return
    pages = np.asarray(queue._transfer_page_indices(decode_req, kv_indices, page_size), dtype=np.int64).reshape(-1)
    req = decode_req.req
    row = queue.req_to_token_pool.req_to_token[getattr(getattr(req, "kv", req), "req_pool_idx")]
    prefix = int(kwargs.get("decode_prefix_len") or 0)
    own = (row[prefix:len(req.origin_input_ids)][::page_size] // page_size).cpu().numpy().astype(np.int64)
    room = getattr(req, "bootstrap_room", None)
    inside = check_pages(guard, state, SEND_LABEL, pages, own, own_row=False, request=str(req.rid), room=room)
    guard.held["pd"].add(Transfer(state, pages[inside], str(req.rid), room, guard.steps.number,
                                 decode_req.kv_receiver, decode_req))


def _shadow(guard: Guard, allocator: Any) -> Optional[PoolState]:
    """The state whose shadow holds a transfer's KV page ids: the allocator's, or an SWA
    allocator's full sub-allocator's (req_to_token's ids; its SWA pages: said once, not checked)."""
    sub = full_space(allocator)
    state: Optional[PoolState] = getattr(sub, "__dict__", {}).get(LIVE_ATTR)
    if sub is not allocator and type(allocator).__name__ in SWA_CHECKED and guard.first_time("transfer swa pages"):
        logger.warning("sglang_oobguard: PD transfer check on %s: %s", type(allocator).__name__, SWA_STATE_PAGES)
    return None if state is None or state.live is None else state


def check_pages(guard: Guard, state: PoolState, label: str, pages: np.ndarray, own: np.ndarray, own_row: bool,
                **where: Any) -> np.ndarray:
    """Report the first bad page of a KV transfer: outside the page space, not live, or not
    the request's own (`own`: its pages in order, or with `own_row` any page of its row).
    Returns which pages are inside the page space."""
    assert state.live is not None
    guard.counts.add("pd", "transfers")
    high = state.live.pages
    inside, _, live, _ = hostscan.look_up(pages, state.live.as_pages())
    kinds = np.full(pages.shape, -1)
    kinds[~inside] = Kind.BOUNDS
    kinds[inside & ~live] = Kind.FREED
    expected = np.full(pages.shape, -1)
    if own_row:
        kinds[(kinds < 0) & ~np.isin(pages, own)] = Kind.OTHER_REQUEST
    else:
        expected[:min(len(own), len(pages))] = own[:len(pages)]
        kinds[(kinds < 0) & (expected != pages)] = Kind.OTHER_REQUEST
    bad = np.flatnonzero(kinds >= 0)
    if bad.size:
        pos = int(bad[0])
        record = Record.ownership(site=site_id(label), high=high, numel=pages.size, bad=int(bad.size), pos=pos,
                                  value=int(pages[pos]), step=guard.steps.number, kind=int(kinds[pos]),
                                  expected=int(expected[pos]))
        guard.report_now(state, record, **where)
    return inside


def source(guard: Guard, sender: Any, page_indices: Any, *rest: Any, **kwargs: Any) -> None:
    """Prefill: the source pages one KV sender's send gets, inside `_send_kv_chunk`."""
    if guard.held["pd"].sending is None or kwargs.get("indices_event") is not None:
        return  # outside a chunk send; or a pinned copy still landing (its event not reached): not read
    scheduler, req = guard.held["pd"].sending
    if getattr(req, "disagg_kv_sender", None) is not sender:
        return
    state = _shadow(guard, scheduler.token_to_kv_pool_allocator)
    if state is None:
        return
    page = state.live.page
    pages = np.asarray(page_indices.cpu() if isinstance(page_indices, torch.Tensor) else page_indices,
                       dtype=np.int64).reshape(-1)
    row = scheduler.req_to_token_pool.req_to_token[getattr(getattr(req, "kv", req), "req_pool_idx")]
    own = np.unique((row[:len(req.origin_input_ids)] // page).cpu().numpy())
    check_pages(guard, state, SOURCE_LABEL, pages, own, own_row=True, request=str(req.rid),
                room=getattr(req, "bootstrap_room", None))


def polled(guard: Guard, queue: Any, polls: Any) -> None:
    """The polls of the transfer queue, one per request in its queue: Success ends a
    transfer; Failed ends it when the drain signal says so (`Transfer.ended`)."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    book = guard.held["pd"]
    for decode_req, poll in zip(queue.queue, polls):
        transfer = book.by_request.get(id(decode_req))
        if transfer is None:
            continue
        if poll == KVPoll.Success:
            transfer.succeeded = True
        elif poll == KVPoll.Failed:
            transfer.failed = True
    book.settle()


def on_free(guard: Guard, state: PoolState, site: int, ids: torch.Tensor, in_pages: bool,
            free: Callable[[torch.Tensor], Any]) -> Optional[torch.Tensor]:
    """A free on the host: report the in-flight pages it names. Returns the ids to free
    now (warn mode: the others, held back until their transfer ends), or None: free all."""
    book = guard.held["pd"]
    if not book.by_key or state.serial not in book.tables:
        return None
    book.settle()
    assert state.live is not None
    guard.counts.add("pd", "frees")
    flat = ids.reshape(-1).to(torch.int64).numpy()
    pages = flat if in_pages else flat // state.live.page
    keys = book.in_flight(state, pages)
    hit = keys != 0
    if not hit.any():
        return None
    pos = int(np.argmax(hit))
    transfer = book.by_key[int(keys[pos])]
    held = ids.reshape(-1)[torch.from_numpy(hit)]
    if guard.config.mode is Mode.WARN:
        if not transfer.held:
            transfer.held_since = time.monotonic()
        transfer.held.append((free, held.clone()))
    count = int(np.unique(pages[hit]).size)
    record = Record.bad_ids(site=site, high=state.live.pages, numel=int(np.unique(pages).size), bad=count, pos=pos,
                            value=int(pages[pos]), step=guard.steps.number, kind=Kind.IN_FLIGHT)
    guard.report_now(state, record, request=transfer.rid, room=transfer.room, sent_step=transfer.step,
                     no_drain=transfer.undrained())
    return ids.reshape(-1)[torch.from_numpy(~hit)]


def make_hook(kind: str, guard: Guard, wrap_send: Callable[[type], None]) -> Callable[..., Any]:
    """The wrapt wrapper of one TRANSFER_HOOKS method; the guard's own work never
    raises into sglang, only a reported violation does (strict, raise). `wrap_send`
    wraps a KV sender class's send (prefill: the backend's class is known at the send)."""

    def quietly(work: Callable[[], Any]) -> None:
        try:
            work()
        except KVOutOfBoundsError:
            raise
        except Exception as exc:
            guard.internal_error(f"KV transfer {kind}", exc)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if "pd" not in guard.config.checks:  # (pd needs liveness: `model.switches.NEEDS`)
            return wrapped(*args, **kwargs)
        if kind == "send":
            quietly(lambda: send(guard, instance, *args, **kwargs))
            return wrapped(*args, **kwargs)
        if kind == "source":
            quietly(lambda: source(guard, instance, *args, **kwargs))
            return wrapped(*args, **kwargs)
        if kind == "prefill":
            req = args[0] if args else kwargs.get("req")
            owner = next((c for c in type(getattr(req, "disagg_kv_sender", None)).__mro__ if "send" in c.__dict__),
                         None)
            if owner is not None and owner is not object:
                quietly(lambda: wrap_send(owner))
            outer, guard.held["pd"].sending = guard.held["pd"].sending, (instance, req)
            try:
                return wrapped(*args, **kwargs)
            finally:
                guard.held["pd"].sending = outer
        result = wrapped(*args, **kwargs)
        if kind == "poll":
            quietly(lambda: polled(guard, instance, result))
        elif kind == "resolve":
            quietly(guard.held["pd"].settle)
        elif kind == "pending" and not result:
            return guard.held["pd"].holding()
        return result

    return wrapper


def hook(module: Any, guard: Guard, wrap: Wrap) -> None:
    """Wrap what TRANSFER_HOOKS name in `module` (PD's decode and prefill queues), as it imports."""
    def wrap_send(cls: type) -> None:  # a KV sender class, as the first send of its backend comes
        wrap(cls, "send", make_hook("source", guard, wrap_send))

    for where, owner, method, kind in TRANSFER_HOOKS:
        if where != module.__name__:
            continue
        cls = getattr(module, owner, None)
        if cls is None or method not in cls.__dict__:
            logger.warning("sglang_oobguard: %s.%s.%s not found: the KV transfer check misses it", where, owner, method)
            continue
        wrap(cls, method, make_hook(kind, guard, wrap_send))


def where() -> Optional[str]:
    """Why the check does not run on this sglang (read from its classes), or None."""
    lacks = [f"{owner}.{method}" for module, owner, method in TRANSFER_ENTRIES if defines(module, owner, method) is False]
    return f"this sglang has no {' or '.join(lacks)} (sglang {TRANSFER_SINCE}+)" if lacks else None


def doctor(found: Found) -> list[str]:
    return [f"KV transfers (PD disaggregation, sglang {TRANSFER_SINCE}+, with liveness; only the ids are seen, the "
            "transfer engine's RDMA write itself is not observable):",
            *(f"  {owner + '.' + method:48} {HOOK_ROLES[kind]}: {found(module, owner, method)}"
              for module, owner, method, kind in TRANSFER_HOOKS),
            f"  every backend's transfers (mooncake, nixl, mori, ascend, fake); an aborted one ends at the drain "
            f"signal kv_mgr.{DRAIN_SIGNAL} (armed by {DRAIN_ARMED}), never at sglang's release-anyway timeout;",
            f"  {NO_DRAIN}; the prefill side's sends are checked where a sender's send is wrapped at its first call"]


UNIT = Unit("pd", "PD disaggregation: pages freed while a KV transfer into them is in flight, and each "
            "transfer's pages live and the request's own", "per transfer and per free: O(pages)",
            ("transfers", "frees"), "PD's decode and prefill queues; the tracked allocators' frees",
            where=where, feature="PD disaggregation", state=Transfers, modules=TRANSFER_MODULES, hook=hook,
            doctor=doctor)
