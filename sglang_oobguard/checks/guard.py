"""Guard: the active guard's state: its configuration, pools, steps and reporter.

The code that runs around sglang's calls lives in `writes`, `stepcheck`, `writers`
and `liveness`; each reads and reports through this object.
"""

from __future__ import annotations

import weakref
from typing import Any, Optional, Union

import torch

from ..model.config import Backend, Config, Mode
from ..model.discover import Found
from ..model.log import logger
from ..model.targets import POOL_IDS
from ..model import callsite
from ..model.targets import write_map_off
from ..model.violation import Kind, Violation, assert_text, free_param, site_id
from ..probes import device, shadow
from ..probes.pools import SITES_ATTR, STATE_ATTR, PoolState, warm_up
from ..probes.record import Record, fold_host
from ..report import owntime
from ..report.counts import CHECKS, Counts
from ..report.reporter import Reporter
from .calls import CallState, PerThread
from .steps import Steps
from .hiloads import Loads
from .inflight import Transfers

STEP_LABEL = "out_cache_loc (forward step)"  # the step check's site
FEATURES = ("swa", "pd", "hicache")  # checks that run only where sglang runs the feature
MAPPED = ("map", "ownids", "owners", "reads")  # checks that run only where the write map is known


class Guard:
    """The process's active guard."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.counts = Counts()  # what each check did (`report.counts`)
        self.reporter = Reporter(config.warn_interval_s, self.counts)
        self.own_time = owntime.open_for(config.own_time)  # a benchmark's; fixed by the first install
        self.states: "weakref.WeakSet[PoolState]" = weakref.WeakSet()
        self.polled: "weakref.WeakSet[PoolState]" = weakref.WeakSet()  # a kernel probed them: read at step ends
        self.found: list[Found] = []  # the guarded methods: what a new pool's warm-up compiles
        self.bounds: dict[int, str] = {}  # site -> its bound's rule, for the device-side assert text
        self.outside_steps: set[int] = set()  # sites that never write inside a forward step (HiCache's copies)
        self._messages: dict[int, str] = {}  # site -> the device-side assert text
        self._said: set[str] = set()  # log lines said once per guard
        self._marked: list[tuple[weakref.ref, str]] = []  # attributes we set on sglang's objects
        self.threads = PerThread()  # each thread's calls in progress (`calls`)
        self.steps = Steps()
        self.transfers, self.loads = Transfers(), Loads()  # PD decode's transfers in flight; HiCache's loads (liveness)
        self.step_site = site_id(STEP_LABEL)  # the step check's site, its bound the pool's
        self.bounds[self.step_site] = POOL_IDS.rule

    @property
    def calls(self) -> CallState:  # this thread's (a hot wrapper reads `threads.calls` once itself)
        return self.threads.calls

    def configure(self, config: Config) -> None:
        """New settings for the same wrappers (a second install())."""
        self.config, self.reporter.warn_interval_s = config, config.warn_interval_s

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

    def mark(self, obj: Any, attr: str, value: Any) -> None:
        """Set one of our attributes on an object of sglang's, remembered for `forget`."""
        obj.__dict__[attr] = value
        self._marked.append((weakref.ref(obj), attr))

    def forget(self) -> None:
        """Take our attributes off sglang's objects again (uninstall); the pool states
        stay alive, since a captured graph may still replay their probes."""
        device.retain(([state.for_graphs() for state in self.states], self.steps))
        for ref, attr in self._marked:
            obj = ref()
            if obj is not None:
                obj.__dict__.pop(attr, None)
        self._marked.clear()

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
            fields.update(history(state, record))
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

    def first_time(self, key: str) -> bool:
        """True the first time `key` is asked for: a line said once per guard."""
        said = key in self._said
        self._said.add(key)
        return not said

    def internal_error(self, where: str, exc: BaseException) -> None:
        """The guard's own bookkeeping failed: log once per place, never raise into sglang."""
        if self.first_time(f"internal {where}"):
            logger.error("sglang_oobguard: internal error in %s, left unchecked: %s: %s",
                         where, type(exc).__name__, exc)


def checks_on(config: Config) -> tuple[str, ...]:
    """The checks this configuration runs everywhere it applies, in `CHECKS` order (SWA, PD
    and HiCache only where sglang runs those features: they are counted when they first
    work; the map's checks only where this sglang's write map is known)."""
    mapped = write_map_off() is None
    wanted = config.checks or ()
    return tuple(name for name in CHECKS if name in wanted and name not in FEATURES
                 and (mapped or name not in MAPPED))


def history(state: PoolState, record: Record) -> dict[str, Any]:
    """The Violation fields of the reported slot's history (its last allocation and
    free, its generation), read when the report is made; {} when liveness does not
    track the pool or the id is outside it."""
    live = state.live
    if live is None or record.kind == Kind.BOUNDS or not 0 <= record.value < record.high:
        return {}
    page = record.value if free_param(record.site) == "page_ids" else record.value // live.page
    told = shadow.story(live, page)
    if told is None:
        return {}
    generation, allocated, freed, _ = told
    (allocated_step, allocated_by), (freed_step, freed_by) = callsite.unpack(allocated), callsite.unpack(freed)
    return {"generation": generation, "allocated_step": allocated_step, "allocated_by": callsite.text(allocated_by),
            "freed_step": freed_step, "freed_by": callsite.text(freed_by)}
