"""Read map: the read check of one step on the host (every slot each request reads).

Attention reads every slot of `req_to_token[row, 0:seq_len]` of every request in the
batch. A slot freed under its reader, or freed and handed to another request, is read
silently: the write checks never see it (the new holder writes its own slot
correctly). So per (row, position) the guard keeps the slot and the generation it
saw when this request first held that position (`Seen`), and at each step, for every
position read (flat, vectorized over sum(seq_lens)):

- READ_FREED: the slot's page is not handed out (any position read);
- REPOINTED: a position already read names another slot now while the slot it
  named before is still handed out as it was (the radix cache's dedup after a
  prefill repoints a request to the tree's copy and frees its own: that passes; so
  does any change in an extend, which maps a prefix anew: radix matches, chunked
  prefill, re-admission after retraction);
- READ_REUSED: the same slot, handed out again since (its generation changed), and
  its owner (the write map's owner table) is not this request's row at a position
  this step writes; a slot the request itself was given again where it writes now
  (spec decoding's rolled-back positions, a retracted request's new prefill) passes.

A position is new to its request when it lies past what the row's request had read
at its last step (`checked`, reset when the row holds another request): its slot is
then only required to be live. Radix-shared prefixes are read by many rows at once,
each with its own copy of the generation: they raise nothing.

On a GPU the same contract is one launch (`readkernel`, one program per batch row), with `Seen`
in device memory.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from .kernels import SCRATCH_INIT
from .record import Kind
from .hostscan import look_up
from .shadow import Live


class Seen:
    """What the read check remembers per (req_to_token row, position): tensors on the
    table's device (the host path reads them through numpy views), made with sglang's
    ReqToTokenPool (`checks.reads.make_table_hook`: when sglang sizes its pools, never
    while serving or capturing) and never reallocated while the table keeps its shape."""

    def __init__(self, rows: int, cols: int, where: torch.device = torch.device("cpu")) -> None:
        # int32, as req_to_token: a slot id fits; a generation is kept modulo 2^32 (only compared for equality)
        self.slot = torch.full((rows, cols), -1, dtype=torch.int32, device=where)  # the slot read there last
        self.gen = torch.zeros((rows, cols), dtype=torch.int32, device=where)  # its generation when first read there
        self.checked = torch.zeros(rows, dtype=torch.int64, device=where)  # positions the row's request has read
        # the read kernel's: each batch row's first bad read (kind, slot, generation, owner), and its programs'
        # running sums (kernels.SCRATCH_INIT: bad reads, least row * ncols + position, arrivals; then reads)
        self.found = torch.zeros((rows, 4), dtype=torch.int64, device=where)
        self.scratch = torch.tensor((*SCRATCH_INIT, 0), dtype=torch.int64, device=where)
        self.holder: list[object] = [None] * rows  # the request (rid) the row was checked for
        self.warm = False  # the read kernel compiled for this table (device path)
        self.readers = None  # the host path's read counts (`readcount.Readers`), made at its first step

    @staticmethod
    def bytes_for(rows: int, cols: int) -> int:
        """Device bytes of a Seen for a req_to_token of rows x cols: 8 per entry, 40 per row."""
        return rows * cols * 8 + rows * 40 + 8 * (len(SCRATCH_INIT) + 1)

    def fits(self, table: torch.Tensor) -> bool:
        return tuple(self.slot.shape) == tuple(table.shape) and self.slot.device == table.device


class ReadFinding(NamedTuple):
    kind: int  # Kind.READ_FREED, READ_REUSED or REPOINTED
    bad: int  # positions read wrong in this step
    numel: int  # positions read
    row: int  # the reader's index in the batch
    position: int  # the position read
    slot: int
    seen: int  # the generation the reader first saw there (READ_REUSED), else -1
    owner: int  # the owner table's row of the slot (liveness), -1 none


def check_reads(seen: Seen, table: np.ndarray, rows: np.ndarray, lens: np.ndarray, extend: bool, live: Live,
                high: int, written: Optional[np.ndarray] = None) -> Optional[ReadFinding]:
    """Check one step's reads (rows: req_pool_indices, lens: seq_lens, host int64
    arrays of the batch's real requests) and remember them. `written`: per request,
    the first position this step writes (None: any). None when clean."""
    ncols = table.shape[1]
    lens = np.minimum(lens, ncols)
    total = int(lens.sum())
    if not total:
        return None
    reader = np.repeat(np.arange(rows.size), lens)
    position = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    flat = np.repeat(rows, lens) * ncols + position
    slots = table.reshape(-1).take(flat).astype(np.int64, copy=False)
    page = live.page
    # padding slot 0 and bad ids are not inside: the write checks' (bounds)
    inside, pages, alive, gen = look_up(slots, live, high, low=page, generation=True)
    gen = gen.astype(np.int32)  # modulo 2^32, as Seen keeps it
    seen_slot, seen_gen, checked = seen.slot.numpy().reshape(-1), seen.gen.numpy().reshape(-1), seen.checked.numpy()
    old = position < np.repeat(checked[rows], lens)
    before, first_gen = seen_slot.take(flat), seen_gen.take(flat)
    changed = before != slots
    freed = inside & ~alive
    repointed = np.zeros_like(freed) if extend else inside & old & changed
    if repointed.any():  # the old slot still held as it was: not a dedup (the radix cache frees the duplicate)
        was = look_up(before, live, high, low=page, generation=True)
        repointed &= was.live & (was.generation.astype(np.int32) == first_gen)
    reused = inside & alive & old & ~changed & (gen != first_gen)
    if reused.any():  # the request's own slot given again (a rolled-back position) passes
        owner = live.owner.numpy().take(pages) if live.owner is not None else np.zeros_like(pages)
        mine = owner == np.repeat(rows, lens) + 1
        if written is not None:  # ... at a position this step writes again, not one it read before
            mine &= position >= np.repeat(written, lens)
        reused &= ~mine
    bad = freed | repointed | reused
    seen_slot[flat] = slots
    seen_gen[flat] = gen  # a position reported is reported once, then read as it is now
    checked[rows] = lens
    if not bad.any():
        return None
    at = int(np.argmax(bad))
    kind = Kind.READ_FREED if freed[at] else Kind.REPOINTED if repointed[at] else Kind.READ_REUSED
    owner_row = int(live.owner[int(pages[at])]) - 1 if live.owner is not None else -1
    return ReadFinding(int(kind), int(bad.sum()), total, int(reader[at]), int(position[at]), int(slots[at]),
                       int(first_gen[at]) if kind == Kind.READ_REUSED else -1, owner_row)


def forget_changed_holders(seen: Seen, rows: list[int], holders: list[object]) -> None:
    """A row handed to another request starts over: nothing of it read yet. (A
    request retracted and admitted again on its old row comes back in an extend,
    which may map its positions anew.)"""
    for row, holder in zip(rows, holders):
        if seen.holder[row] != holder:
            seen.holder[row] = holder
            seen.checked[row] = 0
