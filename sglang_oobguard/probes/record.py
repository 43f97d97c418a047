"""Record: a pool's running totals and first violation, where the probes fold them.

One layout, `Record`'s fields in order, serves both probe paths: the kernel stores
each field at its index (`OFFSET`), the host scan folds into the same tensor with
`fold_host`. On the GPU branch the record is read back without a host sync: a ring of
pinned host mirrors, each refreshed by an async copy and read only once its own event
has completed (`poll`); with the host `lag` steps ahead of the device, a violation in
step N is reported at step N + lag + 1's start. `flush` (exit, idle, check points)
and `read_now` may wait. All CUDA calls go through `device`.
"""

from __future__ import annotations

import threading
from typing import NamedTuple, Optional

import torch

from ..model.violation import Kind
from . import device


class Record(NamedTuple):
    """A pool's record, read back."""

    total_bad: int  # bad ids, summed over every violating call
    calls: int  # violating calls
    site: int  # first violation: its site id (report.site_label names it)
    layer: int  # first violation: layer id (-1 when unknown)
    high: int  # first violation: the exclusive bound
    bad: int  # first violation: bad ids in that call
    numel: int  # first violation: ids in that call
    pos: int  # first violation: position of the first bad id
    value: int  # first violation: its value
    step: int  # first violation: the forward step it came from (-1: outside any step)
    kind: int = Kind.BOUNDS  # first violation: what was wrong (Kind)
    row: int = -1  # first violation: the writing request's row in the step's batch (-1: unknown)
    expected: int = -1  # first violation: the token's own slot per req_to_token (-1: not checked)
    owner: int = -1  # first violation: the req_to_token row that owns the slot (-1: unknown)
    # A non-finite value (Kind.NONFINITE): `bad` counts values, `pos` is the token's place in
    # the write's ids and `value` its slot (-1: a per-write part such as a scale, no token).
    # Read for that kind only; 0 otherwise, as the id probes leave them.
    # A position or token (`position`): `owner` and `head` keep its draft step and lowest position.
    head: int = 0  # first violation: the head (dim 1 of a 3-D part; -1: none)
    elem: int = 0  # first violation: which non-finite value (violation.ELEMENTS)
    part: int = 0  # first violation: which argument held it (violation.part_name)

    # One violating call's record, one constructor per kind of finding: callers name
    # every field, so none depends on the layout's order (the kernels' OFFSET).

    @classmethod
    def bad_ids(cls, *, site: int, high: int, numel: int, bad: int, pos: int, value: int, step: int,
                kind: int = Kind.BOUNDS, layer: int = -1, expected: int = -1) -> "Record":
        """Ids outside the bound or the shadow: a write's, a free's or a transfer's (bounds,
        liveness, a double free, an SWA peer, a page in flight); `expected`: the value the
        check knows the id's place holds (an SWA peer still mapped), else -1."""
        return cls(bad, 1, site, layer, high, bad, numel, pos, value, step, int(kind), expected=expected)

    @classmethod
    def ownership(cls, *, site: int, high: int, numel: int, bad: int, pos: int, value: int, step: int, kind: int,
                  layer: int = -1, row: int = -1, expected: int = -1, owner: int = -1) -> "Record":
        """A slot written (or sent, or loaded into) that is not the writer's own: the write
        map's kinds, ids of a write's own, an SWA id at the door, a PD page, a HiCache load.
        `row`: the writer's row in the step's batch; `expected`: its own slot (page);
        `owner`: the req_to_token row that holds the slot (-1: unknown each)."""
        return cls(bad, 1, site, layer, high, bad, numel, pos, value, step, int(kind), row, expected, owner)

    @classmethod
    def read(cls, *, site: int, high: int, numel: int, bad: int, kind: int, reader: int, position: int, slot: int,
             generation: int, owner: int, step: int) -> "Record":
        """A step's first bad read: the reader's row in the batch (`row`), the position it
        read (`pos`), the slot there (`value`), the generation it first saw there (kept in
        `expected`; -1 but for READ_REUSED) and the slot's owner row."""
        return cls(bad, 1, site, -1, high, bad, numel, position, slot, step, int(kind), reader, generation, owner)

    @classmethod
    def nonfinite(cls, *, site: int, layer: int, high: int, numel: int, bad: int, pos: int, slot: int, step: int,
                  head: int, elem: int, part: int) -> "Record":
        """Non-finite values stored by a write: `bad` counts values, `pos` is the first one's
        token in the write's ids and `slot` that token's slot (-1: a per-write part)."""
        return cls(bad, 1, site, layer, high, bad, numel, pos, slot, step, Kind.NONFINITE, head=head, elem=elem,
                   part=part)


    @classmethod
    def position(cls, *, site: int, numel: int, bad: int, pos: int, value: int, step: int, kind: int, row: int,
                 expected: int, draft_step: int = -1, lowest: int = -1) -> "Record":
        """A token rotated at a wrong position (Kind.POSITION: `value` its positions[i], `expected`
        the highest position allowed, exact: the one) or fed a wrong token (Kind.TOKEN: input_ids[i]
        and its request's). The draft step is kept in `owner`, a tree verify's lowest position in
        `head` (-1 each where there is none); `high` is 0: no slot is wrong."""
        return cls(bad, 1, site, -1, 0, bad, numel, pos, value, step, int(kind), row, expected, draft_step, lowest)


RECORD_LEN = len(Record._fields)
OFFSET = {name: i for i, name in enumerate(Record._fields)}  # the kernel's store offsets


def fold_host(record: torch.Tensor, call: Record) -> None:
    """Fold one violating call (its own totals and first bad id) into a host record,
    exactly as the kernel does: totals add up, the first call's details stay."""
    old = Record(*record.tolist())
    new = call if not old.calls else old._replace(total_bad=old.total_bad + call.total_bad, calls=old.calls + 1)
    record.copy_(torch.tensor(new, dtype=torch.int64))


SLOTS = 4  # pinned mirror slots per record: a copy started at step N's end is read at step N + lag + 1 (lag < SLOTS)


class _Slot:
    """One pinned mirror of the record, its event, and whether a copy into it is unread."""

    __slots__ = ("mirror", "view", "event", "pending")

    def __init__(self, like: torch.Tensor) -> None:
        self.mirror = device.pinned(like)
        self.view = self.mirror.numpy()  # plain memory reads: no torch op, no sync
        self.event = device.event(like.device)  # None: the copy ran at once (a CPU tensor, no model)
        self.pending = False

    def landed(self) -> bool:
        return self.pending and (self.event is None or self.event.query())


class PoolRecord:
    """One pool's device record and the host side of reading it back.

    On the GPU branch the record is read back through a ring of `SLOTS` pinned mirrors,
    each with its own event, used in order: a step's end starts a copy into the next
    free slot, every poll reads each slot whose event has completed (oldest first) and
    frees it, and nothing ever waits. So with the host `lag` steps ahead of the device
    (sglang's overlap scheduler: 1), a violation in step N is read at step
    N + lag + 1's start while lag < SLOTS (a slot is in flight for lag + 1 step ends).
    Beyond, every slot may be in flight at a step's end and its copy is skipped (the
    record only grows: the next copy carries the skipped one's contents), so the bound
    is N + lag + 1 + (lag + 1 - SLOTS). tests/test_gpu_model.py proves both under the
    device model.
    `flush` waits (exit and explicit check points only)."""

    def __init__(self, where: torch.device) -> None:
        self.tensor = torch.zeros(RECORD_LEN, dtype=torch.int64, device=where)
        self._gpu = device.is_gpu(where)
        self._backend = device.backend()  # a record made under a test's device model is flushed under it only
        self._slots = [_Slot(self.tensor) for _ in range(SLOTS if self._gpu else 1)]
        self._next = 0  # the slot the next copy goes to; the oldest in flight when the ring is full
        self._lock = threading.Lock()  # the idle flusher's thread polls too
        self.reported = 0  # violating calls already reported
        self.started = 0  # copies started
        self.skipped = 0  # copies not started: every slot was in flight

    def poll(self, restart: bool = True) -> Optional[Record]:
        """The newest record among the landed copies (None: none landed), then
        (restart) start the next copy; a step boundary leaves that to the step's end.
        Never waits; nothing under graph capture."""
        if self._gpu and device.capturing():
            return None
        with self._lock:
            landed = self._consume()
            if restart:
                self._start()
        return landed

    def _consume(self) -> Optional[Record]:
        """Read and free every landed slot, oldest first; the one with most calls wins
        (copies on two streams may land out of order; a record only grows)."""
        best: Optional[Record] = None
        n = len(self._slots)
        for i in range(self._next, self._next + n):
            slot = self._slots[i % n]
            if slot.landed():
                record = Record(*slot.view.tolist())
                slot.pending = False
                if best is None or record.calls >= best.calls:
                    best = record
        return best

    def start_copy(self) -> None:
        """Enqueue a mirror refresh behind what the current stream has enqueued so far
        (a step's end: its probes), into the next free slot. Not under graph capture."""
        if self._gpu and device.capturing():
            return
        with self._lock:
            self._start()

    def _start(self) -> None:
        slot = self._slots[self._next]
        if slot.pending:
            self.skipped += 1
            return
        device.copy_async(slot.mirror, self.tensor)
        if slot.event is not None:
            slot.event.record()
        slot.pending = True
        self.started += 1
        self._next = (self._next + 1) % len(self._slots)

    def after_fork(self) -> None:
        """A forked child: the parent's idle flusher may have held the lock at the fork."""
        self._lock = threading.Lock()

    def flush(self) -> Optional[Record]:
        """Wait for every copy in flight, then for one more copy of the record as it is
        after all that the current stream enqueued: the record, read back. May wait (an
        event synchronize): process exit, shutdown and check points only."""
        if self._backend is not device.backend() or (self._gpu and device.capturing()):
            return None
        with self._lock:
            for slot in self._slots:
                if slot.pending and slot.event is not None:
                    slot.event.synchronize()
            landed = self._consume()
            self._start()
            slot = self._slots[(self._next - 1) % len(self._slots)]
            if slot.event is not None:
                slot.event.synchronize()
            newer = self._consume()
        return newer if newer is not None else landed

    def read_now(self) -> Record:
        """The record as it is now (a host read: may sync on a GPU)."""
        return Record(*device.read(self.tensor))

    def unreported(self, record: Optional[Record]) -> bool:
        """True once per new violating call count: the caller then reports `record`."""
        if record is None or record.calls <= self.reported:
            return False
        with self._lock:
            if record.calls <= self.reported:
                return False
            self.reported = record.calls
        return True
