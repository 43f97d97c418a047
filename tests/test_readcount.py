"""The host read check's counted path (`probes.readcount`) against the full check
(`probes.readmap.check_reads`), step for step: the same findings and the same `Seen`,
over random histories of hand-outs, frees, table writes (appends, repoints, rows handed
to other requests, shrunk lengths), shadows cleared or restored, and batches (extends,
decodes, rows left out, a row twice). The shadow is the real one (`shadow.new_live`,
updated by `shadow.mark` / `release` / `clear` / `restore`, as the liveness check updates it)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sglang_oobguard.probes import readcount, readmap, shadow

ROWS, COLS, PAGES = 5, 16, 12


class World:
    """A pool's shadow, a req_to_token table, and two Seens: one for each path."""

    def __init__(self, page: int, cols: int = COLS) -> None:
        self.live = shadow.new_live(PAGES, page, torch.device("cpu"))
        self.page = page
        self.table = np.zeros((ROWS, cols), dtype=np.int32)
        self.lens = [0] * ROWS
        self.rid = [f"r{row}" for row in range(ROWS)]
        self.counted, self.full = readmap.Seen(ROWS, cols), readmap.Seen(ROWS, cols)
        self.scans = 0

    def live_pages(self) -> list[int]:
        return [p for p in range(1, PAGES) if self.live.flags[p]]

    def ids(self, page: int) -> torch.Tensor:
        return torch.arange(page * self.page, (page + 1) * self.page)

    def step(self, rows: list[int], extend: bool, written: bool) -> None:
        rows_np = np.array(rows, dtype=np.int64)
        lens = np.array([self.lens[r] for r in rows], dtype=np.int64)
        holders = [self.rid[r] for r in rows]
        at = lens - 1 if written else None
        mine, full = readcount.check(self.counted, self.live, self.table, rows, lens.tolist(), holders, extend,
                                     self.live.high, lambda: at)
        self.scans += full
        readmap.forget_changed_holders(self.full, rows, holders)
        theirs = readmap.check_reads(self.full, self.table, rows_np, lens, extend, self.live, self.live.high, at)
        assert mine == theirs
        checked = self.full.checked.numpy()
        assert (self.counted.checked.numpy() == checked).all()
        for row in range(ROWS):
            n = int(checked[row])
            for name in ("slot", "gen"):
                assert (getattr(self.counted, name).numpy()[row, :n] == getattr(self.full, name).numpy()[row, :n]).all()


@st.composite
def histories(draw):
    return draw(st.sampled_from([1, 4])), draw(st.lists(st.tuples(st.integers(0, 12), st.integers(0, 10 ** 6)),
                                                        min_size=1, max_size=60))


@settings(max_examples=300, deadline=None)
@given(histories())
def test_the_counted_path_finds_what_the_full_check_finds(history):
    page, ops = history
    world = World(page)
    for p in range(1, 9):  # a server's start: pages handed out, each request a few positions on them
        shadow.mark(world.live, world.ids(p), host=True)
    for row in range(ROWS):
        world.table[row, :3] = [(1 + (row + i) % 8) * page + i % page for i in range(3)]
        world.lens[row] = 3
    saved = world.live.flags.clone()
    for op, r in ops:
        rng = np.random.default_rng(r)
        row = int(rng.integers(0, ROWS))
        free = [p for p in range(1, PAGES) if not world.live.flags[p]]
        held = world.live_pages()
        if op == 0 and (free or held):  # a page handed out (now and then one still handed out: liveness's report),
            # or at page size > 1 one continued (ids past its offset 0: a request's half-filled last page)
            ids = world.ids(int(rng.choice(free if free and (not held or rng.random() < 0.9) else held)))
            shadow.mark(world.live, ids[int(rng.integers(0, page)) if r % 2 else 0:], host=True)
        elif op == 1 and held:  # a page given back
            shadow.release(world.live, world.ids(int(rng.choice(held))), host=True)
        elif op == 2 and held and world.lens[row] < COLS:  # a position appended (its slot, live or not)
            pick = int(rng.choice(held if rng.random() < 0.9 else range(PAGES)))
            world.table[row, world.lens[row]] = pick * page + int(rng.integers(0, page))
            world.lens[row] += 1
        elif op == 3 and world.lens[row]:  # an entry repointed
            pos = int(rng.integers(0, world.lens[row]))
            world.table[row, pos] = int(rng.integers(0, PAGES)) * page + int(rng.integers(0, page))
        elif op == 4:  # the row handed to another request
            world.rid[row] = f"r{row}-{r}"
            world.lens[row] = int(rng.integers(0, world.lens[row] + 1))
        elif op == 5 and world.lens[row]:  # a shorter length (spec decoding's rolled-back positions)
            world.lens[row] -= int(rng.integers(1, world.lens[row] + 1))
        elif op == 6 and held:  # the owner table names a row
            world.live.owner[int(rng.choice(held))] = row + 1
        elif op == 7:  # the allocator's backup_state / restore_state, or its clear
            if r % 3 == 0:
                saved = world.live.flags.clone()
            elif r % 3 == 1:
                shadow.restore(world.live, saved)
            else:
                shadow.clear(world.live)
        else:  # a step
            rows = [int(x) for x in rng.choice(ROWS, size=int(rng.integers(1, ROWS + 1)), replace=False)]
            if rng.random() < 0.05:
                rows.append(rows[0])
            world.step(rows, extend=rng.random() < 0.2, written=rng.random() < 0.5)


def test_a_steady_decode_is_counted_not_scanned():
    """Decodes over live pages, frees of pages nobody reads: one full check (the first step) in 50."""
    world = World(1, cols=64)
    for p in range(1, PAGES):
        shadow.mark(world.live, world.ids(p), host=True)
    for row in range(3):
        world.table[row, :3] = [1 + row, 4 + row, 7 + row]
        world.lens[row] = 3
    for i in range(50):
        for row in range(3):
            world.table[row, world.lens[row]] = 1 + (world.lens[row] + row) % 9
            world.lens[row] += 1
        shadow.release(world.live, world.ids(10 + i % 2), host=True)  # read by no row: not a suspect
        shadow.mark(world.live, world.ids(10 + i % 2), host=True)
        world.step([0, 1, 2], extend=False, written=True)
    assert world.scans == 1


@pytest.mark.parametrize("change", ["free", "repoint", "restore", "clear"])
def test_a_page_that_changes_hands_under_its_reader_is_found(change):
    """The counted path's answer is not 'clean' where a read position's page was freed (one by one, by a
    restore_state to a backup from before it was handed out, by the allocator's clear), or its entry repointed."""
    world = World(1)
    for p in (1, 3, 4, 5):
        shadow.mark(world.live, world.ids(p), host=True)
    saved = world.live.flags.clone()
    shadow.mark(world.live, world.ids(2), host=True)
    world.table[0, :3] = [1, 2, 3]
    world.lens[0] = 3
    world.step([0], extend=False, written=False)
    kind = readmap.Kind.READ_FREED
    if change == "free":
        shadow.release(world.live, world.ids(2), host=True)
    elif change == "restore":
        shadow.restore(world.live, saved)
    elif change == "clear":
        shadow.clear(world.live)
    else:
        world.table[0, 1] = 4
        kind = readmap.Kind.REPOINTED
    finding, full = readcount.check(world.counted, world.live, world.table, [0], [3], ["r0"], False,
                                    world.live.high)
    assert full and finding is not None and finding.kind == kind and finding.position == (0 if change == "clear" else 1)
