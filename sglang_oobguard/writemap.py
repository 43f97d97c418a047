"""Write map: every real token of a forward writes the slot sglang's own table gives it.

For token i of request r (row `rows[r]` of `req_to_token`) at position p(i):

    out_cache_loc[i] == req_to_token[rows[r], p(i)]

with p per forward mode (sglang 0.5.23, measured: ../shared/reference/write-map.md):

- extend / mixed / draft extend v2 ("extend"): p = extend_prefix_lens[r] + j, token j of
  the row's extend_seq_lens[r] tokens starting at extend_start_loc[r];
- decode ("decode"): p = seq_lens[r] - 1 (+ encoder_lens[r] where present);
- EAGLE draft decode ("draft": the draft runner's decode): token i = r * topk + k, and
  p = positions[i] + k * lane(r), lane(r) = ceil((seq_lens[r] % page + steps) / page) *
  page (eagle_worker_common.prepare_for_draft: page 1 or topk 1 gives the contiguous
  lanes of assign_draft_cache_locs_contiguous, page > 1 with topk > 1 the page-aligned
  branches); positions[i] = seq_lens[r] + s at draft step s;
- target verify, EAGLE and NGRAM ("verify"): rows of draft_token_num tokens, p = seq_lens[r] + j.

`rule_of` reads the mapping's values only from the batch's device tensors (a host value
baked into a CUDA graph would be wrong at replay) and host ints only for shapes. Where
the map is not defined it returns a reason (a str): the caller skips by name.

`check_host` is the CPU path of the one contract the step kernel (`stepkernel`) also
keeps, per real token, first matching kind wins:
  BOUNDS (outside [0, high)) > FREED (liveness: page not handed out; page 0 exempt) >
  OTHER_REQUEST (not req_to_token's slot) > SHARED_ROW (the token's req_pool_idx is an
  earlier row's too) > DUPLICATE (an earlier real token, in range, has the same slot) >
  OWNED (liveness: the page's owner is another req_to_token row; an unowned page is
  claimed by the writer: owner 0 -> row + 1, in token order).
Padding is exempt by count: tokens past the real total and rows past the batch size.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import numpy as np
import torch

from .record import Kind, Record

FAMILIES = ("extend", "decode", "draft", "verify")
KIND_NAMES = {Kind.BOUNDS: "bounds", Kind.FREED: "freed", Kind.DOUBLE_FREE: "double_free",
              Kind.OTHER_REQUEST: "other_request", Kind.DUPLICATE: "duplicate", Kind.SHARED_ROW: "shared_row",
              Kind.OWNED: "owned"}


class Rule(NamedTuple):
    """One forward's write map: which row and position each token of `ids` writes."""

    family: str  # one of FAMILIES
    ids: torch.Tensor  # out_cache_loc: what the write gets (bounds, liveness, duplicates, owner)
    virtual: torch.Tensor  # compared with req_to_token: out_cache_loc_virtual when set, else ids
    table: torch.Tensor  # req_to_token
    rows: torch.Tensor  # req_pool_indices
    batch: int  # real rows (host int: a shape)
    seq_lens: torch.Tensor
    starts: Optional[torch.Tensor] = None  # extend: extend_start_loc
    counts: Optional[torch.Tensor] = None  # extend: extend_seq_lens
    prefix: Optional[torch.Tensor] = None  # extend: extend_prefix_lens
    offset: Optional[torch.Tensor] = None  # decode: encoder_lens
    positions: Optional[torch.Tensor] = None  # draft: positions
    width: int = 1  # tokens per row: decode 1, verify draft_token_num, draft topk
    steps: int = 1  # draft: speculative_num_steps
    page: int = 1  # draft: the allocator's page size


_MODE_NAMES: dict = {}


def _mode(batch: Any) -> str:
    mode = getattr(batch, "forward_mode", None)
    try:
        name = _MODE_NAMES.get(mode)
    except TypeError:
        name = None
    if name is None:
        name = getattr(mode, "name", "unknown").lower()
        try:
            _MODE_NAMES[mode] = name
        except TypeError:
            pass
    return name


def _tensor(value: Any) -> Optional[torch.Tensor]:
    return value if isinstance(value, torch.Tensor) else None


def rule_of(batch: Any, runner: Any) -> Union[Rule, str]:
    """This forward's rule, or why the write map is not defined for it (a reason the
    caller logs once and `doctor` lists)."""
    mode = _mode(batch)
    ids = _tensor(getattr(batch, "out_cache_loc", None))
    pool = getattr(runner, "req_to_token_pool", None)
    table = _tensor(getattr(pool, "req_to_token", None))
    rows = _tensor(getattr(batch, "req_pool_indices", None))
    seq_lens = _tensor(getattr(batch, "seq_lens", None))
    if ids is None or table is None or rows is None or seq_lens is None:
        return f"{mode}: no out_cache_loc, req_to_token, req_pool_indices or seq_lens"
    if ids.dim() != 1 or table.dim() != 2:
        return f"{mode}: out_cache_loc is not 1-d or req_to_token not 2-d"
    virtual = _tensor(getattr(batch, "out_cache_loc_virtual", None))
    if virtual is not None and virtual.shape != ids.shape:
        return f"{mode}: out_cache_loc_virtual's shape differs from out_cache_loc's (a draft step's slice)"
    size = int(getattr(batch, "batch_size", 0) or 0)
    if size > rows.numel() or size > seq_lens.numel():
        return f"{mode}: batch_size larger than req_pool_indices"
    base = dict(ids=ids, virtual=ids if virtual is None else virtual, table=table, rows=rows, batch=size,
                seq_lens=seq_lens)
    if mode in ("extend", "mixed", "draft_extend_v2"):
        starts, counts = _tensor(batch.extend_start_loc), _tensor(batch.extend_seq_lens)
        prefix = _tensor(batch.extend_prefix_lens)
        if starts is None or counts is None or prefix is None:
            return f"{mode}: no extend_start_loc, extend_seq_lens or extend_prefix_lens"
        if min(starts.numel(), counts.numel(), prefix.numel()) < size:
            return f"{mode}: extend lengths shorter than the batch"
        return Rule("extend", starts=starts, counts=counts, prefix=prefix, **base)
    if mode == "decode" and getattr(runner, "is_draft_worker", False):
        args = getattr(runner, "server_args", None)
        topk, steps = getattr(args, "speculative_eagle_topk", None), getattr(args, "speculative_num_steps", None)
        positions = _tensor(getattr(batch, "positions", None))
        if not isinstance(topk, int) or not isinstance(steps, int) or positions is None:
            return "draft decode: no speculative_eagle_topk, speculative_num_steps or positions"
        if ids.numel() != size * topk or positions.numel() < ids.numel():
            return f"draft decode: out_cache_loc has {ids.numel()} ids, not batch {size} x topk {topk}"
        page = int(getattr(runner, "page_size", 1) or 1)
        return Rule("draft", positions=positions, width=topk, steps=steps, page=page, **base)
    if mode == "decode":
        if ids.numel() != size:
            return f"decode: out_cache_loc has {ids.numel()} ids for a batch of {size}"
        return Rule("decode", offset=_tensor(getattr(batch, "encoder_lens", None)), **base)
    if mode == "target_verify":
        width = getattr(getattr(batch, "spec_info", None), "draft_token_num", None)
        if not isinstance(width, int) or ids.numel() != size * width:
            return f"target_verify: out_cache_loc is not batch {size} x draft_token_num {width}"
        return Rule("verify", width=width, **base)
    return f"{mode}: the write map is not defined for this forward mode"


# -- the host check (CPU tensors) -----------------------------------------------


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
        return Record(self.bad, 1, site, layer, high, self.bad, numel, self.pos, self.value, step, int(self.kind),
                      self.row, self.expected, self.owner)


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().numpy()


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
    else:  # draft
        page = rule.page
        lane = -(-(seq[r] % page + rule.steps) // page) * page
        p = _np(rule.positions).astype(np.int64)[tok] + j * lane
    return tok, r, p


def _repeats(values: np.ndarray) -> bool:
    """Whether any value occurs twice (a set for a few, a sort for many)."""
    if values.size <= 64:
        return len(set(values.tolist())) != values.size
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


FEW = 64  # up to this many ids (decode batches), a clean step is checked in plain Python first


def _clean_few(rule: Rule, ids: np.ndarray, high: int, live: Any) -> bool:
    """The fast answer for a clean step of a few tokens (decode, verify, draft): True
    when every check passes (the owner claims then made, as the full check makes
    them); False: check it in full (which finds and claims the same)."""
    w = rule.width
    vals = ids.tolist()
    b = rule.batch
    count = min(len(vals), b * w)
    if not count:
        return True
    vals = vals[:count]
    if min(vals) < 0 or max(vals) >= high or len(set(vals)) != count:
        return False
    rows = _np(rule.rows)[:b].tolist()
    if len(set(rows)) != b:
        return False
    seq = _np(rule.seq_lens)[:b].tolist()
    table = _np(rule.table)
    nrows, ncols = table.shape
    virt = vals if rule.virtual is rule.ids else _np(rule.virtual)[:count].tolist()
    family = rule.family
    offset = None if rule.offset is None else _np(rule.offset)[:b].tolist()
    positions = None if rule.positions is None else _np(rule.positions)[:count].tolist()
    for i in range(count):
        r, j = divmod(i, w)
        if family == "decode":
            p = seq[r] - 1 + (offset[r] if offset is not None else 0)
        elif family == "verify":
            p = seq[r] + j
        else:
            page = rule.page
            p = positions[i] + j * (-(-(seq[r] % page + rule.steps) // page) * page)
        row = rows[r]
        if not (0 <= row < nrows and 0 <= p < ncols) or table[row, p] != virt[i]:
            return False
    if live is None:
        return True
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


def check_host(rule: Rule, high: int, live: Any = None) -> tuple[Optional[WriteFinding], torch.Tensor]:
    """The write map, duplicates, shared rows, bounds and (with `live`, a probe.Live)
    liveness and ownership of one forward's CPU ids. Returns (None, ids) when clean,
    else the finding and a private copy of ids with every bad token's id set to 0.
    Claims the owner table for the good tokens (a host write into the guard's shadow)."""
    ids = _np(rule.ids)
    n = ids.shape[0]
    if n <= FEW and rule.family != "extend" and _clean_few(rule, ids, high, live):
        return None, rule.ids
    tok, r, p = token_map(rule, n)
    if not tok.size:
        return None, rule.ids
    val = ids[tok].astype(np.int64)
    virt = val if rule.virtual is rule.ids else _np(rule.virtual)[tok].astype(np.int64)
    table = _np(rule.table)
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
        return None, rule.ids
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
    return finding, cleaned


# -- the owner lookup (slow path: a report only) ------------------------------------


def find_owner(req_to_token: torch.Tensor, rows: Any, rids: Optional[list], slot: int, lengths: Any = None,
               prefer: int = -1, skip: Optional[tuple[int, int]] = None) -> Optional[tuple[str, int]]:
    """Who holds `slot` in req_to_token: the row `prefer` first (the owner table's
    row, when liveness knows it), then the batch's rows (`rows`: its
    req_pool_indices, `rids` their request ids; with `lengths`, their seq_lens, only
    a row's first lengths[r] entries at first), then every row of the table. `skip`:
    (row, position) not to count (the writer's own entry). Returns (owner name,
    position): the rid, or "req_to_token row R" for a row that is not in the batch;
    None when no row holds it."""
    table = req_to_token.detach().cpu()
    rows = [int(x) for x in (rows.tolist() if isinstance(rows, torch.Tensor) else (rows or []))]
    lens = None if lengths is None else [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor)
                                                          else lengths)]

    def name(row: int) -> str:
        if rids is not None and row in rows and rows.index(row) < len(rids):
            return str(rids[rows.index(row)])
        return f"req_to_token row {row}"

    def holds(row: int, limit: int) -> Optional[int]:
        if not 0 <= row < table.shape[0]:
            return None
        for pos in (table[row, :max(0, min(limit, table.shape[1]))] == slot).nonzero().flatten().tolist():
            if skip is None or (row, pos) != tuple(skip):
                return pos
        return None

    passes = [[prefer]] if prefer >= 0 else []
    if lens is not None:
        passes.append([(row, lens[i]) for i, row in enumerate(rows) if i < len(lens)])
    passes.append(rows)
    passes.append(range(table.shape[0]))
    for rows_of_pass in passes:
        for item in rows_of_pass:
            row, limit = item if isinstance(item, tuple) else (item, table.shape[1])
            pos = holds(row, limit)
            if pos is not None:
                return name(row), pos
    return None


NAMED_KINDS = (Kind.OTHER_REQUEST, Kind.DUPLICATE, Kind.SHARED_ROW, Kind.OWNED)


def named(table: torch.Tensor, rows: torch.Tensor, rids: Optional[list], kind: int, row: int, token: Optional[int],
          slot: int, owner_row: int = -1, expected: int = -1) -> dict[str, Any]:
    """A report's fields for both sides of a write-map or owner violation: the writer
    (its request at `row` of the batch, and its token), the token's own slot, and the
    request that holds `slot` (the owner lookup: slow, on a violation only)."""
    fields: dict[str, Any] = {"expected": expected}
    if 0 <= row < rows.numel():
        fields["request"] = str(rids[row]) if rids is not None and row < len(rids) else \
            f"req_to_token row {int(rows[row])}"
        if token is not None and token >= 0:
            fields["token"] = token
    if kind in NAMED_KINDS:
        skip = (int(rows[row]), int(token)) if 0 <= row < rows.numel() and token is not None and token >= 0 else None
        found = find_owner(table, rows, rids, slot, prefer=owner_row, skip=skip)
        if found is not None:
            fields["owner"], fields["owner_token"] = found
    return fields
