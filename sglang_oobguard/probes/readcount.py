"""Read counts: the host read check at the price of what changed, the full check only where needed.

The full read check (`readmap.check_reads`) looks up every (row, position) of the batch
at every step: O(context). Yet a position a request read before can turn bad in only two
ways: its slot's page changes hands (freed or handed out: an allocator event the shadow
sees) or its req_to_token entry names another slot. So per table the guard keeps
(`Readers`), per page of the pool, how many positions of the rows it counts read that
page, and every shadow update tells it the pages that change hands (`touched`): those
still read are suspects. At a step (`check`):

- positions new to a request are looked up, as the full check looks them up;
- the positions a request read before are compared with what it read (each row's
  req_to_token slice against `Seen.slot`, at memory speed); a changed entry is checked
  as the full check checks it (freed, repointed);
- positions no longer read (a shrunk length, a row handed to another request) come off
  the counts, and a suspect that no position reads is dropped; one still read by rows
  outside the batch drops those rows from the counts (a row that is not counted gets the
  full check when it comes back).

That answer is "clean" only where the full check would find nothing and leave `Seen` as
it is. Otherwise (a suspect the batch still reads, a bad entry, a row not counted, one
row twice, a shadow cleared or restored, a finding at the last step) nothing is applied,
the full check runs and the batch's rows are counted anew: the reports are the full
check's, report for report (`tests/test_readcount.py` holds the two to that).

Host memory: 4 bytes per page of the pool and 1 per row, made at the first step.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import numpy as np
import torch

from . import readmap, shadow
from .hostscan import look_up
from .readmap import ReadFinding, Seen
from .shadow import FEW, Live


class Readers:
    """One table's read counts over one pool's shadow (host arrays): a watcher of the shadow."""

    def __init__(self, live: Live, seen: Seen) -> None:
        self.flags = live.flags  # the shadow it counts against: another shadow starts new counts
        self.count = np.zeros(live.pages + 1, dtype=np.int32)  # per page: read positions of the counted rows
        self.counted = np.zeros(seen.slot.shape[0], dtype=bool)  # rows whose read positions are in `count`
        self.suspects: dict[int, int] = {}  # page -> the touch that made it one: it changed hands while read
        self.touches = 0
        self.stale = True  # the counts do not hold (new; the shadow cleared or restored): the full check runs
        self.again = False  # the last step found a bad read: the full check runs (it reports each step)
        self.count_cells = memoryview(self.count)  # the same memory, indexed from host ints
        self.views = (seen.slot.numpy(), seen.gen.numpy(), seen.checked.numpy())  # the host path's views of `seen`
        self.cells = tuple(memoryview(view.reshape(-1)) for view in self.views)  # the same memory, for host ints
        self.slot_bytes = self.cells[0].cast("B")
        self.flags_of_rows = memoryview(self.counted)  # `counted`, indexed from host ints

    def touched(self, pages: Union[list, np.ndarray, torch.Tensor]) -> None:
        """Pages that changed hands (`shadow.mark`, `shadow.release`): those read are suspects."""
        self.touches += 1
        if isinstance(pages, list):
            view = self.count_cells
            for page in pages:
                if view[page]:
                    self.suspects[page] = self.touches
            return
        pages = pages.numpy() if isinstance(pages, torch.Tensor) else pages
        for page in pages[self.count.take(pages) > 0].tolist():
            self.suspects[page] = self.touches

    def reset(self) -> None:
        """The shadow was cleared or restored wholesale."""
        self.stale = True


def check(seen: Seen, live: Live, table: np.ndarray, rows: list[int], lens: list[int], holders: list,
          extend: bool, high: int, written: Callable[[], Optional[np.ndarray]] = lambda: None
          ) -> tuple[Optional[ReadFinding], bool]:
    """`readmap.check_reads` of one step (rows: req_pool_indices, lens: seq_lens, host ints of the
    batch's requests), with its rows' holders (`readmap.forget_changed_holders`); also whether the
    full check ran. `written`: the full check's `written`, asked only if it runs."""
    readers = _readers(seen, live)
    for row, holder in zip(rows, holders):
        if seen.holder[row] != holder:
            _uncount(readers, live, np.array([row]))
    readmap.forget_changed_holders(seen, rows, holders)
    ncols = table.shape[1]
    lens = [min(n, ncols) for n in lens]
    if not any(lens):
        return None, False  # nothing read (the full check leaves `seen` as it is too)
    if _clean(readers, live, table, rows, lens, extend, high):
        return None, False
    mark, rows_np = readers.touches, np.array(rows, dtype=np.int64)
    finding = readmap.check_reads(seen, table, rows_np, np.array(lens, dtype=np.int64), extend, live, high, written())
    _recount(readers, live, rows_np, mark)
    readers.again = finding is not None
    return finding, True


def _readers(seen: Seen, live: Live) -> Readers:
    """The table's counts over this shadow: made (and set watching it) at its first step."""
    readers = seen.readers
    if readers is None or readers.flags is not live.flags:
        readers = seen.readers = Readers(live, seen)
        live.watchers.append(readers)
    return readers


def _clean(readers: Readers, live: Live, table: np.ndarray, rows: list[int], lens: list[int], extend: bool,
           high: int) -> bool:
    """The step's reads from what changed. True: clean, and applied as the full check
    applies them; False: the full check decides (`seen` untouched; the counts are made again).
    Host ints until a row differs or many positions are new (the step's code runs cold, after
    the model's ops: each numpy call costs microseconds there)."""
    if readers.stale or readers.again or len(set(rows)) != len(rows):
        return False
    checked, counted = readers.cells[2], readers.flags_of_rows
    before = [checked[row] for row in rows]
    if any(was and not counted[row] for row, was in zip(rows, before)):
        return False
    old = [min(was, n) for was, n in zip(before, lens)]
    cells = memoryview(table.reshape(-1)).cast("B") if table.dtype == np.int32 else None
    differ = [i for i, (row, n) in enumerate(zip(rows, old)) if n and _differs(readers, table, cells, row, n)]
    if not differ and sum(lens) - sum(old) <= FEW and all(was <= n for was, n in zip(before, lens)):
        return _few(readers, live, table, rows, old, lens, high)
    return _spread(readers, live, table, np.array(rows, dtype=np.int64), np.array(lens, dtype=np.int64),
                   np.array(before, dtype=np.int64), np.array(old, dtype=np.int64), differ, extend, high)


def _differs(readers: Readers, table: np.ndarray, cells: Optional[memoryview], row: int, n: int) -> bool:
    """Whether req_to_token[row, :n] is not what the row read there (`Seen.slot`): compared as
    bytes (`cells`: the table's bytes, where it is int32 as Seen.slot and sglang's are)."""
    if cells is None:
        return not np.array_equal(table[row, :n], readers.views[0][row, :n])
    at = row * table.shape[1] * 4
    return cells[at:at + 4 * n].tobytes() != readers.slot_bytes[at:at + 4 * n].tobytes()


def _spread(readers: Readers, live: Live, table: np.ndarray, rows: np.ndarray, lens: np.ndarray, before: np.ndarray,
            old: np.ndarray, differ: list[int], extend: bool, high: int) -> bool:
    """`_clean` in numpy: rows whose entries changed (`differ`: their indexes), or many positions new."""
    slot, gen, checked = readers.views
    was_rows, was_pos = _changed(table, slot, rows[differ].tolist(), old[differ].tolist())
    now_rows, now_pos = _spans(rows, old, lens)
    if was_rows.size:
        now_rows, now_pos = np.concatenate([was_rows, now_rows]), np.concatenate([was_pos, now_pos])
    now = table[now_rows, now_pos].astype(np.int64)
    looked = look_up(now, live, high, low=live.page, generation=True)
    if (looked.inside & ~looked.live).any():
        return False  # a freed slot read
    gone = slot[was_rows, was_pos].astype(np.int64)
    if gone.size and not extend:  # repointed: the slot it named is still handed out as it was
        then = look_up(gone, live, high, low=live.page, generation=True)
        if (looked.inside[:gone.size] & then.live & (then.generation.astype(np.int32) == gen[was_rows, was_pos])).any():
            return False
    if (before > lens).any():  # positions no longer read
        gone_rows, gone_pos = _spans(rows, lens, before)
        gone = np.concatenate([gone, slot[gone_rows, gone_pos].astype(np.int64)])
    _count(readers, live, gone, -1)
    _count(readers, live, now, 1)
    if readers.suspects and _still_read(readers):
        others = readers.counted.copy()
        others[rows] = False
        _uncount(readers, live, np.flatnonzero(others))
        if _still_read(readers):
            return False
    slot[now_rows, now_pos] = now
    gen[now_rows, now_pos] = looked.generation.astype(np.int32)  # modulo 2^32, as Seen keeps it
    checked[rows] = lens
    readers.counted[rows] = True
    return True


def _few(readers: Readers, live: Live, table: np.ndarray, rows: list[int], old: list[int], lens: list[int],
         high: int) -> bool:
    """`_clean` where the step only reads a few positions anew and nothing else changed (a
    decode step), in plain Python over the tables' memory: the same answer, without the
    fixed cost of a few dozen numpy calls (the step's code runs cold, after the model's ops)."""
    page, ncols, pages = live.page, table.shape[1], live.pages
    flags, gens = live.host, shadow.host_generations(live)
    cells = memoryview(table.reshape(-1))
    new = []
    for row, start, end in zip(rows, old, lens):
        base = row * ncols
        for at in range(base + start, base + end):
            value = cells[at]
            held = page <= value < high  # `inside`, as the full check's look_up
            if held and (value // page >= pages or not flags[value // page]):
                return False  # a freed slot read (or one past the shadow: the full check says what)
            mark = gens[value // page if held else 0] if gens is not None else 0
            new.append((at, value, (mark + 2 ** 31) % 2 ** 32 - 2 ** 31))  # modulo 2^32, as Seen keeps it
    _count(readers, live, [value for _, value, _ in new], 1)
    if readers.suspects and _still_read(readers):
        return False  # a suspect still read: a position new now reads it too (the full check decides)
    slots, marks, checked = readers.cells
    for at, value, mark in new:
        slots[at], marks[at] = value, mark
    counted = readers.flags_of_rows
    for row, end in zip(rows, lens):
        checked[row], counted[row] = end, True
    return True


def _still_read(readers: Readers) -> bool:
    """Drops the suspects no counted position reads; whether any is left."""
    for page in [page for page in list(readers.suspects) if not readers.count[page]]:  # (a copy: frees may add)
        readers.suspects.pop(page, None)
    return bool(readers.suspects)


def _changed(table: np.ndarray, slot: np.ndarray, rows: list[int], old: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The (row, position) entries below `old` of these rows (each found to differ by
    `_differs`) whose slot is not the one read there."""
    found = [(row, np.flatnonzero(table[row, :n] != slot[row, :n])) for row, n in zip(rows, old)]
    if not found:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return (np.concatenate([np.full(pos.size, row, dtype=np.int64) for row, pos in found]),
            np.concatenate([pos for _, pos in found]))


def _spans(rows: np.ndarray, start: np.ndarray, end: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, position) for each row's positions in [start, end)."""
    size = np.maximum(end - start, 0)
    total = int(size.sum())
    if not total:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    offset = np.repeat(np.cumsum(size) - size, size)
    return np.repeat(rows, size), np.repeat(start, size) + np.arange(total) - offset


def _count(readers: Readers, live: Live, slots: Union[list, np.ndarray], by: int) -> None:
    """Adds `by` to the count of each slot's page (slots past the padding page and inside the shadow):
    host ints or a few slots one by one, more through numpy."""
    if isinstance(slots, list) or slots.size <= FEW:
        view, page, high = readers.count_cells, live.page, live.high
        for value in slots if isinstance(slots, list) else slots.tolist():
            if page <= value < high:
                view[value // page] += by
        return
    inside = (slots >= live.page) & (slots < live.high)
    np.add.at(readers.count, (slots[inside] // live.page).astype(np.intp, copy=False), np.int32(by))  # (an int
    # `by` of another dtype than the counts takes numpy's slow path: 27x at 32k slots)


def _uncount(readers: Readers, live: Live, rows: np.ndarray) -> None:
    """These rows' read positions off the counts (a row not counted gets the full check at its next step)."""
    rows = rows[readers.counted[rows]]
    if rows.size:
        slot, _, checked = readers.views
        at_rows, at_pos = _spans(rows, np.zeros_like(rows), checked[rows])
        _count(readers, live, slot[at_rows, at_pos].astype(np.int64), -1)
        readers.counted[rows] = False


def _recount(readers: Readers, live: Live, rows: np.ndarray, mark: int) -> None:
    """After the full check: the batch's rows are counted from what it read, no other row is,
    and the suspects of touches before it (`mark`) are settled."""
    readers.count[:] = 0
    readers.counted[:] = False
    readers.stale = False
    rows = np.unique(rows)
    slot, _, checked = readers.views
    at_rows, at_pos = _spans(rows, np.zeros_like(rows), checked[rows])
    _count(readers, live, slot[at_rows, at_pos].astype(np.int64), 1)
    readers.counted[rows] = True
    for page in [page for page, touch in list(readers.suspects.items()) if touch <= mark]:
        readers.suspects.pop(page, None)
