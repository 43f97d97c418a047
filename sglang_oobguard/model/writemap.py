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

With the position check on (`positions=True`), the rule also carries what the batch's
positions must hold (`expect`, `poslayout`), and a draft step's p comes from its draft
step s when it is known: p = seq_lens[r] + s + k * lane(r), not from positions.

`rule_of` reads the mapping's values only from the batch's device tensors (a host value
baked into a CUDA graph would be wrong at replay) and host ints only for shapes. Where
the map is not defined it returns a reason (a str): the caller skips by name. On an older
release measured without some forwards (`maptargets.WRITE_MAP_MEASURED`: 0.5.12's
speculative and PD decode forwards) those get a reason too (`unmeasured`, from attributes
only), and the read check skips the same steps.

The checks of the map run in `hostmap` (CPU ids) and `stepkernel` (one launch);
`owners` names who holds a slot when a report needs it.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Union

import torch

from . import poslayout
from .maptargets import HICACHE, PD_DECODE, SLIDING, SPECULATIVE
from .swatargets import SWA_SUBPOOL
from .targets import write_map_unmeasured

FAMILIES = ("extend", "decode", "draft", "verify")
UNMEASURED = dict(write_map_unmeasured())  # the installed sglang's forwards not measured -> why (0.5.23+: none)
SPECULATIVE_MODES = ("target_verify", "draft_extend", "draft_extend_v2")  # sglang's ForwardMode names, lower case


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
    positions: Optional[torch.Tensor] = None  # the batch's positions: a draft's p (draft_step < 0), the position check
    width: int = 1  # tokens per row: decode 1, verify draft_token_num, draft topk
    steps: int = 1  # draft: speculative_num_steps
    page: int = 1  # draft: the allocator's page size
    draft_step: int = -1  # draft: the step s of the draft loop (-1: not known, p from positions)
    expect: int = 0  # the position check: poslayout.EXACT or TREE (0: not checked)


_MODE_NAMES: dict = {}


def mode_of(batch: Any) -> str:
    """sglang's forward mode's name, lower case (a dict look-up after the first)."""
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


def plain_decode(batch: Any, runner: Any) -> Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(req_pool_indices, seq_lens, req_to_token) of a plain decode step (one token per
    row at seq_lens - 1: no virtual ids, no encoder offset, not a draft runner), read
    with the fewest attribute reads (the caller checks their shapes); None: ask `rule_of`."""
    if mode_of(batch) != "decode" or getattr(runner, "is_draft_worker", False) \
            or getattr(batch, "out_cache_loc_virtual", None) is not None or getattr(batch, "encoder_lens", None) is not None \
            or UNMEASURED and unmeasured(batch, runner) is not None:
        return None
    rows, seq_lens = getattr(batch, "req_pool_indices", None), getattr(batch, "seq_lens", None)
    table = getattr(getattr(runner, "req_to_token_pool", None), "req_to_token", None)
    if type(rows) is not torch.Tensor or type(seq_lens) is not torch.Tensor or type(table) is not torch.Tensor:
        return None
    return rows, seq_lens, table


def _tensor(value: Any) -> Optional[torch.Tensor]:
    return value if isinstance(value, torch.Tensor) else None


def unmeasured(batch: Any, runner: Any) -> Optional[str]:
    """Why this forward is left to bounds and liveness on this sglang, a release measured
    without its kind (`UNMEASURED`), or None. Reads attributes only (no tensor: no host sync):
    speculative decoding by the runner (a draft runner, or a speculative algorithm) or the
    forward mode; PD's decode side by the server's disaggregation_mode; HiCache by its switch;
    a sliding-window model by its pool's SWA sub-pool."""
    if not UNMEASURED:
        return None
    if SPECULATIVE in UNMEASURED and (getattr(runner, "is_draft_worker", False) or mode_of(batch) in SPECULATIVE_MODES
                                      or poslayout.algorithm(runner) != "NONE"):
        return f"{SPECULATIVE}: {UNMEASURED[SPECULATIVE]}"
    args = getattr(runner, "server_args", None)
    split = getattr(args, "disaggregation_mode", None)
    if PD_DECODE in UNMEASURED and str(getattr(split, "value", split)).lower() == "decode":
        return f"{PD_DECODE}: {UNMEASURED[PD_DECODE]}"
    if HICACHE in UNMEASURED and getattr(args, "enable_hierarchical_cache", False) is True:
        return f"{HICACHE}: {UNMEASURED[HICACHE]}"
    if SLIDING in UNMEASURED and SWA_SUBPOOL in getattr(getattr(runner, "token_to_kv_pool", None), "__dict__", {}):
        return f"{SLIDING}: {UNMEASURED[SLIDING]}"
    return None


def rule_of(batch: Any, runner: Any, draft_step: int = -1, positions: bool = False) -> Union[Rule, str]:
    """This forward's rule, or why the write map is not defined for it (a reason the
    caller logs once and `doctor` lists). `positions`: the position check is on, and a
    draft decode is at `draft_step` (-1: not known)."""
    why = unmeasured(batch, runner) if UNMEASURED else None
    if why is not None:
        return why
    rule = _rule(batch, runner, draft_step if positions else -1)
    if isinstance(rule, str) or not positions:
        return rule
    given = _tensor(getattr(batch, "positions", None))
    if given is None or given.dim() != 1 or given.numel() < rule.ids.numel():
        return rule
    how = poslayout.layout(rule.family, batch, runner, rule.draft_step)
    return rule if isinstance(how, str) else rule._replace(positions=given, expect=how)


def _rule(batch: Any, runner: Any, draft_step: int) -> Union[Rule, str]:
    mode = mode_of(batch)
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
        return Rule("draft", positions=positions, width=topk, steps=steps, page=page,
                    draft_step=draft_step if 0 <= draft_step < steps - 1 else -1, **base)
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
