"""In flight: the PD decode transfers the guard counts as still writing, and warn mode's hold of their pages.

A transfer is in flight from its send until it has really ended: a Success poll; or,
after a Failed poll (an abort, a failure on either side), the backend's drain signal
(`kv_mgr.is_abort_release_safe`, armed by sglang's deferred release). Neither a Failed
poll nor sglang's release-anyway timeout is an end: the prefill side's RDMA writes may
still land (#23020). A backend with no drain signal (the fake one, any with the deferred
release off) cannot say when they stop, so a failed transfer there stays in flight: its
pages' free is reported, "may still be in flight (no drain signal)". Warn mode holds
pages freed in flight back from the free list until the transfer ends, and at most
sglang's own deferred-release timeout from the free (logged): a backend without a drain
signal can only be given that long, the time sglang itself allows a write to drain.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Any, Callable, Optional

import numpy as np

from ..model.log import logger
from ..model.transfertargets import DRAIN_ARMED, DRAIN_SIGNAL
from ..probes.pools import PoolState


@dataclasses.dataclass(eq=False)
class Transfer:
    """One request's KV transfer into decode pages, from its send on."""

    state: PoolState  # the destination pool's (its shadow's page space)
    pages: np.ndarray  # page ids, int64
    rid: str
    room: Optional[int]
    step: int  # the forward step number when it was sent
    receiver: Any  # sglang's KVReceiver: its manager gives the drain signal
    request: Any  # the DecodeRequest (kept while in flight, for its id)
    failed: bool = False
    succeeded: bool = False
    held: list = dataclasses.field(default_factory=list)  # warn mode: (the allocator's free, ids) held back
    held_since: float = 0.0
    key: int = 0  # its number in Transfers

    def ended(self) -> bool:
        """Succeeded; or failed and drained, as the backend's drain signal says (what sglang
        asks it). A failed transfer on a backend with no drain signal never ends here: its
        writes may still run (`undrained`), and only the hold limit gives its pages back."""
        if self.succeeded:
            return True
        if not self.failed:
            return False
        drained = drain_signal(self.receiver)
        if drained is None:
            return False
        acks = len(getattr(self.receiver, "bootstrap_infos", None) or ()) \
            if getattr(self.receiver, "abort_notified", False) else 0
        return bool(drained(self.room, acks))

    def undrained(self) -> bool:
        """Failed where the backend cannot say its writes drained: they may still be on their way."""
        return self.failed and not self.succeeded and drain_signal(self.receiver) is None


def drain_signal(receiver: Any) -> Optional[Callable[[Optional[int], int], bool]]:
    """The receiver's manager's drain signal (`is_abort_release_safe`), where sglang's deferred
    release armed it; None where the backend cannot say when an aborted transfer's writes end."""
    manager = getattr(receiver, "kv_mgr", None)
    drained = getattr(manager, DRAIN_SIGNAL, None)
    return drained if callable(drained) and getattr(manager, DRAIN_ARMED, False) else None


def _hold_limit_s() -> float:
    """sglang's own deferred-release timeout: a hold never outlasts what sglang would wait."""
    try:
        from sglang.srt.environ import envs

        return float(envs.SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT.get())
    except Exception:
        return 30.0


class Transfers:
    """The guard's transfers in flight: by request, and per pool a table from page to transfer."""

    def __init__(self) -> None:
        self.by_request: dict[int, Transfer] = {}
        self.by_key: dict[int, Transfer] = {}
        self.tables: dict[int, np.ndarray] = {}  # pool serial -> per page (then a sink): its transfer's key, 0: none
        self._keys = itertools.count(1)
        self.sending: Optional[tuple[Any, Any]] = None  # prefill: (scheduler, req) inside _send_kv_chunk

    def add(self, transfer: Transfer) -> None:
        self.drop(self.by_request.get(id(transfer.request)))
        transfer.key = next(self._keys)
        self.by_request[id(transfer.request)] = self.by_key[transfer.key] = transfer
        assert transfer.state.live is not None
        table = self.tables.get(transfer.state.serial)
        if table is None or table.size != transfer.state.live.pages + 1:
            table = self.tables[transfer.state.serial] = np.zeros(transfer.state.live.pages + 1, dtype=np.int64)
            for other in self.by_key.values():
                if other.state is transfer.state:
                    table[other.pages] = other.key
        table[transfer.pages] = transfer.key

    def drop(self, transfer: Optional[Transfer]) -> None:
        if transfer is None or self.by_key.pop(transfer.key, None) is None:
            return
        if self.by_request.get(id(transfer.request)) is transfer:
            del self.by_request[id(transfer.request)]
        table = self.tables.get(transfer.state.serial)
        if table is not None:
            pages = transfer.pages[table[transfer.pages] == transfer.key]
            table[pages] = 0

    def in_flight(self, state: PoolState, pages: np.ndarray) -> np.ndarray:
        """Per page: the key of the transfer in flight into it, 0 for none."""
        table = self.tables[state.serial]
        return table[np.where((pages >= 0) & (pages < table.size - 1), pages, table.size - 1)]

    def forget(self, state: PoolState) -> None:
        """The allocator's clear: every page went back, held ones too."""
        for transfer in list(self.by_key.values()):
            if transfer.state is state:
                self.drop(transfer)

    def holding(self) -> bool:
        return any(transfer.held for transfer in self.by_key.values())

    def settle(self) -> None:
        """Drop the transfers that ended; give back what warn mode held of them."""
        limit = None
        for transfer in list(self.by_key.values()):
            overdue = False
            if transfer.held and not transfer.ended():
                limit = _hold_limit_s() if limit is None else limit
                overdue = time.monotonic() - transfer.held_since >= limit
                if not overdue:
                    continue
                logger.warning("sglang_oobguard: %s for the KV transfer of request %s (bootstrap room %s) after "
                               "%.0f s: the %d pages held back go to the free list now",
                               "the backend has no drain signal" if transfer.undrained() else "no drain signal",
                               transfer.rid, transfer.room, limit, len(transfer.pages))
            elif not transfer.ended():
                continue
            elif transfer.held:
                logger.info("sglang_oobguard: the KV transfer of request %s (bootstrap room %s) ended: the %d pages "
                            "held back go to the free list", transfer.rid, transfer.room, len(transfer.pages))
            self.drop(transfer)
            for free, ids in transfer.held:
                free(ids)
            transfer.held.clear()
