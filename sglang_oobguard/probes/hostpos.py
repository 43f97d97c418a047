"""Host positions: the position check of one forward's CPU tensors (the step kernel's
contract for it), and the token check (host only).

Per real token i (the write map's `token_map`: its batch row r and its slot's position p),
the positions it may be rotated at (`poslayout`): [lo, hi] = [p, p] (EXACT), [seq_lens[r]
+ s] on every lane of a draft step s, [seq_lens[r], p] for a tree verify. The first token
outside its range, in token order, and how many: the record keeps hi in `expected`, the
draft step in `owner` and lo in `head` (-1 each where there is none: `Record.position`).
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import numpy as np

from ..model import poslayout
from ..model.writemap import Rule
from .hostmap import FEW, _np, token_map
from .record import Kind, Record


class PositionFinding(NamedTuple):
    """The first token of a step at a wrong position (or fed a wrong token), and the count."""

    kind: int  # Kind.POSITION or Kind.TOKEN
    bad: int  # bad tokens
    pos: int  # its index in the step's tokens
    value: int  # its positions[i] (input_ids[i])
    row: int  # its request's index in the batch
    expected: int  # the highest position it may have (exact: its position); the token its request has there
    lowest: int  # a tree verify: the lowest position it may have; -1 otherwise
    draft_step: int  # -1: not a draft step

    def record(self, site: int, numel: int, step: int) -> Record:
        return Record.position(site=site, numel=numel, bad=self.bad, pos=self.pos, value=self.value, step=step,
                               kind=self.kind, row=self.row, expected=self.expected, draft_step=self.draft_step,
                               lowest=self.lowest)


def _bounds(rule: Rule, r: np.ndarray, p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[lo, hi] per token (numpy)."""
    if rule.family == "draft":
        lo = _np(rule.seq_lens).astype(np.int64)[r] + rule.draft_step
        return lo, lo
    if rule.expect == poslayout.TREE:  # a verify row's window: p = seq_lens + j
        return _np(rule.seq_lens).astype(np.int64)[r], p
    return p, p


def _few(rule: Rule, count: int) -> Optional[list]:
    """The first bad token's (i, given, lo, hi) and the count, by lists (a few tokens of a
    decode, verify or draft step); None: all within."""
    w = rule.width
    seq = rule.seq_lens.tolist()
    given = rule.positions.tolist()[:count]
    first, bad = None, 0
    for i in range(count):
        r, j = divmod(i, w)
        if rule.family == "draft":
            lo = hi = seq[r] + rule.draft_step
        else:
            hi = seq[r] - 1 if rule.family == "decode" else seq[r] + j
            lo = seq[r] if rule.expect == poslayout.TREE else hi
        if not lo <= given[i] <= hi:
            bad += 1
            first = first or (i, given[i], lo, hi)
    return None if first is None else [*first, bad]


def check_positions(rule: Rule) -> Optional[PositionFinding]:
    """The position check of one forward's CPU positions (`rule.expect` set): its first
    token outside its range, or None."""
    n = rule.ids.shape[0]
    if n <= FEW and rule.family != "extend":
        found = _few(rule, min(n, rule.batch * rule.width))
        if found is None:
            return None
        i, given, lo, hi, bad = found
        row = i // rule.width
    else:
        tok, r, p = token_map(rule, n)
        given_all = _np(rule.positions)[tok].astype(np.int64)
        lo_all, hi_all = _bounds(rule, r, p)
        outside = (given_all < lo_all) | (given_all > hi_all)
        if not outside.any():
            return None
        at = int(np.argmax(outside))
        i, row, given, lo, hi, bad = (int(tok[at]), int(r[at]), int(given_all[at]), int(lo_all[at]), int(hi_all[at]),
                                      int(outside.sum()))
    tree = rule.expect == poslayout.TREE
    return PositionFinding(Kind.POSITION, bad, i, given, row, hi, lo if tree else -1, rule.draft_step)


def check_tokens(rule: Rule, input_ids: np.ndarray, known: Callable[[int, int, int], np.ndarray]) -> Optional[
        PositionFinding]:
    """The token check of an extend or decode step: input_ids[i] against its request's
    token at p. `known(r, lo, hi)`: request r's tokens at positions [lo, hi) that the
    scheduler holds (shorter where it does not hold them yet: those are not compared)."""
    tok, r, p = token_map(rule, rule.ids.shape[0])
    if not tok.size:
        return None
    # tokens of one row are consecutive, at consecutive positions: one look-up per row
    cuts = np.flatnonzero(np.diff(r)) + 1
    first, bad = None, 0
    for seg in np.split(np.arange(tok.size), cuts):
        row, lo = int(r[seg[0]]), int(p[seg[0]])
        want = known(row, lo, lo + seg.size)
        got = input_ids[tok[seg[:want.size]]]
        wrong = np.flatnonzero(got != want)
        if wrong.size:
            bad += int(wrong.size)
            at = int(seg[wrong[0]])
            if first is None:
                first = PositionFinding(Kind.TOKEN, 0, int(tok[at]), int(input_ids[tok[at]]), row,
                                        int(want[wrong[0]]), -1, -1)
    return None if first is None else first._replace(bad=bad)
