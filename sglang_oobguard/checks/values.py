"""Values: the finite-value check of a guarded write (SGLANG_OOBGUARD_FINITE).

Every floating argument a write stores (K and V, MLA's latent and rope parts, an
FP8 or FP4 pool's scales, a fused writer's sources) is checked for NaN and +-Inf:
on the host for CPU tensors (`values.scan_values`), by one more fused launch per
part otherwise (`valuekernel`), into the same record as the ids. The guard is an
observer here: the values are written unchanged in every mode. Strict stops before
the write (on a GPU the assert stops the stream before it); raise and warn report
after it, raise by raising.

Inside a forward step, a host write's small parts (a decode step's K and V) are checked
at the step's end (`after_step`), back to back: each layer's write runs cold, after the
model's ops, where a check's fixed cost is several times its warm one (measured in the
engine: 39 us a write, 7 warm). Their reports come when the forward returns, before the
scheduler reads its results: strict and raise raise there.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional

import torch

from ..model.config import Mode
from ..model.log import logger
from ..model.finite import VALUE_DTYPES
from ..probes import device, valuekernel
from ..probes.record import Record, fold_host
from ..probes.values import is_value, scan_values
from .guard import Guard
from .unit import Unit

# One write's host findings, one per part: the pool's state and the part's record.
Pending = list[tuple[Any, Record]]
# One write's parts checked at its step's end: (state, site, high, loc, layer, step, [(name, values)]).
Deferred = tuple[Any, int, int, torch.Tensor, Callable[[], int], int, list[tuple[str, torch.Tensor]]]
SMALL = 1 << 16  # values in a part checked at the step's end (a larger part's own data outweighs the call's cost)


def value_params(function: Callable[..., Any], after: int) -> tuple[tuple[int, str], ...]:
    """The named parameters of a write method (positions after self) from `after` on,
    which may hold the values it stores; which of them do is seen per call (`is_value`)."""
    params = [p for p in inspect.signature(function).parameters.values() if p.name != "self"]
    return tuple((at, p.name) for at, p in enumerate(params)
                 if at >= after and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))


def parts(params: tuple[tuple[int, str], ...], args: tuple, kwargs: dict) -> list[tuple[str, Any]]:
    """The values this call hands over: (argument name, tensor or float)."""
    found = []
    for at, name in params:
        value = args[at] if len(args) > at else kwargs.get(name)
        if is_value(value):
            found.append((name, value))
    return found


def check_values(guard: Guard, pool: Any, site: int, loc: torch.Tensor, high: int, layer: Callable[[], int],
                 given: list[tuple[str, Any]]) -> Pending:
    """Check one write's values; returns the host findings to publish (`publish`). A
    kernel finding folds into the pool's record, read at the next check point (not
    polled here: a poll that raised now would stop the write raise mode lets through)."""
    state = guard.state(pool, loc)
    host = guard.on_host(loc)
    pending: Pending = []
    strict = guard.config.mode is Mode.STRICT and device.is_gpu(loc)
    guard.counts.add("finite", "writes")
    if host and guard.calls.depth:  # inside a forward step: its small tensor parts at its end (`after_step`)
        later = [(name, values) for name, values in given if _small(values)]
        if later:
            guard.calls.values.append((state, site, high, loc, layer, guard.steps.number, later))
            given = [(name, values) for name, values in given if not _small(values)]
    for name, values in given:
        if host or not isinstance(values, torch.Tensor):
            finding = scan_values(values, loc.numel())
            if finding is not None:
                pending.append((state, finding.record(site, layer(), high, loc, name, guard.steps.number)))
        elif not valuekernel.launch_values(values, loc, high, site, layer(), name, state.record.tensor,
                                           state.scratch, guard.steps.counter(state.device), strict) \
                and guard.first_time(f"values unseen {name} {values.dtype}"):
            logger.warning("sglang_oobguard: %s: %s (%s, strides %s) not checked for NaN/Inf: the value kernel "
                           "reads %s rows of contiguous values only", state.pool_name, name, values.dtype,
                           tuple(values.stride()), ", ".join(VALUE_DTYPES))
    return pending


def _small(values: Any) -> bool:
    return isinstance(values, torch.Tensor) and values.numel() <= SMALL


def publish(guard: Guard, pending: Pending) -> None:
    """Report one write's host findings: every part folded into the pool's record, the
    first one published with the running totals (raises unless warn)."""
    state, first = pending[0]
    for _, record in pending:
        fold_host(state.record.tensor, record)
    totals = state.record.read_now()
    guard.publish(state, first._replace(total_bad=totals.total_bad, calls=totals.calls))


def after_step(guard: Guard) -> None:
    """The parts this step's writes left to its end (`check_values`), checked now that its
    forward returned: each write's findings published as at the write (strict and raise raise)."""
    deferred: list[Deferred] = guard.calls.values
    guard.calls.values = []
    for state, site, high, loc, layer, step, given in deferred:
        pending = [(state, finding.record(site, layer(), high, loc, name, step)) for name, values in given
                   for finding in (scan_values(values, loc.numel()),) if finding is not None]
        if pending:
            publish(guard, pending)


def before_write(guard: Guard, pending: Optional[Pending]) -> None:
    """Strict stops before the write; the other modes let the values through."""
    if pending and guard.config.mode is Mode.STRICT:
        publish(guard, pending)


UNIT = Unit("finite", "a value written is NaN or Inf", "per write: O(values written), one launch on a GPU",
            ("writes",), "every guarded pool write method and fused writer (their values)")
