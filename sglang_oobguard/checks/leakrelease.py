"""Release completeness: when sglang releases a request's KV, each slot of its row is freed or the tree's.

`release_kv_cache` frees a request's slots but for those the radix tree keeps: the prefix it
matched (`cache_protected_len`, locked for it) and what the release inserts. A slot of the
row's committed part `[0, kv_committed_len)` that is neither has no holder once the release
returns: a leak (sglang #11970: one slot per retracted request; #36855: chunk 0 re-prefilled
into new slots), reported at the release that left it, naming the request and the slot's
history, instead of at the next idle as counts.

sglang's own numbers decide whether to look: the row's pages still live (the liveness shadow;
pages in the allocator's pending free group count as freed) against the prefix plus what the
tree grew by during the release. Only when more pages are live than that are they looked up
in the tree (`all_values_flatten`), the sessions' rows and the pending frees. O(the row) per
release; the tree walk only on a mismatch.

On a GPU the row's flags would need a host copy per release: not checked there (the idle
sweep still finds the leak when the server idles).
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from ..model.leaktargets import RELEASE_LEAK_LABEL, kv_of, row_of
from ..model.swatargets import full_space
from ..model.violation import Kind, site_id
from ..probes.pools import LIVE_ATTR, PoolState
from ..probes.record import Record
from .guard import Guard
from .liveness import END_GROUPS, releases_now

_SITE = site_id(RELEASE_LEAK_LABEL)


class Before(NamedTuple):
    """What the release starts from: the row's pages, the tree's size, the prefix it keeps."""

    state: PoolState  # the liveness shadow's pool (a CPU shadow)
    swa: bool  # an SWA allocator's full sub-space: the tree's full sizes
    row: int
    pages: np.ndarray  # the row's committed pages, unique, page 0 (padding) left out
    tree: int  # the tree's tokens (evictable + protected) before the release
    kept: int  # the prefix the tree holds for the request, in tokens


def tree_tokens(tree: Any, swa: bool) -> int:
    """The tokens sglang's tree holds on the device (an SWA tree: its full ids')."""
    sizes = ("full_evictable_size", "full_protected_size") if swa else ("evictable_size", "protected_size")
    return sum(int(getattr(tree, name)()) for name in sizes)


def _shadow(tree: Any) -> tuple[Optional[PoolState], bool]:
    """The tracked CPU shadow of the tree's allocator's id space (None: untracked, or on a GPU),
    and whether that is an SWA allocator's full sub-space."""
    allocator = getattr(tree, "token_to_kv_pool_allocator", None)
    sub = full_space(allocator) if allocator is not None else None
    state: Optional[PoolState] = getattr(sub, "__dict__", {}).get(LIVE_ATTR)
    if state is None or state.live is None or state.live.flags.device.type != "cpu":
        return None, False
    return state, sub is not allocator


def before(req: Any, tree: Any) -> Optional[Before]:
    """Before a release: the request's committed pages (None: nothing to account for here)."""
    row, kv = row_of(req), kv_of(req)
    committed, kept = getattr(kv, "kv_committed_len", None), getattr(kv, "cache_protected_len", 0)
    table = getattr(getattr(tree, "req_to_token_pool", None), "req_to_token", None)
    if row is None or not isinstance(committed, int) or not isinstance(table, torch.Tensor) or committed <= 0:
        return None
    state, swa = _shadow(tree)
    if state is None:
        return None
    assert state.live is not None
    slots = table[int(row), :committed].to(torch.int64).numpy()
    pages = np.unique(slots // state.live.page)
    return Before(state, swa, int(row), pages[(pages > 0) & (pages < state.live.pages)], tree_tokens(tree, swa),
                  int(kept or 0))


def _pending(tree: Any, page: int) -> np.ndarray:
    """The pages the allocator's free group holds back until free_group_end (freed, for sglang):
    its token ids (`free_group`) and what its end frees beyond them (`liveness.END_GROUPS`)."""
    allocator = tree.token_to_kv_pool_allocator
    held = []
    for owner in {id(a): a for a in (allocator, full_space(allocator))}.values():
        if releases_now(owner):
            continue  # no group open (before 0.5.19 the last group's list stays after its end)
        for name, in_pages in (("free_group", False), *END_GROUPS):
            group = getattr(owner, "__dict__", {}).get(name)
            per = 1 if in_pages else page
            held += [ids.reshape(-1).to("cpu", torch.int64) // per for ids in group] if isinstance(group, list) else []
    return np.unique(torch.cat(held).numpy()) if held else np.empty(0, dtype=np.int64)


def session_slots(tree: Any) -> list[torch.Tensor]:
    """The slots the streaming sessions' rows keep (a session holds its row between turns)."""
    table = tree.req_to_token_pool.req_to_token
    return [table[kv.req_pool_idx, :int(kv.kv_allocated_len)] for kv in getattr(tree, "session_records", dict)().values()
            if getattr(kv, "req_pool_idx", None) is not None]


def _held(tree: Any, page: int) -> np.ndarray:
    """The pages the tree and the sessions' rows hold (walks the tree: on a mismatch only; a
    ChunkCache, radix off, has no tree to walk and holds nothing)."""
    walk = getattr(tree, "all_values_flatten", None)
    parts = [part.reshape(-1).to("cpu", torch.int64) for part in ([walk()] if walk else []) + session_slots(tree)]
    return np.unique(torch.cat(parts).numpy() // page) if parts else np.empty(0, dtype=np.int64)


def after(guard: Guard, tree: Any, start: Before) -> Optional[tuple[np.ndarray, Record]]:
    """After the release: the row's pages still live beyond what the tree keeps, and their
    report's record (the first leaked slot, the request's row), or None."""
    live = start.state.live
    assert live is not None
    guard.counts.add("leaks", "accounted")
    kept = -(-start.kept // live.page) + -(-max(tree_tokens(tree, start.swa) - start.tree, 0) // live.page)
    still = start.pages[live.flags[start.pages].numpy() != 0]
    if still.size <= kept:
        return None
    still = np.setdiff1d(still, _pending(tree, live.page))
    if still.size <= kept:
        return None
    leaked = np.setdiff1d(still, _held(tree, live.page))
    if not leaked.size:
        return None
    return leaked, Record.ownership(site=_SITE, high=live.high, numel=int(start.pages.size) * live.page,
                                    bad=int(leaked.size) * live.page, pos=0, value=int(leaked[0]) * live.page,
                                    step=guard.steps.number, kind=Kind.LEAK, owner=start.row)
