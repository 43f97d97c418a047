"""Shadow: the liveness shadow of one pool, and the updates its allocator makes to it.

One int32 flag per page of the allocator's id space, set while the allocator has
that page handed out; page 0, the padding page that is never handed out, is exempt
from the checks. `owner` holds, per page, the req_to_token row (+1) of the request
that first wrote it since it was handed out (0: none yet): the ownership check's
table. Both are made once per allocator and zeroed in place, never reallocated,
so a captured CUDA graph that reads them never reads freed memory.

`history` is each page's story, for the reports and the read check: its generation
(the serial number of the allocator call that last handed it out: it rises at every
allocation), and the step and call site (`model.callsite`, packed) of its last
allocation and its last free. The host knows the values at the allocator call, so
on a GPU they are written like the flags: one index_fill_ each, no host sync. On the
CPU every table is written through its memory (`Live.memory`), without a torch op: an
allocator call of a few ids writes its flags, owners and history in well under a
microsecond (a torch row select and `.numpy()` per table cost about 3 us).

Every index operation here is bounds-checked: an id outside the shadow is left
alone (the bound checks report it), never an IndexError inside sglang's allocator.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from ..model.callsite import NONE

GEN, ALLOCATED, FREED = range(3)  # the rows of Live.history
_FLAGS, _OWNER, _HISTORY = 0, 1, 2  # the tables of Live.memory: flags, owner, then each history row
_serials = itertools.count(1)  # generations: one serial per allocator call, over all pools


def serial() -> int:
    """The next serial: a request row's hand-out takes one too (`checks.rows`), so a row's holder
    at the time a page was handed out can be told by the page's generation."""
    return next(_serials)


class Live(NamedTuple):
    """A pool's liveness shadow: flags[id // page] != 0 while that page is handed out.
    Each table has one more entry than pages: the sink, where an update of an id
    outside the shadow lands (no host sync to filter it out on a GPU); no check reads it."""

    flags: torch.Tensor  # int32 (the free kernel exchanges flags atomically), one per page, then the sink
    page: int  # ids per flag: the allocator's page size (1: per slot)
    host: Optional[memoryview] = None  # a CPU shadow's memory: the host scan reads it without torch ops
    owner: Optional[torch.Tensor] = None  # int32 per page: the owning req_to_token row + 1, 0 for none
    history: Optional[torch.Tensor] = None  # int64 (3, pages + 1): GEN, ALLOCATED, FREED (callsite.pack)
    memory: tuple = ()  # a CPU shadow's tables as memoryviews (_FLAGS, _OWNER, _HISTORY + row; None: off)
    # a CPU shadow's watchers (`probes.readcount.Readers`): told of every page that changes hands
    # (`touched(pages)`) and of a shadow cleared or restored (`reset()`); a GPU shadow has none
    watchers: Optional[list] = None

    @property
    def pages(self) -> int:
        return self.flags.numel() - 1

    @property
    def high(self) -> int:
        """The ids the shadow covers: [0, high)."""
        return self.pages * self.page

    def as_pages(self) -> "Live":
        """The same shadow, indexed by page ids instead of token ids."""
        return self._replace(page=1)


PAGE_BYTES = {"flags": 4, "owner": 4, "story": 24}  # per page (and one sink page): what `new_live` makes


def new_live(pages: int, page: int, device: torch.device, owners: bool = True, history: bool = True) -> Live:
    """A shadow all free; `owners`, `history`: whether the owner check and slot history are on
    (a table that is off is not kept at all, so no check can read it and nothing writes it)."""
    flags = torch.zeros(pages + 1, dtype=torch.int32, device=device)
    owner = torch.zeros(pages + 1, dtype=torch.int32, device=device) if owners else None
    story = None
    if history:
        story = torch.full((3, pages + 1), NONE, dtype=torch.int64, device=device)
        story[GEN].zero_()
    if flags.is_cuda:
        return Live(flags, page, None, owner, story)
    tables = (flags.numpy(), None if owner is None else owner.numpy(), *((None,) * 3 if story is None else story.numpy()))
    memory = tuple(None if table is None else memoryview(table) for table in tables)
    return Live(flags, page, memory[_FLAGS], owner, story, memory, [])


FEW = 32  # up to this many ids, a CPU shadow's pages are worked out in plain Python


def _pages(live: Live, ids: torch.Tensor, host: bool, opening: bool = False) -> Union[torch.Tensor, np.ndarray, list]:
    """The page of each id; an id outside the shadow gets the sink (left to the bound
    checks). `host`: the caller checks these ids on the host (`Guard.on_host`); then,
    for a CPU shadow, host values (numpy indexes the same memory at a fraction of a
    torch op's fixed cost, a list for a few ids less still). Otherwise device ops.
    `opening`: only ids at a page's offset 0 count (the others get the sink)."""
    flat = ids.reshape(-1)
    opening = opening and live.page > 1
    if host and live.memory and flat.is_cpu:
        return _host_pages(live, flat, opening)
    flat = flat.to(live.flags.device, torch.int64)
    keep = (flat >= 0) & (flat < live.high)
    if opening:
        keep &= flat % live.page == 0
    return torch.where(keep, flat // live.page, live.pages)


def _host_pages(live: Live, flat: torch.Tensor, opening: bool) -> Union[np.ndarray, list]:
    """`_pages` of CPU ids for a CPU shadow, as host values."""
    high, page, sink = live.high, live.page, live.pages
    if flat.numel() <= FEW:
        return [i // page if 0 <= i < high and not (opening and i % page) else sink for i in flat.tolist()]
    values = flat.numpy()
    keep = (values >= 0) & (values < high)
    if opening:
        keep &= values % page == 0
    return np.where(keep, values // page, sink)


def _fill(live: Live, table: int, pages: Union[torch.Tensor, np.ndarray, list], value: int) -> None:
    """One of the shadow's tables (_FLAGS, _OWNER, _HISTORY + row) at `pages` = value:
    index_fill_ for device pages; host pages (only a shadow with `memory` has them)
    through the table's memory, a few one by one, more through numpy."""
    if isinstance(pages, torch.Tensor):
        tensor = live.flags if table == _FLAGS else live.owner if table == _OWNER else live.history[table - _HISTORY]
        tensor.index_fill_(-1, pages, value)
    elif isinstance(pages, list):
        memory = live.memory[table]
        for page in pages:
            memory[page] = value
    else:
        np.asarray(live.memory[table])[pages] = value


def mark(live: Live, ids: torch.Tensor, event: int = NONE, host: bool = False) -> None:
    """The allocator handed these ids out: their pages are live. A page opened by this
    call (an id at its offset 0: taken off the free list) has no owner yet, a new
    generation, and `event` (callsite.pack: step and site) as its last allocation; a
    page the call only continues (a request's half-filled last page, paged allocators)
    keeps its owner and history: its earlier slots are still the same request's."""
    pages = _pages(live, ids, host)
    _fill(live, _FLAGS, pages, 1)
    if live.owner is None and live.history is None:
        return
    opened = _pages(live, ids, host, opening=True) if live.page > 1 else pages
    for watcher in live.watchers or ():  # only a page opened changes hands (its generation); not one continued
        watcher.touched(opened)
    if live.owner is not None:
        _fill(live, _OWNER, opened, 0)
    if live.history is not None:
        _fill(live, _HISTORY + GEN, opened, next(_serials))
        _fill(live, _HISTORY + ALLOCATED, opened, event)


def release(live: Live, ids: torch.Tensor, event: int = NONE, host: bool = False) -> None:
    """The pages of these ids went back to the free list: not live, no owner, `event`
    their last free."""
    pages = _pages(live, ids, host)
    _fill(live, _FLAGS, pages, 0)
    for watcher in live.watchers or ():
        watcher.touched(pages)
    if live.owner is not None:
        _fill(live, _OWNER, pages, 0)
    if live.history is not None:
        _fill(live, _HISTORY + FREED, pages, event)


def host_generations(live: Live) -> Optional[memoryview]:
    """A CPU shadow's generation per page (int64), for a host check's plain-Python path; None: no history."""
    return live.memory[_HISTORY + GEN] if live.memory else None


def story(live: Live, page: int) -> Optional[tuple[int, int, int, int]]:
    """(generation, last allocation, last free, owner row + 1) of one page (a report's
    read: may sync); None outside the shadow."""
    if live.history is None or not 0 <= page < live.pages:
        return None
    gen, allocated, freed = (int(v) for v in live.history[:, page].tolist())
    return gen, allocated, freed, 0 if live.owner is None else int(live.owner[page])


def clear(live: Live) -> None:
    """Everything went back (the allocator's clear): zeroed in place."""
    live.flags.zero_()
    for watcher in live.watchers or ():
        watcher.reset()
    if live.owner is not None:
        live.owner.zero_()


def restore(live: Live, saved: torch.Tensor) -> None:
    """The allocator went back to a saved state (`restore_state`): its flags, copied in place."""
    live.flags.copy_(saved)
    for watcher in live.watchers or ():
        watcher.reset()
