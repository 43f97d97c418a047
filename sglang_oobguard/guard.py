"""Wrappers: the code that runs around every guarded write.

The hot path reads the ids out of the call, picks the probe (the host scan for CPU
tensors, the fused kernel otherwise) and hands the write on. The caller's objects
are never changed: where a write is contained (raise and warn), it receives a
private copy of the ids with the bad ones sent to padding slot 0 (a KVWriteLoc as a
copy with only its ids replaced). Each pool carries a `PoolState`, made when the
pool is built: its record, the buffer the kernel writes the cleaned ids into, and,
with liveness on, the shadow its tracked allocator keeps (`liveness`).
"""

from __future__ import annotations

import dataclasses
import itertools
import weakref
from typing import Any, Callable, Iterable, Optional

import torch

from . import probe, stepmap
from .config import Backend, Config, Mode
from .discover import Found
from .record import PoolRecord, Record, fold_host
from .report import KVOutOfBoundsError, Reporter, Violation, free_param, logger, site_id, site_label
from .step import Steps, request_of

STATE_ATTR = "_oobguard_state"
STEP_LABEL = "out_cache_loc (forward step)"  # the step check's site
NAME_ATTR = "_oobguard_name"  # a state holder that is no pool (a fused writer's) names itself
SITES_ATTR = "_oobguard_sites"  # ...and the sites its warm-up compiles

_serials = itertools.count()


class PoolState:
    """One pool's record, the kernel's copy buffer and the liveness shadow."""

    def __init__(self, pool: Any, device: torch.device) -> None:
        self.pool_name = pool.__dict__.get(NAME_ATTR) or type(pool).__name__
        self.serial = next(_serials)  # the pool's key in the reporter
        self.device = device
        self.record = PoolRecord(device)
        self.scratch = torch.tensor(probe.SCRATCH_INIT, dtype=torch.int64, device=device)
        self.live: Optional[probe.Live] = None  # the liveness shadow, when an allocator is tracked
        self.since_poll = 0
        # The stream of the latest write probe (GPU): shadow updates on another stream wait for it.
        self.probe_stream: Optional[torch.cuda.Stream] = None
        self._raw_stream = 0
        # Cleaned copies: one region per id parameter (move_kv_cache has two), sized to
        # the pool's slots at build time; views are cached per (region, dtype, shape).
        self._capacity = int(pool.size) + int(pool.page_size) if device.type == "cuda" else 0
        self._copies = torch.empty(2 * self._capacity, dtype=torch.int64, device=device)
        self._views: dict[tuple[int, torch.dtype, torch.Size], torch.Tensor] = {}
        self.copied_for: list[Optional[torch.Tensor]] = [None, None]  # per region: the ids its copy was made of

    def copy_for(self, region: int, loc: torch.Tensor) -> torch.Tensor:
        """A contiguous tensor like `loc` in this pool's copy buffer."""
        key = (region, loc.dtype, loc.shape)
        view = self._views.get(key)
        if view is None:
            n = loc.numel()
            if n > self._capacity:  # more ids than slots: grow once (never the case in sglang's own calls)
                self._capacity = n
                self._copies = torch.empty(2 * n, dtype=torch.int64, device=self.device)
                self._views.clear()
            base = self._copies[region * self._capacity:(region + 1) * self._capacity]
            view = base.view(loc.dtype)[:n].view(loc.shape)
            if len(self._views) >= 256:
                self._views.clear()
            self._views[key] = view
        return view

    def saw_stream(self, device_index: int) -> None:
        """Remember the stream a write probe was enqueued on (a cheap raw-pointer test)."""
        raw = torch._C._cuda_getCurrentRawStream(device_index)
        if raw != self._raw_stream:
            self._raw_stream = raw
            self.probe_stream = torch.cuda.current_stream(device_index)

    def after_probes(self) -> None:
        """Order what the current stream does next (a shadow update) after every
        write probe enqueued so far on the probing stream: a stream wait, no host sync."""
        stream = self.probe_stream
        if stream is None or torch.cuda.is_current_stream_capturing():
            return
        current = torch.cuda.current_stream(stream.device)
        if current != stream:
            current.wait_stream(stream)


class Guard:
    """The process's active guard: its configuration, pools and reporter."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.reporter = Reporter(config.warn_interval_s)
        self.states: "weakref.WeakSet[PoolState]" = weakref.WeakSet()
        self.found: list[Found] = []  # the guarded methods: what a new pool's warm-up compiles
        self.bounds: dict[int, str] = {}  # site -> its bound's rule, for the device-side assert text
        self._messages: dict[int, str] = {}  # site -> the device-side assert text
        self._said: set[str] = set()  # log lines said once per guard
        self._marked: list[tuple[weakref.ref, str]] = []  # attributes we set on sglang's objects
        # The guarded call in progress, innermost: (pool, method, ids object passed on),
        # or None. A nested call on the same pool and method with that ids object (a
        # super() call) is not probed again; inside any, upstream's duplicate probe is skipped.
        self.current: Optional[tuple[Any, str, Any]] = None
        # The allocator call in progress that checks frees: (allocator, role family);
        # a nested one of the same family (free_page_ids calling free) is not counted twice.
        self.freeing: Optional[tuple[Any, str]] = None
        self.steps = Steps()
        self.step_site = site_id(STEP_LABEL)
        self.bounds[self.step_site] = "size + page_size"
        # Within one forward step (or one graph capture), the ids objects already probed
        # on a pool: (pool, bound, region, ids, lens, live) -> (ids, what the write got,
        # whether that is a copy in the pool's buffer).
        self._memo: dict[tuple, tuple[torch.Tensor, torch.Tensor, bool]] = {}
        self._capturing = False

    def configure(self, config: Config) -> None:
        """New settings for the same wrappers (a second install())."""
        self.config = config
        self.reporter.warn_interval_s = config.warn_interval_s

    # -- the hot path ---------------------------------------------------------

    def on_host(self, ids: torch.Tensor) -> bool:
        """The host scan serves CPU tensors (backend auto or torch), and CUDA tensors
        only when asked (torch) and not while a CUDA graph is captured."""
        backend = self.config.backend
        if ids.is_cuda:
            return backend is Backend.TORCH and not torch.cuda.is_current_stream_capturing()
        return backend is not Backend.TRITON

    def check_write(self, pool: Any, site: int, region: int, loc: torch.Tensor, high: int,
                    layer: Callable[[], int], lens: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Probe one write; returns the ids the write gets: `loc` itself, or (contained
        modes) a cleaned private copy. `layer` is called only when a report needs it.
        With liveness on, ids checked against the pool's token-slot bound (the space its
        shadow covers) are also checked against the shadow. Within a step (or a graph
        capture) the same ids object on the same pool and bound is probed once."""
        state = self.state(pool, loc.device)
        live = state.live if state.live is not None and high == pool.size + pool.page_size else None
        key = None
        if self._memo_on(loc):
            key = (id(pool), high, region, id(loc), id(lens), live is not None)
            hit = self._memo.get(key)
            if hit is not None and hit[0] is loc and (not hit[2] or state.copied_for[region] is loc):
                return hit[1]
        host = self.on_host(loc)
        passed = self._probe(state, site, region, loc, high, layer, lens, live, host)
        if key is not None:  # a copy in the pool's buffer serves only while no other ids overwrote it
            self._memo[key] = (loc, passed, passed is not loc and not host)
        return passed

    def _memo_on(self, loc: torch.Tensor) -> bool:
        """Inside a forward step, or while a graph is captured: a capture starts a memo
        of its own, so each captured graph holds its probe."""
        capturing = loc.is_cuda and torch.cuda.is_current_stream_capturing()
        if capturing != self._capturing:
            self._capturing = capturing
            self._memo.clear()
        return capturing or self.steps.open

    def _probe(self, state: PoolState, site: int, region: int, loc: torch.Tensor, high: int,
               layer: Callable[[], int], lens: Optional[torch.Tensor], live: Optional[probe.Live],
               host: bool) -> torch.Tensor:
        if host:
            finding = probe.scan_host(loc, high, lens, live)
            if finding is None:
                return loc
            self.report_now(state, finding.record(site, layer(), high, loc.numel(), self.steps.number))
            return probe.cleaned(loc, high, lens, live)  # warn mode: the others raised
        if not loc.numel():
            return loc
        asserts = self.config.mode is Mode.STRICT and loc.is_cuda  # the assert stops the stream before the write
        clean = None if asserts else state.copy_for(region, loc)  # (Triton's interpreter asserts nothing)
        probe.launch(loc, high, site, layer(), state.record.tensor, state.scratch, self.steps.counter(state.device),
                     clean, self.message(site) if asserts else None, lens, live)
        if clean is not None:
            state.copied_for[region] = loc
        if loc.is_cuda:
            state.saw_stream(loc.device.index)
        self.launched(state)
        return loc if clean is None else clean

    # -- the forward step -------------------------------------------------------

    def step_begin(self, runner: Any, batch: Any, pool: Any) -> Optional[torch.Tensor]:
        """A step boundary: report what landed, then check this step's out_cache_loc
        once against the pool it targets (its copy serves the layers' writes).
        [ownership] Returns the cleaned ids the forward writes with, or None."""
        self.steps.begin(runner, batch)
        self._memo.clear()
        for state in list(self.states):  # the copy the last step's end started (step_end starts the next)
            self.publish(state, state.record.poll(restart=False))
        loc = getattr(batch, "out_cache_loc", None)
        if isinstance(loc, torch.Tensor) and hasattr(pool, "size") and hasattr(pool, "page_size"):
            handled, swap = stepmap.check_step(self, runner, batch, pool)  # [ownership] write map + owner
            if handled:  # [ownership]
                return swap  # [ownership]
            self.check_write(pool, self.step_site, 0, loc, pool.size + pool.page_size, lambda: -1)
        return None

    def step_end(self) -> None:
        """The step's probes are enqueued: start each record's copy, read at the next step."""
        self.steps.end()
        self._memo.clear()
        for state in list(self.states):
            state.record.start_copy()

    def launched(self, state: PoolState) -> None:
        """Outside forward steps (which read every record at their boundary), look at a
        pool's record every `poll_every` probes."""
        if self.steps.open:
            return
        state.since_poll += 1
        if state.since_poll >= self.config.poll_every:
            state.since_poll = 0
            self.publish(state, state.record.poll())

    def state(self, pool: Any, device: torch.device) -> PoolState:
        """The pool's state: made when the pool was built, else now (a pool class whose
        constructor skips KVCache's, or a mock)."""
        return pool.__dict__.get(STATE_ATTR) or self.attach(pool, device)

    def mark(self, obj: Any, attr: str, value: Any) -> None:
        """Set one of our attributes on an object of sglang's, remembered for `forget`."""
        obj.__dict__[attr] = value
        self._marked.append((weakref.ref(obj), attr))

    def forget(self) -> None:
        """Take our attributes off sglang's objects again (uninstall)."""
        for ref, attr in self._marked:
            obj = ref()
            if obj is not None:
                obj.__dict__.pop(attr, None)
        self._marked.clear()

    def attach(self, pool: Any, device: torch.device) -> PoolState:
        state = PoolState(pool, device)
        self.mark(pool, STATE_ATTR, state)
        self.states.add(state)
        if device.type == "cuda":
            self.warm_up(state, pool.__dict__.get(SITES_ATTR) or self._sites(type(pool)))
        return state

    def _sites(self, cls: type) -> dict[int, bool]:
        """The sites a pool of this class probes: {site: whether it takes row lengths}."""
        sites = {site: found.rule.lens is not None for found in self.found if issubclass(cls, found.owner)
                 for site in found.sites}
        sites[self.step_site] = False
        return sites

    def warm_up(self, state: PoolState, sites: dict[int, bool]) -> None:
        """Compile, by empty launches, every kernel variant this pool's writes can ask
        for, so that serving and graph capture never compile. Strict mode compiles one
        variant per site (its assert text); the others share theirs."""
        strict = self.config.mode is Mode.STRICT
        if not strict:
            sites = {-1: any(sites.values())}
        lives = (None, probe.Live(state.scratch[:0].view(torch.int32), 1)) if self.config.liveness else (None,)
        for dtype in (torch.int64, torch.int32):
            loc = torch.empty(0, dtype=dtype, device=state.device)
            for site, with_lens in sites.items():
                for lens in (None, torch.empty(0, 0, dtype=dtype, device=state.device))[:1 + with_lens]:
                    for live in lives:
                        probe.launch(loc if lens is None else lens, 1, max(site, 0), -1, state.record.tensor,
                                     state.scratch, self.steps.counter(state.device), None if strict else loc,
                                     self.message(site) if strict else None, None if lens is None else lens[:, 0], live)

    def message(self, site: int) -> str:
        """The device-side assert text of a site: a compile-time constant, under CUDA's 256 bytes."""
        text = self._messages.get(site)
        if text is None:
            text = self._messages[site] = _assert_text(site, self.bounds.get(site, "the pool's ids"),
                                                       self.config.liveness)
        return text

    # -- reporting ------------------------------------------------------------

    def report_now(self, state: PoolState, call: Record, **named: Any) -> None:
        """A host finding: fold it into the record and publish this call (with the
        running totals) at once; raises unless warn."""
        fold_host(state.record.tensor, call)
        totals = state.record.read_now()
        self.publish(state, call._replace(total_bad=totals.total_bad, calls=totals.calls), **named)

    def publish(self, state: PoolState, record: Optional[Record], **named: Any) -> None:
        if state.record.unreported(record):
            assert record is not None
            lay = self.steps.find(record.step) if record.step >= 0 and not free_param(record.site) else None
            where = request_of(lay, record.pos, record.numel) if lay is not None else {"step": record.step}
            where.update(named or stepmap.describe(record, where))  # [ownership] both sides of the write
            self.reporter.publish(state.serial, Violation.of(record, state.pool_name, **where),
                                  fatal=self.config.mode is not Mode.WARN)

    def check(self) -> None:
        """An explicit check point: read every pool's record (this may sync)."""
        for state in list(self.states):
            self.publish(state, state.record.read_now())

    def violations(self) -> list[Violation]:
        return list(self.reporter.latest.values())

    def first_time(self, key: str) -> bool:
        """True the first time `key` is asked for: a line said once per guard."""
        if key in self._said:
            return False
        self._said.add(key)
        return True

    def internal_error(self, where: str, exc: BaseException) -> None:
        """The guard's own bookkeeping failed: log once per place, never raise into sglang."""
        if self.first_time(f"internal {where}"):
            logger.error("sglang_oobguard: internal error in %s, left unchecked: %s: %s",
                         where, type(exc).__name__, exc)


def _assert_text(site: int, bound: str, liveness: bool) -> str:
    what = f"KV slot id outside [0, {bound})"
    if free_param(site):
        what = "freed id outside the pool, or not allocated (double free)"
    elif liveness:
        what += ", or not allocated"
    return (f"sglang_oobguard: {site_label(site)}: {what}; "
            "rerun with SGLANG_OOBGUARD_MODE=raise for the report")[:255]


def make_wrapper(found: Found, guard: Guard) -> Callable[..., Any]:
    """The wrapt wrapper for one found method: probe each id parameter, then write with
    what the probe hands back (the caller's ids, or a cleaned copy). A nested call on
    the same pool and method with the ids object passed on, i.e. a super() call, is
    not probed again."""
    method = found.method
    specs = tuple((region, ids.position, name, ids.bound.high, site)
                  for region, (ids, name, site) in enumerate(zip(found.rule.ids, found.id_names, found.sites)))
    head_at, head_name = specs[0][1], specs[0][2]
    lens_at = found.rule.lens
    check = guard.check_write

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        outer = guard.current
        head = args[head_at] if len(args) > head_at else kwargs.get(head_name)
        if outer is not None and outer[2] is head and outer[0] is instance and outer[1] == method:
            return wrapped(*args, **kwargs)
        try:
            lens = None if lens_at is None else argument(args, kwargs, lens_at, "commit_lens")
            for region, position, name, high, site in specs:
                given = len(args) > position
                value = args[position] if given else kwargs.get(name)
                loc = value if isinstance(value, torch.Tensor) else getattr(value, "loc", None)  # KVWriteLoc
                if not isinstance(loc, torch.Tensor):
                    continue
                checked = check(instance, site, region, loc, high(instance), lambda: _layer_id(args, kwargs, found), lens)
                if checked is not loc:
                    passed = checked if value is loc else dataclasses.replace(value, loc=checked)
                    args, kwargs = replaced(args, kwargs, position, name, given, passed)
        except KVOutOfBoundsError:
            raise
        except Exception as exc:  # the guard's own failure: the write goes on unchecked
            guard.internal_error(found.qualname, exc)
        head = args[head_at] if len(args) > head_at else kwargs.get(head_name)
        guard.current = (instance, method, head)
        try:
            return wrapped(*args, **kwargs)
        finally:
            guard.current = outer

    return wrapper


def replaced(args: tuple, kwargs: dict, position: int, name: str, given: bool, value: Any) -> tuple[tuple, dict]:
    """The call's arguments with one replaced (positional when it was given so)."""
    if given:
        return (*args[:position], value, *args[position + 1:]), kwargs
    return args, {**kwargs, name: value}


def argument(args: tuple, kwargs: dict, position: int, name: str, default: Any = None) -> Any:
    """One argument of a wrapped call, given by position or by name."""
    return args[position] if len(args) > position else kwargs.get(name, default)


def _layer_id(args: tuple, kwargs: dict, found: Found) -> int:
    """`layer_id_override` when given (wrapper pools pass layer=None), else the layer's
    id: a RadixAttention's `layer_id`, or the int that index writes take. -1: none."""
    at = found.override_index
    override = args[at] if at is not None and len(args) > at else kwargs.get("layer_id_override")
    if override is not None:
        return int(override)
    if found.layer_name is None or found.rule.layer is None:
        return -1
    layer = argument(args, kwargs, found.rule.layer, found.layer_name)
    layer_id = layer if isinstance(layer, int) else getattr(layer, "layer_id", None)
    return -1 if layer_id is None else int(layer_id)


def make_upstream_skip(guard: Guard) -> Callable[..., Any]:
    """Wrapper for sglang's own `maybe_detect_oob` (0.5.13+) as bound in memory_pool:
    inside a method we guard, a call under one of our labels is the check our probe
    just made, so skip it; every other upstream probe (NaN, Inf, page alignment,
    other modules, and any call outside our methods) runs as before."""
    from .report import is_site_label

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        label = args[3] if len(args) > 3 else kwargs.get("msg")
        if guard.current is not None and is_site_label(label):
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
