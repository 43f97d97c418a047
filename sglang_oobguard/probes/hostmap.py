"""Host map: the write map's check of one forward's CPU ids (the step kernel's contract).

Per real token the first matching kind wins:
  BOUNDS (outside [0, high)) > FREED (liveness: page not handed out; page 0 exempt) >
  OTHER_REQUEST (not req_to_token's slot) > SHARED_ROW (the token's req_pool_idx is an
  earlier row's too) > DUPLICATE (an earlier real token, in range, has the same slot) >
  OWNED (liveness: the page's owner is another req_to_token row; an unowned page is
  claimed by the writer: owner 0 -> row + 1, in token order).
Padding is exempt by count: tokens past the real total and rows past the batch size.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..model.writemap import Rule
from .record import Kind, Record


class WriteFinding(NamedTuple):
    """The first bad token of a step and the totals: what the record keeps."""

    kind: int  # Kind
    bad: int  # bad tokens
    pos: int  # first bad token's index in out_cache_loc
    value: int  # its slot id (out_cache_loc[pos])
    row: int  # its request's index in the batch
    expected: int  # its own slot per req_to_token (-1: outside the table)
    owner: int  # the req_to_token row that owns the slot (liveness), -1 unknown
    token: int  # its position p in its request (-1 unknown)

    def record(self, site: int, layer: int, high: int, numel: int, step: int) -> Record:
        return Record.ownership(site=site, layer=layer, high=high, numel=numel, bad=self.bad, pos=self.pos,
                                value=self.value, step=step, kind=self.kind, row=self.row, expected=self.expected,
                                owner=self.owner)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy() if t.requires_grad else t.numpy()  # detach() alone costs a new tensor


def token_map(rule: Rule, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tok, r, p) for the real tokens among the first n ids (host arrays)."""
    seq = _np(rule.seq_lens).astype(np.int64, copy=False)
    b = rule.batch
    if rule.family == "extend":
        starts = _np(rule.starts)[:b].astype(np.int64)
        counts = _np(rule.counts)[:b].astype(np.int64)
        prefix = _np(rule.prefix)[:b].astype(np.int64)
        tok = np.arange(n, dtype=np.int64)
        if not b:
            return tok[:0], tok[:0], tok[:0]
        r = np.searchsorted(starts, tok, side="right") - 1  # the last row starting at or before the token
        ok = r >= 0
        rc = np.where(ok, r, 0)
        j = tok - starts[rc]
        ok &= j < counts[rc]
        return tok[ok], r[ok], (prefix[rc] + j)[ok]
    w = rule.width
    tok = np.arange(min(n, b * w), dtype=np.int64)
    r, j = tok // w, tok % w
    if rule.family == "decode":
        p = seq[r] - 1
        if rule.offset is not None:
            p = p + _np(rule.offset).astype(np.int64)[r]
    elif rule.family == "verify":
        p = seq[r] + j
    else:  # draft: from its draft step when known, else from positions
        page = rule.page
        lane = -(-(seq[r] % page + rule.steps) // page) * page
        base = seq[r] + rule.draft_step if rule.draft_step >= 0 else _np(rule.positions).astype(np.int64)[tok]
        p = base + j * lane
    return tok, r, p


def _repeats(values: np.ndarray) -> bool:
    """Whether any value occurs twice (a set for a few, a sort for many)."""
    if values.size <= 64:
        return len(set(values.tolist())) != values.size
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


FEW = 64  # up to this many ids (decode batches), a clean step is checked in plain Python first
class TableView:
    """req_to_token's numpy view, made once per table (a view costs more than the rest
    of a decode step's check) and again when the table's memory moved. One per pool (its
    state keeps it: `pools.PoolState.table`), so a table lives no longer than its engine."""

    __slots__ = ("table", "at", "view")

    def __init__(self) -> None:
        self.table: Optional[torch.Tensor] = None
        self.at = 0
        self.view: Optional[np.ndarray] = None

    def of(self, table: torch.Tensor) -> np.ndarray:
        ptr = table.data_ptr()
        if self.table is not table or self.at != ptr:
            self.table, self.at, self.view = table, ptr, _np(table)
        return self.view


def _clean_few(rule: Rule, vals: list, high: int, live: Any, views: TableView) -> bool:
    """The fast answer for a clean step of a few tokens (decode, verify, draft): True
    when every check passes (the owner claims then made, as the full check makes
    them); False: check it in full (which finds and claims the same)."""
    w = rule.width
    b = rule.batch
    count = min(len(vals), b * w)
    if not count:
        return True
    if count < len(vals):
        vals = vals[:count]
    rows = rule.rows.tolist()  # a few ids: a list and its slice cost less than a tensor slice
    if len(rows) > b:
        rows = rows[:b]
    seq = rule.seq_lens.tolist()
    table = views.of(rule.table)
    family = rule.family
    if family == "decode" and rule.offset is None and rule.virtual is rule.ids:  # the common step: its own check
        return _decode_clean(vals, rows, seq, table, high, live)
    if min(vals) < 0 or max(vals) >= high or len(set(vals)) != count or len(set(rows)) != b:
        return False
    nrows, ncols = table.shape
    virt = vals if rule.virtual is rule.ids else rule.virtual.tolist()[:count]
    offset = None if rule.offset is None else rule.offset.tolist()[:b]
    positions = rule.positions.tolist()[:count] if family == "draft" and rule.draft_step < 0 else None
    for i in range(count):
        r, j = divmod(i, w)
        if family == "decode":
            p = seq[r] - 1 + (offset[r] if offset is not None else 0)
        elif family == "verify":
            p = seq[r] + j
        else:
            page = rule.page
            base = seq[r] + rule.draft_step if positions is None else positions[i]
            p = base + j * (-(-(seq[r] % page + rule.steps) // page) * page)
        row = rows[r]
        if not (0 <= row < nrows and 0 <= p < ncols) or table.item(row, p) != virt[i]:
            return False
    return live is None or _live_few(vals, rows, w, live)


def check_decode(loc: torch.Tensor, rows: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor, high: int,
                 live: Any, views: TableView) -> Optional[list]:
    """The check of a plain decode step's CPU ids (1-d, one per row of `rows`: token i
    writes req_to_token[rows[i], seq_lens[i] - 1]), in the fewest steps: the ids as a
    list when clean (the owner claims made); None: check it in full (`check_host`)."""
    view = views.of(table)
    if view.ndim != 2:
        return None
    vals = loc.tolist()
    return vals if _decode_clean(vals, rows.tolist(), seq_lens.tolist(), view, high, live) else None


def _decode_clean(vals: list, rows: list, seq: list, table: np.ndarray, high: int, live: Any) -> bool:
    """Whether a decode step's ids (lists) are clean: True makes the owner claims."""
    count = len(vals)
    if len(set(vals)) != count or len(set(rows)) != count or len(rows) != count or len(seq) < count:
        return False  # (every token must meet its row and length below)
    nrows, ncols = table.shape
    for v, row, n in zip(vals, rows, seq):
        if not (0 <= v < high and 0 <= row < nrows and 0 < n <= ncols) or table.item(row, n - 1) != v:
            return False
    return live is None or _live_few(vals, rows, 1, live)


def _live_few(vals: list, rows: list, w: int, live: Any) -> bool:
    """The liveness part of `_clean_few`: every slot on a live page, each page's owner
    this token's row (an unowned page claimed for it)."""
    page = live.page
    flags = live.host if live.host is not None else _np(live.flags)
    pages = [v // page for v in vals]
    if not all(v < page or flags[pg] for v, pg in zip(vals, pages)):
        return False
    if live.owner is None:
        return True
    owner = _np(live.owner)
    claims = []
    for i, (v, pg) in enumerate(zip(vals, pages)):
        if v < page:
            continue
        mine = rows[i // w] + 1
        cur = int(owner[pg])
        if cur == 0:
            claims.append((pg, mine))
        elif cur != mine:
            return False
    if page > 1 and len({pg for pg, _ in claims}) != len(claims):
        return False  # several tokens claim one page: the full check decides in token order
    for pg, mine in claims:
        owner[pg] = mine
    return True


def check_host(rule: Rule, high: int, live: Any = None,
               views: Optional[TableView] = None) -> tuple[Optional[WriteFinding], torch.Tensor, Optional[list]]:
    """The write map, duplicates, shared rows, bounds and (with `live`, a probe.Live)
    liveness and ownership of one forward's CPU ids. Returns (None, ids, ...) when clean,
    else the finding and a private copy of ids with every bad token's id set to 0; last,
    the ids as a list when a few were found clean by the fast answer (else None).
    Claims the owner table for the good tokens (a host write into the guard's shadow)."""
    views = views or TableView()  # no pool's own: one for this call
    n = rule.ids.shape[0]
    if n <= FEW and rule.family != "extend":
        vals = rule.ids.tolist()
        if _clean_few(rule, vals, high, live, views):
            return None, rule.ids, vals
    ids = _np(rule.ids)
    tok, r, p = token_map(rule, n)
    if not tok.size:
        return None, rule.ids, None
    val = ids[tok].astype(np.int64)
    virt = val if rule.virtual is rule.ids else _np(rule.virtual)[tok].astype(np.int64)
    table = views.of(rule.table)
    nrows, ncols = table.shape
    rows_all = _np(rule.rows)[:rule.batch].astype(np.int64)
    rpi = rows_all[r]
    inside = (rpi >= 0) & (rpi < nrows) & (p >= 0) & (p < ncols)
    if inside.all():
        expected = table[rpi, p].astype(np.int64)
    else:
        expected = np.full(tok.shape, -1, dtype=np.int64)
        expected[inside] = table[rpi[inside], p[inside]]
    kind = np.full(tok.shape, -1, dtype=np.int8)
    out = (val < 0) | (val >= high)
    kind[out] = Kind.BOUNDS
    flags = owner = None
    page = 1
    if live is not None:
        page = live.page
        flags = _np(live.flags)
        owner = None if live.owner is None else _np(live.owner)
        pg = np.where(out, 0, val) // page
        dead = ~out & (val >= page) & (flags[pg] == 0)
        kind[dead & (kind < 0)] = Kind.FREED
    kind[(virt != expected) & (kind < 0)] = Kind.OTHER_REQUEST
    if rows_all.size > 1 and _repeats(rows_all):  # a row whose req_pool_idx an earlier row (with tokens) has too
        rok = (rpi >= 0) & (rpi < nrows)
        at = np.flatnonzero(rok)
        _, first_at, inverse = np.unique(rpi[at], return_index=True, return_inverse=True)
        shared = np.zeros(tok.shape, dtype=bool)
        shared[at] = r[at][first_at][inverse] != r[at]
        kind[shared & (kind < 0)] = Kind.SHARED_ROW
    unique_slots = True
    if tok.size > 1 and _repeats(val):  # an earlier real token (in range) has the same slot
        unique_slots = False
        stamped = np.flatnonzero(~out)
        first = np.zeros(tok.shape, dtype=bool)
        first[stamped[np.unique(val[stamped], return_index=True)[1]]] = True
        kind[~out & ~first & (kind < 0)] = Kind.DUPLICATE
    if owner is not None:
        pg = np.where(out, 0, val) // page
        held = ~out & (val >= page)
        claim = (kind < 0) & held
        if claim.any():
            at = np.flatnonzero(claim)
            pages, mine = pg[at], rpi[at] + 1
            cur = owner[pages].astype(np.int64)
            fresh = cur == 0
            if fresh.any() and page == 1 and unique_slots:  # one token per page: each claims its own
                owner[pages[fresh]] = mine[fresh]
                cur = np.where(fresh, mine, cur)
            elif fresh.any():  # unowned pages: the first token (in order) of each claims it
                uniq, first_at, inverse = np.unique(pages[fresh], return_index=True, return_inverse=True)
                winners = mine[fresh][first_at]
                owner[uniq] = winners
                cur = cur.copy()
                cur[fresh] = winners[inverse]
            kind[at[cur != mine]] = Kind.OWNED
    bad = kind >= 0
    if not bad.any():
        return None, rule.ids, None
    first_bad = int(np.argmax(bad))
    i = int(tok[first_bad])
    slot = int(val[first_bad])
    own = -1  # the slot's owner after this step's claims
    if owner is not None and page <= slot < high:
        own = int(owner[slot // page]) - 1
    finding = WriteFinding(int(kind[first_bad]), int(bad.sum()), i, int(ids[i]), int(r[first_bad]),
                           int(expected[first_bad]), own, int(p[first_bad]))
    cleaned = rule.ids.clone()
    cleaned[torch.from_numpy(tok[bad])] = 0
    return finding, cleaned, None
