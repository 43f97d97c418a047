"""Report: what a violation says, and where it goes (an exception or a log line).

Standard library only, so the error type can be imported without torch.
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .reportfile import ReportFile

logger = logging.getLogger("sglang_oobguard")  # messages name us themselves: sglang's format omits the logger


class _FallbackHandler(logging.StreamHandler):
    """Prints our records to stderr only while the process has no logging set up.

    sglang's plugin loader runs before the scheduler configures logging, so without
    this the activation line of every scheduler would be lost; once sglang (or pytest)
    installs root handlers, records flow there instead, and nothing prints twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def ensure_visible() -> None:
    if not any(isinstance(h, _FallbackHandler) for h in logger.handlers):
        handler = _FallbackHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("[%(asctime)s] %(levelname)s %(message)s"))
        logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


# Site ids: a probe record stores an int, the report shows the label it stands for.
_SITE_LABELS: list[str] = []
# Free sites (the liveness guard's allocator methods): site id -> the freed ids' name.
_FREE_PARAMS: dict[int, str] = {}


def site_id(label: str) -> int:
    """The id of a label, the same for every method that shares it."""
    if label not in _SITE_LABELS:
        _SITE_LABELS.append(label)
    return _SITE_LABELS.index(label)


def free_site_id(label: str, param: str) -> int:
    """The id of an allocator free site, e.g. "free (TokenToKVPoolAllocator)"."""
    site = site_id(label)
    _FREE_PARAMS[site] = param
    return site


def free_param(site: int) -> Optional[str]:
    """The freed ids' parameter name when `site` is a free site, else None."""
    return _FREE_PARAMS.get(site)


def is_site_label(label: object) -> bool:
    return label in _SITE_LABELS


def site_label(site: int) -> str:
    return _SITE_LABELS[site] if 0 <= site < len(_SITE_LABELS) else f"site {site}"


@dataclass(frozen=True)
class Violation:
    """One pool's bad write (or, with liveness, bad free): the first bad call in
    detail, plus running totals. An id inside [0, high) was bad because its slot
    is not allocated."""

    label: str
    pool: str
    layer: int  # -1: the caller passed no layer
    high: int  # ids must lie in [0, high)
    bad: int
    numel: int
    pos: int
    value: int
    total_bad: int
    calls: int
    freed: Optional[str] = None  # a free site: the name of the freed ids' parameter

    def __str__(self) -> str:
        layer = self.layer if self.layer >= 0 else "?"
        head = f"{self.label}: " if self.freed else f"{self.label} layer {layer}: "
        name = self.freed or "loc"
        if 0 <= self.value < self.high:
            tail = f" ({self.bad} of {self.numel} ids bad)" if self.bad > 1 else ""
            return (f"{head}{name}[{self.pos}] = {self.value} is not allocated "
                    f"({'double free' if self.freed else 'freed'}){tail}")
        return f"{head}{self.bad} of {self.numel} slot ids outside [0, {self.high}): {name}[{self.pos}] = {self.value}"


class KVOutOfBoundsError(IndexError):
    """A KV-cache write was handed slot ids outside its pool (or, with liveness,
    slots that are not allocated; a free, slots that are not allocated)."""

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        self.label, self.pool, self.layer = violation.label, violation.pool, violation.layer
        self.low, self.high = 0, violation.high
        self.bad, self.numel = violation.bad, violation.numel
        self.pos, self.value = violation.pos, violation.value
        super().__init__(f"{violation} (pool {violation.pool})")


class Reporter:
    """Keeps every pool's latest violation and rate-limits the warn-mode log."""

    def __init__(self, warn_interval_s: float) -> None:
        self.warn_interval_s = warn_interval_s
        self.latest: dict[int, Violation] = {}  # key: the pool's serial number
        self._last_log: Optional[float] = None
        self._suppressed = 0
        self.file: Optional["ReportFile"] = None  # SGLANG_OOBGUARD_REPORT_DIR's file, when set

    def publish(self, key: int, violation: Violation, fatal: bool) -> None:
        self.latest[key] = violation
        if self.file is not None:
            self.file.violation(key, violation)
        if fatal:
            raise KVOutOfBoundsError(violation)
        self._warn(violation)

    def _warn(self, violation: Violation) -> None:
        now = time.monotonic()
        if self._last_log is None:
            logger.warning("sglang_oobguard: bad KV slot ids, writes contained (ids sent to padding slot 0): %s (pool %s)",
                           violation, violation.pool)
        elif now - self._last_log >= self.warn_interval_s:
            bad = sum(v.total_bad for v in self.latest.values())
            calls = sum(v.calls for v in self.latest.values())
            logger.warning("sglang_oobguard: bad KV slot ids so far: %d in %d calls "
                           "(%d reports not logged since the last line); latest: %s (pool %s)",
                           bad, calls, self._suppressed, violation, violation.pool)
        else:
            self._suppressed += 1
            return
        self._last_log, self._suppressed = now, 0
