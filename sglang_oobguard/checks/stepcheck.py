"""Step check: the forward-step hook, and the one check of each step's slot ids.

sglang runs every forward pass through `ModelRunner.forward(forward_batch, ...)` (all
releases of the matrix). Wrapping it gives the guard a step boundary:

- the deferred GPU records are read there (no sync);
- `forward_batch.out_cache_loc` is checked once, before any layer runs (`stepmap`):
  against the pool it targets (`targets.POOL_IDS`), sglang's own req_to_token (the
  write map: another request's slot, a slot twice, a row twice) and, with liveness
  on, the shadow and its owners. Whatever writer uses those ids next (a pool method,
  a fused kernel, an attention op that writes K/V itself) is covered, and the
  layers' probes of the same ids object in the same step are served the step's
  result (`writes.check_write`'s memo). In raise and warn, when the step check
  contained ids, its cleaned copy is bound to `forward_batch.out_cache_loc` for that
  one forward and sglang's own tensor (never changed) is bound back after it: sglang
  0.5.23 copies the batch into its runner's buffers before any layer writes, so this
  is the one way the contained ids reach every writer of the step;
- a layer's write with ids of its own (not the step's, nor the cleaned copy) must
  write slots of this step's tokens (`ownids`, host path);
- each token's position (and, where the scheduler knows it, its token) is checked with
  the map's (`positions`): not contained, the slot being right;
- with liveness on, every slot each request of the batch reads is checked (`reads`);
- the step is numbered and its batch remembered (`steps`), so a report read later
  names the request and the token.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..model.config import Backend
from ..model.log import logger
from ..model.swatargets import full_space
from ..model import writemap
from ..model.maptargets import UNMAPPED
from ..model.targets import POOL_IDS, POOL_OF_ALLOCATOR, write_map_off, write_map_unmeasured
from ..probes import device
from ..probes.pools import STATE_ATTR
from ..report.counts import slot
from ..report.reporter import KVOutOfBoundsError
from . import ownids, positions, reads, stepmap, values
from .calls import memo_key
from .flush import file_counts_while_busy
from .guard import Guard
from .unit import Found, Unit
from .writes import check_write


BOUNDS_STEPS, LIVENESS_STEPS, MAP_STEPS, OWNERS_STEPS = (slot(c, "steps") for c in ("bounds", "liveness", "map",
                                                                               "owners"))


def step_begin(guard: Guard, runner: Any, batch: Any, pool: Any) -> Optional[torch.Tensor]:
    """A step boundary: report what landed, then check this step's out_cache_loc.
    Returns the cleaned ids this forward must write with (raise and warn, when the
    step check contained some), or None."""
    calls, steps = guard.calls, guard.steps
    calls.depth += 1  # first: step_end undoes it whatever fails below
    if calls.depth == 1 and calls.values:  # left by a forward that raised: not this step's
        calls.values = []
    steps.open += 1
    loc = getattr(batch, "out_cache_loc", None)
    is_tensor = isinstance(loc, torch.Tensor)
    gpu = not is_tensor or device.is_gpu(loc)
    # A capture holds device work only: a host step with no device counter never asks.
    capturing = device.capturing() if gpu or steps.counters else False
    steps.begin(runner, batch, capturing)
    calls.new_memo()
    calls.step_ids = None
    if guard.polled.data:  # (a WeakSet's own len() is Python) the copies the last step's end started
        for state in list(guard.polled):
            guard.publish(state, state.record.poll(restart=False))
    if not (is_tensor and hasattr(pool, "size") and hasattr(pool, "page_size")):
        return None
    pool = id_space(runner, pool)
    high = POOL_IDS.high(pool)
    checks = guard.config.checks
    positioned = "positions" in checks
    if positioned:
        positions.begin(guard)
    # a draft runner's pool shares the target's allocator, whose shadow is the target pool's: its steps'
    # reads are the target's (skipped by design), its owners unchecked as before; not said as if off
    if guard.config.liveness and not getattr(runner, "is_draft_worker", False) and guard.state(pool, loc).live is None:
        _unshadowed(guard, pool)
    # the common host step first: a plain decode of a few ids, found clean
    few = None if gpu or guard.config.backend is Backend.TRITON or "map" not in checks else \
        stepmap.check_decode(guard, runner, batch, pool, loc, high)
    if few is not None:
        passed, mapped = None, True
        if not guard.config.finite:  # the layers that write with these very ids find them first
            calls.hot = (pool, loc, loc)
        if positioned:
            positions.check_plain(guard, pool.__dict__[STATE_ATTR], runner, batch, batch.seq_lens)
    else:
        step = positions.draft_step(guard, runner, batch) if positioned and not capturing else -1
        passed, mapped, few = _check_writes(guard, runner, batch, pool, loc, high, capturing, "map" in checks, step)
    if mapped and "ownids" in checks:
        ownids.remember(guard, pool, loc, passed, few)
    _count(guard, pool, mapped)
    # after the owner claims of this step's writes; on the releases whose step layouts the write map knows,
    # but for the forwards such a release was not measured on (its map skipped them too)
    if "reads" in checks and not capturing and stepmap.WRITE_MAP_OFF is None and _measured(guard, runner, batch):
        reads.check_reads(guard, runner, batch, pool, high)
    return passed


def _measured(guard: Guard, runner: Any, batch: Any) -> bool:
    """Whether this step's reads were measured on this sglang (`writemap.unmeasured`: attributes
    only); else the read check skips it, said once per reason."""
    if not writemap.UNMEASURED:
        return True
    why = writemap.unmeasured(batch, runner)
    if why is not None and guard.first_time(f"read check skipped: {why}"):
        logger.warning("sglang_oobguard: read check skipped for %s", why)
    return why is None


def _count(guard: Guard, pool: Any, mapped: bool) -> None:
    """The step's checks, counted: bounds (and liveness) always, the map and owners where it ran."""
    counts, state = guard.counts.n, pool.__dict__.get(STATE_ATTR)
    live = state is not None and state.live is not None
    counts[BOUNDS_STEPS] += 1
    if live:
        counts[LIVENESS_STEPS] += 1
    if mapped:
        counts[MAP_STEPS] += 1
        if live and state.live.owner is not None:
            counts[OWNERS_STEPS] += 1


def id_space(runner: Any, pool: Any) -> Any:
    """The pool whose ids the step's out_cache_loc and req_to_token hold, and whose shadow
    its owner and read checks read: an SWA pool's full sub-pool (the pool of its allocator's
    full sub-allocator, `swatargets.full_space`), else the runner's pool itself."""
    allocator = getattr(runner, "token_to_kv_pool_allocator", None)
    if allocator is None or getattr(allocator, "__dict__", {}).get(POOL_OF_ALLOCATOR) is not pool:
        return pool
    sub = full_space(allocator)
    inner = getattr(sub, "__dict__", {}).get(POOL_OF_ALLOCATOR)
    return pool if sub is allocator or inner is None else inner


def _unshadowed(guard: Guard, pool: Any) -> None:
    """Liveness on, and no shadow holds the step's ids: said once per pool class."""
    name = type(pool).__name__
    if guard.first_time(f"unshadowed step {name}"):
        logger.warning("sglang_oobguard: the owner check and the read check are off for %s: no liveness shadow "
                       "holds its ids (its allocator is not tracked; the step checks bounds and the write map only)",
                       name)


def _check_writes(guard: Guard, runner: Any, batch: Any, pool: Any, loc: torch.Tensor, high: int,
                  capturing: bool, mapping: bool, draft_step: int) -> tuple[Optional[torch.Tensor], bool, Optional[list]]:
    """(the cleaned ids or None, whether the write map checked them, the checked ids
    as a list where the host check read a few). `mapping`: the map check is on."""
    mapped = None if capturing or not mapping else stepmap.check_step(guard, runner, batch, pool, high, draft_step)
    if mapped is None:  # bounds and liveness alone
        check_write(guard, pool, guard.step_site, 0, loc, high, lambda: -1)
        return None, False, None
    passed, where, few = mapped
    calls = guard.calls
    live = guard.state(pool, loc).live is not None
    calls.memo[memo_key(pool, high, 0, loc, None, live)] = (loc, passed, where >= 0, where)
    if passed is loc:
        return None, True, few
    calls.memo[memo_key(pool, high, 0, passed, None, live)] = (passed, passed, False, -1)  # checked: itself
    return passed, True, few


def step_end(guard: Guard) -> None:
    """The step's probes are enqueued: start each record's copy, read at the next step."""
    calls = guard.calls
    calls.depth -= 1
    guard.steps.open -= 1
    calls.new_memo()
    calls.step_ids = None
    if guard.polled.data:
        for state in list(guard.polled):
            state.record.start_copy()
    if guard.reporter.file is not None:
        file_counts_while_busy(guard)


def make_forward_hook(guard: Guard, pool_attr: str) -> Any:
    """The wrapt wrapper for ModelRunner.forward: the step boundary (reports), then one
    check of out_cache_loc against the runner's pool, then the forward itself."""

    def wrapper(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs.get("forward_batch")
        cleaned = None
        try:
            cleaned = step_begin(guard, runner, batch, getattr(runner, pool_attr, None))
        except KVOutOfBoundsError:
            step_end(guard)
            raise
        except Exception as exc:
            guard.internal_error("ModelRunner.forward (step check)", exc)
        if cleaned is not None:  # bound for this forward only: sglang copies the batch before any layer writes
            cleaned, batch.out_cache_loc = batch.out_cache_loc, cleaned
        try:
            result = wrapped(*args, **kwargs)
        finally:
            if cleaned is not None:
                batch.out_cache_loc = cleaned  # sglang's own tensor, never changed, bound again
            step_end(guard)
        if "positions" in guard.config.checks:  # raise mode: a position report filed before the forward
            positions.after_forward(guard)
        if guard.calls.values and not guard.calls.depth:  # the value check's parts left to the step's end
            try:
                values.after_step(guard)
            except KVOutOfBoundsError:
                raise
            except Exception as exc:
                guard.internal_error("ModelRunner.forward (value check)", exc)
        return result

    return wrapper


def doctor(found: Found) -> list[str]:
    return ["the write map (each token's slot is req_to_token's; no slot or row twice); not checked:",
            *(f"  {name}: {why}" for name, why in UNMAPPED),
            *(f"  {name}: {why}: bounds and liveness only" for name, why in write_map_unmeasured()),
            "fused writers that take out_cache_loc themselves are reported, not contained, for ownership"]


UNIT = Unit("map", "each token of a forward step writes its own slot (req_to_token), none twice, no row twice",
            "per step: O(tokens), in the step kernel on a GPU", ("steps",), "the forward step (out_cache_loc)",
            where=write_map_off, doctor=doctor)
