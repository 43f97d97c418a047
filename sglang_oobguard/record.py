"""Record: a pool's running totals and first violation, where the probes fold them.

One layout, `Record`'s fields in order, serves both probe paths: the kernel stores
each field at its index (`OFFSET`), the host scan folds into the same tensor with
`fold_host`. On a GPU the record is read back without a host sync: a pinned host
mirror is refreshed by an async copy, and read only once its event has completed
(`poll`), so a report lands at most one poll later (a forward step's end starts the
copy, the next step's start reads it). `read_now` is the explicit check
point, which may sync.
"""

from __future__ import annotations

import enum
from typing import NamedTuple, Optional

import torch

from . import device as device_mod


class Kind(enum.IntEnum):
    """What was wrong with the first bad id of a record (its `kind` field)."""

    BOUNDS = 0  # outside [0, high)
    FREED = 1  # inside, on a slot the allocator does not hold as handed out (liveness)
    DOUBLE_FREE = 2  # a free of a slot that is not handed out (liveness)
    OTHER_REQUEST = 3  # out_cache_loc differs from the token's own slot in req_to_token (write map)
    DUPLICATE = 4  # the same slot written by two tokens of one forward step
    SHARED_ROW = 5  # two requests of one forward step share a req_to_token row
    OWNED = 6  # a slot written by one request while another running request owns it (liveness)


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


RECORD_LEN = len(Record._fields)
OFFSET = {name: i for i, name in enumerate(Record._fields)}  # the kernel's store offsets


def fold_host(record: torch.Tensor, call: Record) -> None:
    """Fold one violating call (its own totals and first bad id) into a host record,
    exactly as the kernel does: totals add up, the first call's details stay."""
    old = Record(*record.tolist())
    new = call if not old.calls else old._replace(total_bad=old.total_bad + call.total_bad, calls=old.calls + 1)
    record.copy_(torch.tensor(new, dtype=torch.int64))


class PoolRecord:
    """One pool's device record and the host side of reading it back."""

    def __init__(self, device: torch.device) -> None:
        self.tensor = torch.zeros(RECORD_LEN, dtype=torch.int64, device=device)
        on_gpu = device_mod.is_gpu(device)
        self._mirror = device_mod.pinned(self.tensor)
        self._mirror_view = self._mirror.numpy()  # plain memory reads: no torch op, no sync
        self._copied = device_mod.event(device)
        self._pending = False  # a mirror copy was enqueued and not read yet
        self.reported = 0  # violating calls already reported

    def poll(self, restart: bool = True) -> Optional[Record]:
        """The record as of the last landed mirror copy, then (restart) start the next
        copy; a step boundary leaves that to the step's end. Never waits: an unfinished
        copy is left for the next poll; None when nothing new can be read yet (and
        under graph capture, when no copy may be enqueued)."""
        if self._copied is not None and device_mod.capturing():
            return None
        if self._pending and self._copied is not None and not self._copied.query():
            return None
        landed = Record(*self._mirror_view.tolist()) if self._pending else None
        self._pending = False
        if restart:
            self.start_copy()
        return landed

    def start_copy(self) -> None:
        """Enqueue the mirror's refresh behind what the stream has enqueued so far (a
        step's end: its probes), so the next poll can read it. Not under graph capture."""
        if self._copied is not None and device_mod.capturing():
            return
        device_mod.copy_async(self._mirror, self.tensor)
        if self._copied is not None:
            self._copied.record()
        self._pending = True

    def read_now(self) -> Record:
        """The record as it is now (a host read: may sync on a GPU)."""
        return Record(*device_mod.read(self.tensor))

    def unreported(self, record: Optional[Record]) -> bool:
        """True once per new violating call count: the caller then reports `record`."""
        if record is None or record.calls <= self.reported:
            return False
        self.reported = record.calls
        return True


SLOTS = 1
