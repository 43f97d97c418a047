"""Writes: the check around every guarded pool write, and the wrappers that call it.

`check_write` probes one write's ids (the host scan for CPU tensors, one kernel
launch otherwise) and returns what the write gets: the caller's ids, or, where a
write is contained (raise and warn), a private cleaned copy. The caller's objects
are never changed. Within a forward step (or a graph capture) the same ids object
on the same pool and bound is probed once: the step check's copy serves the layers.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional

import torch

from ..model.config import Backend, Mode
from ..model.discover import Found
from ..model.log import logger
from ..model.swatargets import SWA_DOORS
from ..model.violation import is_site_label, site_id
from ..probes import device, hostscan, kernels
from ..probes.pools import RING, STATE_ATTR, PoolState, region
from ..probes.shadow import Live
from ..report.counts import slot
from ..report.reporter import KVOutOfBoundsError
from . import ownids, swa, values
from .calls import CallState, argument, memo_key, replaced
from .guard import Guard
from .unit import Unit

_TRITON = Backend.TRITON  # (a module global: an enum member's own look-up costs several times more)


BOUNDS_WRITES, LIVENESS_WRITES, OWNIDS_WRITES = (slot(c, "writes") for c in ("bounds", "liveness", "ownids"))


def check_write(guard: Guard, pool: Any, site: int, param: int, loc: torch.Tensor, high: int,
                layer: Callable[[], int], lens: Optional[torch.Tensor] = None, slots: bool = True) -> torch.Tensor:
    """Probe one write; returns the ids the write gets. `layer` is called only when a
    report needs it. `slots`: the ids are the pool's token slots, which the liveness
    shadow (when kept) covers."""
    state = pool.__dict__.get(STATE_ATTR) or guard.attach(pool, loc.device)
    live = state.live if slots else None
    calls = guard.calls
    if device.is_gpu(loc):
        capturing = device.capturing()
        host = guard.config.backend is Backend.TORCH and not capturing
    else:
        capturing, host = False, guard.config.backend is not Backend.TRITON
    if capturing != calls.capturing:  # a capture starts a memo of its own, so each graph holds its probe
        calls.capturing = capturing
        calls.new_memo()
    key = None
    if capturing or calls.depth:
        key = memo_key(pool, high, param, loc, lens, live is not None)
        served = _memoized(calls.memo, key, state, loc)
        if served is not None:
            return served
    counts = guard.counts.n
    counts[BOUNDS_WRITES] += 1
    if live is not None:
        counts[LIVENESS_WRITES] += 1
    if host:
        passed = _scan(guard, state, site, loc, high, layer, lens, live)
        where = -1
    else:
        where = region(RING if capturing else guard.steps.number % RING, param)
        passed = _launch(guard, state, site, where, loc, high, layer, lens, live)
    if key is not None:  # a copy in the pool's buffer serves only while no other ids overwrote it
        calls.memo[key] = (loc, passed, passed is not loc and where >= 0, where)
    return passed


def _memoized(memo: dict, key: tuple, state: PoolState, loc: torch.Tensor) -> Optional[torch.Tensor]:
    """What this step already gave these very ids, or None: a copy in the pool's buffer
    serves only while no other ids overwrote it."""
    hit = memo.get(key)
    if hit is not None and hit[0] is loc and (not hit[2] or state.copied_for.get(hit[3]) is loc):
        return hit[1]
    return None


def _scan(guard: Guard, state: PoolState, site: int, loc: torch.Tensor, high: int, layer: Callable[[], int],
          lens: Optional[torch.Tensor], live: Optional[Live]) -> torch.Tensor:
    finding = hostscan.scan_host(loc, high, lens, live)
    if finding is None:
        return loc
    guard.report_now(state, finding.record(site, layer(), high, loc.numel(), guard.steps.number))
    return hostscan.cleaned(loc, high, lens, live)  # warn mode: the others raised


def _launch(guard: Guard, state: PoolState, site: int, where: int, loc: torch.Tensor, high: int,
            layer: Callable[[], int], lens: Optional[torch.Tensor], live: Optional[Live]) -> torch.Tensor:
    if not loc.numel():
        return loc
    asserts = guard.config.mode is Mode.STRICT and device.is_gpu(loc)  # the assert stops the stream before the write
    clean = None if asserts else state.copy_for(where, loc)  # (Triton's interpreter asserts nothing)
    if clean is None and not asserts and guard.first_time(f"uncontained {state.serial}"):
        logger.warning("sglang_oobguard: %s: a write of %d ids, more than the pool's %d slots: probed, not "
                       "contained (no buffer may grow once graphs can hold it)", state.pool_name, loc.numel(),
                       state.capacity)
    kernels.launch(loc, high, site, layer(), state.record.tensor, state.scratch, guard.steps.counter(state.device),
                   clean, guard.message(site) if asserts else None, lens, live)
    if clean is not None:
        state.copied_for[where] = loc
    if device.is_gpu(loc):
        state.order.probed(loc.device)
    guard.launched(state)
    return loc if clean is None else clean


def _on_host_fast(guard: Guard, calls: CallState, pool: Any, loc: torch.Tensor,
                  high_of: Callable[[Any], int]) -> Optional[torch.Tensor]:
    """The common host write answered in the fewest steps, or None: run the full check
    (`check_write`), which finds, reports and contains. Each step costs several times its
    warm time right after a large KV write has flushed the caches (issue 35). Inside a
    forward step (the hot entry, every layer's answer after the first, is the wrapper's):
    the step check itself when these ids are its slots (`ownids.covers`), else the step
    check's memo of these very ids (a cleaned copy). Outside: no shadow to read, every
    id in bounds."""
    state = pool.__dict__.get(STATE_ATTR)
    if state is None or calls.capturing or guard.config.backend is _TRITON or device.is_gpu(loc):
        return None
    if calls.depth:
        if ownids.covers(guard, pool, loc):  # the common miss: the step's ids, copied
            calls.hot = (pool, loc, loc)
            guard.counts.n[OWNIDS_WRITES] += 1
            return loc
        high = high_of(pool)
        key = memo_key(pool, high, 0, loc, None, state.live is not None)
        served = _memoized(calls.memo, key, state, loc)
        if served is not None:
            calls.hot = (pool, loc, served)
        return served
    if state.live is None and hostscan.scan_host(loc, high_of(pool)) is None:
        guard.counts.n[BOUNDS_WRITES] += 1
        return loc
    return None


def make_wrapper(found: Found, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper for one found method: probe each id parameter, then write with
    what the probe hands back (the caller's ids, or a cleaned copy). A nested call on
    the same pool and method with the ids object passed on, i.e. a super() call, is
    not probed again. A lean method's (one tensor of token slots, nothing else checked
    at its door) is `lean_wrapper`, which answers the common writes before the full one."""
    method = found.method
    specs = tuple((param, ids.position, name, ids.bound.high, site, ids.bound.slots)
                  for param, (ids, name, site) in enumerate(zip(found.rule.ids, found.id_names, found.sites)))
    head_at, head_name = specs[0][1], specs[0][2]
    lens_at = found.rule.lens
    door = SWA_DOORS.get((found.owner.__name__, method))  # an SWA pool's door: its SWA ids checked there too
    door_site = None if door is None else site_id(door)
    # one id tensor of token slots, all written, nothing else checked at this door: the fast path may answer
    lean = len(specs) == 1 and lens_at is None and specs[0][5] and door is None
    head_high = specs[0][3]
    # A write with row lengths stores only each row's prefix: the rest of its values may be anything (on a
    # CPU sglang passes the prefix on to set_kv_buffer, whose values are checked there).
    value_at = () if lens_at is not None else values.value_params(found.original, max(spec[1] for spec in specs) + 1)
    threads = guard.threads
    single = len(specs) == 1  # a write (a move has two id parameters: not a step's token write)
    head_site = specs[0][4]

    def values_before(instance: Any, args: tuple, kwargs: dict, loc: torch.Tensor) -> Optional[values.Pending]:
        """The value check of a write the fast path answered (its ids were checked): strict
        reports before the write; the rest is published after it. The guard's own failure
        leaves the write unchecked, as in `wrapper`."""
        try:
            pending = values.check_values(guard, instance, head_site, loc, head_high(instance),
                                          lambda: _layer_id(instance, args, kwargs, found),
                                          values.parts(value_at, args, kwargs))
            values.before_write(guard, pending)
            return pending
        except KVOutOfBoundsError:
            raise
        except Exception as exc:
            guard.internal_error(found.qualname, exc)
            return None

    def lean_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        """The common write (one tensor of token slots) answered in the fewest steps: the
        step's hot entry (every layer writes the same ids), else `_on_host_fast`; any other
        write, or one not found clean here, takes `wrapper`, the full check."""
        calls = threads.calls
        head = args[head_at] if len(args) > head_at else kwargs.get(head_name)
        ids = head if type(head) is torch.Tensor else getattr(head, "loc", None)  # a KVWriteLoc (0.5.2x): its loc
        hot = calls.hot
        if hot is not None and hot[1] is ids and hot[0] is instance:
            fast = hot[2]
        else:
            outer = calls.current  # a super() call passing these ids on: the full wrapper's to skip
            if type(ids) is not torch.Tensor or (outer is not None and outer[2] is head):
                return wrapper(wrapped, instance, args, kwargs)
            try:
                fast = _on_host_fast(guard, calls, instance, ids, head_high)
            except Exception:  # the full check says what went wrong
                fast = None
            if fast is None:
                return wrapper(wrapped, instance, args, kwargs)
        pending = values_before(instance, args, kwargs, ids) if guard.config.finite and value_at else None
        if fast is not ids:  # the step check's cleaned copy
            head = fast if head is ids else dataclasses.replace(head, loc=fast)
            args, kwargs = replaced(args, kwargs, head_at, head_name, len(args) > head_at, head)
        if not guard.config.upstream_probe and not pending:  # nothing inside to skip (a nested super() call:
            return wrapped(*args, **kwargs)  # served again), nothing to report after
        return write(wrapped, instance, args, kwargs, head, pending)

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        calls = threads.calls
        head = argument(args, kwargs, head_at, head_name)
        outer = calls.current
        if outer is not None and outer[2] is head and outer[0] is instance and outer[1] == method:
            return wrapped(*args, **kwargs)
        pending = None
        try:
            lens = None if lens_at is None else argument(args, kwargs, lens_at, "commit_lens")
            for param, position, name, high, site, slots in specs:
                given = len(args) > position
                value = args[position] if given else kwargs.get(name)
                loc = value if isinstance(value, torch.Tensor) else getattr(value, "loc", None)  # KVWriteLoc
                if not isinstance(loc, torch.Tensor):
                    continue
                checked = check_write(guard, instance, site, param, loc, high(instance),
                                      lambda: _layer_id(instance, args, kwargs, found), lens, slots)
                if single and slots and calls.step_ids is not None and checked is loc:
                    ownids.check(guard, instance, site, loc, high(instance),
                                 lambda: _layer_id(instance, args, kwargs, found))
                if checked is not loc:
                    passed = checked if value is loc else dataclasses.replace(value, loc=checked)
                    args, kwargs = replaced(args, kwargs, position, name, given, passed)
                    if position == head_at:
                        head = passed
                if position == head_at and guard.config.finite and value_at:
                    pending = values_before(instance, args, kwargs, loc)
            if door_site is not None and "swa" in guard.config.checks:
                args, kwargs = swa.check_door(guard, instance, door_site, args, kwargs, head_at, head_name,
                                              _layer_id(instance, args, kwargs, found))
                head = argument(args, kwargs, head_at, head_name)
        except KVOutOfBoundsError:
            raise
        except Exception as exc:  # the guard's own failure: the write goes on unchecked
            guard.internal_error(found.qualname, exc)
        return write(wrapped, instance, args, kwargs, head, pending)

    def write(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict, head: Any,
              pending: Optional[values.Pending]) -> Any:
        """The write, as the call in progress (a nested super() call passing `head` on is not
        checked again), then the value findings raise and warn report after it."""
        calls = threads.calls
        outer = calls.current
        calls.current = (instance, method, head)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            calls.current = outer
        if pending:  # raise and warn: the values went in unchanged, now the report
            values.publish(guard, pending)
        return result

    return lean_wrapper if lean else wrapper


def _layer_id(instance: Any, args: tuple, kwargs: dict, found: Found) -> int:
    """`layer_id_override` when given (wrapper pools pass layer=None), else the layer's
    id: a RadixAttention's `layer_id`, or the int that index writes take. -1: none."""
    at = found.override_index
    override = args[at] if at is not None and len(args) > at else kwargs.get("layer_id_override")
    if override is not None:  # a sub-pool's own index (SWA, hybrid): the model's layer where the pool maps it
        layers = getattr(instance, "model_layer_ids", None)
        index = int(override) - int(getattr(instance, "start_layer", 0) or 0)
        return int(layers[index]) if isinstance(layers, tuple) and 0 <= index < len(layers) else int(override)
    if found.layer_name is None or found.rule.layer is None:
        return -1
    layer = argument(args, kwargs, found.rule.layer, found.layer_name)
    layer_id = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    return -1 if layer_id is None else int(layer_id)


def make_upstream_skip(guard: Guard) -> Callable[..., Any]:
    """Wrapper for sglang's own `maybe_detect_oob` (0.5.13+) as bound in a pool module:
    inside a method we guard, a call under one of our labels is the check our probe
    just made, so skip it; every other upstream probe (NaN, Inf, page alignment,
    other modules, and any call outside our methods) runs as before."""
    threads = guard.threads

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        if threads.calls.current is not None and is_site_label(args[3] if len(args) > 3 else kwargs.get("msg")):
            return None
        return wrapped(*args, **kwargs)

    return wrapper


def make_constructor_hook(guard: Guard) -> Callable[..., Any]:
    """Wrapper for KVCache.__init__: every pool gets its state (and its kernels their
    warm-up) as it is built, not on its first write, which may be under graph capture."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        if STATE_ATTR not in instance.__dict__:
            try:
                guard.attach(instance, torch.device(instance.device))
            except Exception as exc:
                guard.internal_error(f"{type(instance).__name__}.__init__", exc)
        return result

    return wrapper


def attach_existing(guard: Guard, pools: Iterable[Any]) -> None:
    """Give pools built before install() their state now (a pool whose constructor
    failed half way, without size or device, is no pool: left alone)."""
    for pool in pools:
        built = all(name in pool.__dict__ for name in ("size", "page_size", "device"))
        if built and STATE_ATTR not in pool.__dict__:
            try:
                guard.attach(pool, torch.device(pool.device))
            except Exception as exc:
                guard.internal_error(f"{type(pool).__name__} (built before install)", exc)


UNIT = Unit("bounds", "every write's slot ids lie in the pool", "per write: O(ids), one fused probe on a GPU",
            ("steps", "writes"), "every guarded pool write method, fused writer, HiCache copy and forward step")
