"""Wrappers: the code that runs around every guarded write.

The hot path reads `loc` out of the call, picks the probe (the host scan for CPU
tensors, the fused kernel otherwise) and hands the write on with the caller's own
objects. Each pool carries a `PoolState`: its probe record, allocated once, and on
a GPU a pinned host mirror that is refreshed without a sync and read only after
its copy has finished. With liveness on, a pool whose allocator is tracked also
carries its liveness shadow there (`liveness` keeps it; `check_free` checks frees).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Callable, Optional

import torch

from . import probe
from .config import Backend, Config, Mode
from .discover import Found
from .report import Reporter, Violation, free_param, is_site_label, site_label

STATE_ATTR = "_oobguard_state"
Call = tuple  # (args, kwargs, the Found being called): read for the layer id only when needed

_serials = itertools.count()


class PoolState:
    """One pool's record and the host side of its deferred reporting."""

    def __init__(self, pool: Any, device: torch.device) -> None:
        self.pool_name = type(pool).__name__
        self.serial = next(_serials)  # the pool's key in the reporter
        self.record = probe.new_record(device)
        on_gpu = device.type == "cuda"
        self.mirror = torch.zeros(probe.RECORD_LEN, dtype=torch.int64, pin_memory=on_gpu)
        self.mirror_view = self.mirror.numpy()  # plain memory reads: no torch op, no sync
        self.copied: Optional[torch.cuda.Event] = torch.cuda.Event() if on_gpu else None
        self.pending = False  # a mirror copy was enqueued and not read yet
        self.reported = 0  # violating calls already reported
        self.since_poll = 0
        self.live: Optional[probe.Live] = None  # the liveness shadow, when an allocator is tracked
        self.live_high = 0  # the token-id bound the shadow covers


class Guard:
    """The process's active guard: its configuration, pools and reporter."""

    def __init__(self, config: Config) -> None:
        self.reporter = Reporter(config.warn_interval_s)
        self.states: "weakref.WeakSet[PoolState]" = weakref.WeakSet()
        self._messages: dict[tuple[int, int], str] = {}
        # The guarded call in progress, innermost: (pool, method, ids object), or None.
        # A nested call on the same pool and method with the same ids object (a super()
        # call) is not probed again; inside any, upstream's duplicate probe is skipped.
        self.current: Optional[tuple[Any, str, Any]] = None
        # The allocator call in progress that checks frees: (allocator, role family);
        # a nested one of the same family (free_page_ids calling free) is not counted twice.
        self.freeing: Optional[tuple[Any, str]] = None
        self.configure(config)

    def configure(self, config: Config) -> None:
        """New settings for the same wrappers (a second install())."""
        self.config = config
        self.strict = config.mode is Mode.STRICT
        self.liveness = config.liveness
        self.scan_cpu = config.backend is not Backend.TRITON
        self.scan_gpu = config.backend is Backend.TORCH
        self.reporter.warn_interval_s = config.warn_interval_s

    # -- the hot path ---------------------------------------------------------

    def _on_host(self, ids: torch.Tensor) -> bool:
        """The host scan serves CPU tensors (backend auto or torch), and CUDA tensors
        only when asked (torch) and not while a CUDA graph is captured."""
        if ids.is_cuda:
            return self.scan_gpu and not torch.cuda.is_current_stream_capturing()
        return self.scan_cpu

    def check_write(self, pool: Any, site: int, loc: torch.Tensor, high: int, call: Call,
                    lens: Optional[torch.Tensor] = None) -> None:
        """Probe one write. `call` is read for the layer id only when it is needed.
        With liveness on, ids checked against the pool's token-slot bound (the space
        its shadow covers; MLA's DCP bound too when its span is 1) are also checked
        against the shadow."""
        live = None
        if self.liveness:
            state = pool.__dict__.get(STATE_ATTR)
            if state is not None and state.live_high == high:
                live = state.live
        if self._on_host(loc):
            finding = probe.scan_host(loc, high, lens, live)
            if finding is not None:
                self._on_host_finding(self._state(pool, loc.device), finding, site, _layer_id(*call), high, loc.numel())
                probe.contain_host(loc, high, lens, live)  # warn mode: the others raised
            return
        if not loc.numel():
            return
        state = self._state(pool, loc.device)
        strict_gpu = self.strict and loc.is_cuda
        probe.launch(loc, high, site, _layer_id(*call), state.record, self._message(site, high) if strict_gpu else None,
                     lens, live)
        self._launched(state)

    def check_free(self, state: PoolState, site: int, ids: torch.Tensor, in_pages: bool) -> Optional[torch.Tensor]:
        """Check one real free against the shadow (every id must be live), then clear
        the flags of what it gives back. `in_pages`: the ids are page ids. Returns
        the ids to free instead, when warn mode contains a bad free on the host (the
        live ones only); None: free `ids` as they are."""
        live = state.live
        assert live is not None
        high = state.live_high
        if in_pages:
            live, high = live._replace(page=1), live.flags.numel()
        if self._on_host(ids):
            finding = probe.scan_free(ids, high, live)
            contained = None
            if finding is not None:  # strict and raise: raised before the allocator took the ids
                self._on_host_finding(state, finding, site, -1, high, ids.numel())
                contained = probe.live_only(ids, high, live)
            probe.release_host(ids, high, live)
            return contained
        strict_gpu = self.strict and ids.is_cuda
        probe.launch_free(ids, high, site, state.record, live, self._message(site, high) if strict_gpu else None)
        self._launched(state)
        return None

    def _launched(self, state: PoolState) -> None:
        state.since_poll += 1
        if state.since_poll >= self.config.poll_every:
            state.since_poll = 0
            self._poll(state)

    def start_shadow(self, pool: Any, device: torch.device, high: int, page: int) -> PoolState:
        """A tracked allocator was (re)cleared: every page of its pool is free."""
        state = self._state(pool, device)
        pages = -(-high // page)
        if state.live is None or state.live.page != page or state.live.flags.numel() != pages:
            state.live = probe.new_live(pages, page, device)
        else:
            state.live.flags.zero_()
        state.live_high = high
        return state

    def _state(self, pool: Any, device: torch.device) -> PoolState:
        return pool.__dict__.get(STATE_ATTR) or self._attach(pool, device)

    def _attach(self, pool: Any, device: torch.device) -> PoolState:
        state = PoolState(pool, device)
        setattr(pool, STATE_ATTR, state)
        self.states.add(state)
        return state

    def _message(self, site: int, high: int) -> str:
        """The device-side assert text: constant per (site, bound), under CUDA's 256 bytes."""
        key = (site, high)
        if key not in self._messages:
            what = f"KV slot id outside [0, {high})"
            if free_param(site):
                what = f"freed {what} or not allocated (double free)"
            elif self.liveness:
                what += " or not allocated"
            self._messages[key] = (
                f"sglang_oobguard: {site_label(site)}: {what}; "
                "see the scheduler log, or rerun with SGLANG_OOBGUARD_MODE=raise for the report"
            )[:255]
        return self._messages[key]

    # -- reporting ------------------------------------------------------------

    def _on_host_finding(self, state: PoolState, finding: probe.Finding, site: int,
                         layer: int, high: int, numel: int) -> None:
        """Record and publish; returns only in warn mode (the caller then contains)."""
        probe.fold_host(state.record, finding, site, layer, high, numel)
        totals = probe.read(state.record)
        state.reported = totals.calls
        violation = Violation(site_label(site), state.pool_name, layer, high, finding.bad,
                              numel, finding.pos, finding.value, totals.total_bad, totals.calls, free_param(site))
        self.reporter.publish(state.serial, violation, fatal=self.config.mode is not Mode.WARN)

    def _poll(self, state: PoolState) -> None:
        """Report a record whose mirror copy has landed, then start the next copy.
        Never waits: an unfinished copy is left for the next poll."""
        if state.copied is not None and torch.cuda.is_current_stream_capturing():
            return
        if state.pending and state.copied is not None and not state.copied.query():
            return
        if state.pending:
            self._publish_record(state, probe.Record(*state.mirror_view.tolist()))
        state.mirror.copy_(state.record, non_blocking=True)
        if state.copied is not None:
            state.copied.record()
        state.pending = True

    def _publish_record(self, state: PoolState, record: probe.Record) -> None:
        if record.calls <= state.reported:
            return
        state.reported = record.calls
        violation = Violation(site_label(record.site), state.pool_name, record.layer, record.high,
                              record.bad, record.numel, record.pos, record.value,
                              record.total_bad, record.calls, free_param(record.site))
        self.reporter.publish(state.serial, violation, fatal=self.config.mode is not Mode.WARN)

    def check(self) -> None:
        """An explicit check point: read every pool's record (this may sync)."""
        for state in list(self.states):
            self._publish_record(state, probe.read(state.record))

    def violations(self) -> list[Violation]:
        return list(self.reporter.latest.values())


def make_wrapper(found: Found, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper for one found method: probe each id parameter, then write.
    The caller's objects pass on unchanged (a KVWriteLoc stays a KVWriteLoc: 0.5.22+
    unified pools require the original). A nested call on the same pool and method
    with the same ids object, i.e. a super() call, is not probed again."""
    method = found.method
    specs = tuple((ids.position, name, ids.bound.high, site)
                  for ids, name, site in zip(found.rule.ids, found.id_names, found.sites))
    head_at, head_name = specs[0][0], specs[0][1]
    lens_at = found.rule.lens
    check = guard.check_write

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        head = args[head_at] if len(args) > head_at else kwargs.get(head_name)
        outer = guard.current
        if outer is not None and outer[2] is head and outer[0] is instance and outer[1] == method:
            return wrapped(*args, **kwargs)
        guard.current = (instance, method, head)
        try:
            lens = None if lens_at is None else _arg(args, kwargs, lens_at, "commit_lens")
            for position, name, high, site in specs:
                value = args[position] if len(args) > position else kwargs.get(name)
                loc = value if isinstance(value, torch.Tensor) else getattr(value, "loc", None)  # KVWriteLoc
                if loc is not None:
                    check(instance, site, loc, high(instance), (args, kwargs, found), lens)
            return wrapped(*args, **kwargs)
        finally:
            guard.current = outer

    return wrapper


def _arg(args: tuple, kwargs: dict, position: int, name: str) -> Any:
    return args[position] if len(args) > position else kwargs.get(name)


def _layer_id(args: tuple, kwargs: dict, found: Found) -> int:
    """`layer_id_override` when given (wrapper pools pass layer=None), else the layer's
    id: a RadixAttention's `layer_id`, or the int that index writes take. -1: none."""
    at = found.override_index
    override = args[at] if at is not None and len(args) > at else kwargs.get("layer_id_override")
    if override is not None:
        return int(override)
    if found.layer_name is None or found.rule.layer is None:
        return -1
    layer = _arg(args, kwargs, found.rule.layer, found.layer_name)
    layer_id = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    return -1 if layer_id is None else int(layer_id)


def make_upstream_skip(guard: Guard) -> Callable[..., Any]:
    """Wrapper for sglang's own `maybe_detect_oob` (0.5.13+) as bound in memory_pool:
    inside a method we guard, a call under one of our labels is the check our probe
    just made, so skip it; every other upstream probe (NaN, Inf, page alignment,
    other modules, and any call outside our methods) runs as before."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        label = args[3] if len(args) > 3 else kwargs.get("msg")
        if guard.current is not None and is_site_label(label):
            return None
        return wrapped(*args, **kwargs)

    return wrapper
