"""Report: where a violation goes: the exception, the rate-limited warn log, the file.

Standard library only, so the error type can be imported without torch.
"""

from __future__ import annotations

import time
from typing import Optional

from ..model.log import logger
from ..model.violation import CHECK_OF, Violation
from .counts import Counts
from .files import ReportFile


class KVOutOfBoundsError(IndexError):
    """A KV-cache write was handed slot ids it must not write (outside its pool, or,
    with the checks that need them, slots not allocated or owned by another
    request); or a free, slots that are not allocated."""

    low = 0  # ids must lie in [low, violation.high)

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        super().__init__(violation.described())

    def __getattr__(self, name: str) -> object:
        """The violation's fields, read through (one schema: no copies)."""
        if name == "violation":
            raise AttributeError(name)
        return getattr(self.violation, name)


class Reporter:
    """Keeps every pool's latest violation, files it, and raises or rate-limits the warn log."""

    def __init__(self, warn_interval_s: float, counts: Optional[Counts] = None) -> None:
        self.warn_interval_s = warn_interval_s
        self.counts = Counts() if counts is None else counts  # each report counted for its check
        self.latest: dict[int, Violation] = {}  # key: the pool's serial number
        self._last_log: Optional[float] = None
        self._suppressed = 0
        self.file: Optional[ReportFile] = None  # SGLANG_OOBGUARD_REPORT_DIR's file, when set

    def publish(self, key: int, violation: Violation, fatal: bool) -> None:
        self.latest[key] = violation
        self.counts.add(CHECK_OF.get(violation.kind, "bounds"), "reports")
        if self.file is not None:
            self.file.violation(key, violation)
        if fatal:
            raise KVOutOfBoundsError(violation)
        self._warn(violation)

    def _warn(self, violation: Violation) -> None:
        now = time.monotonic()
        if self._last_log is None:
            logger.warning("sglang_oobguard: %s: %s", violation.contained(), violation.described())
        elif now - self._last_log >= self.warn_interval_s:
            bad = sum(v.total_bad for v in self.latest.values())
            calls = sum(v.calls for v in self.latest.values())
            logger.warning("sglang_oobguard: bad KV slot ids so far: %d in %d calls "
                           "(%d reports not logged since the last line); latest: %s",
                           bad, calls, self._suppressed, violation.described())
        else:
            self._suppressed += 1
            return
        self._last_log, self._suppressed = now, 0
