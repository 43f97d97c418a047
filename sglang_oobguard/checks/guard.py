"""Guard: the registry of the active checks, and the state every check reads: its
configuration, pools, steps and reporter.

The checks are units (`checks.unit`) that the instrumentor hands over from
`checks.registry`; the guard imports none of them. A unit's own state lives in `held`
under its name; what a unit adds to every report, in `fields`.
"""

from __future__ import annotations

import weakref
from typing import Any, Iterable, Optional, Union

import torch

from ..model.config import Backend, Config, Mode
from ..model.discover import Found
from ..model.log import Said
from ..model.targets import POOL_IDS
from ..model.violation import Violation, assert_text, free_param, site_id
from ..probes import device
from ..probes.pools import SITES_ATTR, STATE_ATTR, Marks, PoolState, warm_up
from ..probes.record import Record, fold_host
from ..report import owntime
from ..report.counts import Counts
from ..report.reporter import Reporter
from .calls import CallState, PerThread
from .steps import Steps
from .unit import Unit

STEP_LABEL = "out_cache_loc (forward step)"  # the step check's site


class Guard(Said, Marks):
    """The process's active guard."""

    def __init__(self, config: Config, units: Iterable[Unit] = ()) -> None:
        super().__init__()
        self.config = config
        self.units = {unit.name: unit for unit in units}  # every registered check (on or off: `config.checks`)
        self.held = {unit.name: unit.state() for unit in self.units.values() if unit.state is not None}
        self.counts = Counts()  # what each check did (`report.counts`)
        self.reporter = Reporter(config.warn_interval_s, self.counts)
        self.own_time = owntime.open_for(config.own_time)  # a benchmark's; fixed by the first install
        self.states: "weakref.WeakSet[PoolState]" = weakref.WeakSet()
        self.polled: "weakref.WeakSet[PoolState]" = weakref.WeakSet()  # a kernel probed them: read at step ends
        self.found: list[Found] = []  # the guarded methods: what a new pool's warm-up compiles
        self.bounds: dict[int, str] = {}  # site -> its bound's rule, for the device-side assert text
        self.outside_steps: set[int] = set()  # sites that never write inside a forward step (HiCache's copies)
        self._messages: dict[int, str] = {}  # site -> the device-side assert text
        self.threads = PerThread()  # each thread's calls in progress (`calls`)
        self.steps = Steps()
        self.step_site = site_id(STEP_LABEL)  # the step check's site, its bound the pool's
        self.bounds[self.step_site] = POOL_IDS.rule

    @property
    def calls(self) -> CallState:  # this thread's (a hot wrapper reads `threads.calls` once itself)
        return self.threads.calls

    def configure(self, config: Config) -> None:
        """New settings for the same wrappers (a second install())."""
        self.config, self.reporter.warn_interval_s = config, config.warn_interval_s

    def name_site(self, site: int, rule: str, in_steps: bool = True) -> None:
        """A probed site's bound rule (the device-side assert's text), and whether its
        writes happen inside forward steps (a report then names the step's request)."""
        self.bounds[site] = rule
        if not in_steps:
            self.outside_steps.add(site)

    def on_host(self, ids: torch.Tensor) -> bool:
        """The host scan serves CPU tensors (backend auto or torch), and CUDA tensors
        only when asked (torch) and not while a CUDA graph is captured."""
        if device.is_gpu(ids):
            return self.config.backend is Backend.TORCH and not device.capturing()
        return self.config.backend is not Backend.TRITON

    def state(self, pool: Any, where: Union[torch.device, torch.Tensor]) -> PoolState:
        """The pool's state: made with the pool, else now (a mock) on `where` or its device."""
        state = pool.__dict__.get(STATE_ATTR)
        return state or self.attach(pool, where.device if isinstance(where, torch.Tensor) else where)

    def attach(self, pool: Any, where: torch.device) -> PoolState:
        state = PoolState(pool, where)
        self.mark(pool, STATE_ATTR, state)
        self.states.add(state)
        if device.is_gpu(where):
            sites = pool.__dict__.get(SITES_ATTR) or {
                site: found.rule.lens is not None for found in self.found if isinstance(pool, found.owner)
                for site in found.sites}
            warm_up(state, {**sites, self.step_site: False}, self.steps.counter(where),
                    self.config.mode is Mode.STRICT, self.config.liveness, self.message, self.config.finite)
        return state

    def forget(self) -> None:
        """Take our attributes off sglang's objects again (uninstall); the pool states
        stay alive, since a captured graph may still replay their probes."""
        device.retain(([state.for_graphs() for state in self.states], self.steps))
        self.unmark()
        self.found.clear()  # the guarded methods name the user's pool classes: a guard kept alive (a
        # report's traceback, a thread) must not keep them (tests/test_discovery.py's held_by_the_guard)

    def message(self, site: int) -> str:
        text = self._messages.get(site)
        if text is None:
            text = self._messages[site] = assert_text(site, self.bounds.get(site, "the pool's ids"),
                                                      self.config.liveness)
        return text

    def report_now(self, state: PoolState, call: Record, **where: Any) -> None:
        """A host finding: fold it into the record and publish this call (with the
        running totals) at once; raises unless warn."""
        fold_host(state.record.tensor, call)
        totals = state.record.read_now()
        self.publish(state, call._replace(total_bad=totals.total_bad, calls=totals.calls), **where)

    def publish(self, state: PoolState, record: Optional[Record], **where: Any) -> None:
        if state.record.unreported(record):
            assert record is not None
            fields = {} if free_param(record.site) or record.site in self.outside_steps else self.steps.where(record)
            for unit in self.units.values():
                fields.update(unit.fields(state, record) if unit.fields is not None else {})
            self.reporter.publish(state.serial, Violation.of(record, state.pool_name, **{**fields, **where}),
                                  fatal=self.config.mode is not Mode.WARN)

    def launched(self, state: PoolState) -> None:
        """A kernel probed this pool: its record is read at step boundaries from now on,
        and outside forward steps every `poll_every` probes."""
        self.polled.add(state)
        if self.calls.depth:
            return
        state.since_poll += 1
        if state.since_poll >= self.config.poll_every:
            state.since_poll = 0
            self.publish(state, state.record.poll())

    def check(self) -> None:
        """An explicit check point: read every pool's record (this may sync)."""
        for state in list(self.states):
            self.publish(state, state.record.read_now())

    def checks_on(self) -> tuple[str, ...]:
        """The checks on that run everywhere they apply: not a feature's (counted where it first
        works), nor one whose layouts this sglang lacks."""
        return tuple(name for name, unit in self.units.items()
                     if name in (self.config.checks or ()) and unit.feature is None and unit.where() is None)
