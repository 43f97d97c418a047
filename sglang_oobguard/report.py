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
    from .record import Record
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
_SITE_IDS: dict[str, int] = {}
# Free sites (the liveness guard's allocator methods): site id -> the freed ids' name.
_FREE_PARAMS: dict[int, str] = {}


def site_id(label: str) -> int:
    """The id of a label, the same for every method that shares it."""
    site = _SITE_IDS.get(label)
    if site is None:
        site = _SITE_IDS[label] = len(_SITE_LABELS)
        _SITE_LABELS.append(label)
    return site


def free_site_id(label: str, param: str) -> int:
    """The id of an allocator free site, e.g. "free (TokenToKVPoolAllocator)"."""
    site = site_id(label)
    _FREE_PARAMS[site] = param
    return site


def free_param(site: int) -> Optional[str]:
    """The freed ids' parameter name when `site` is a free site, else None."""
    return _FREE_PARAMS.get(site)


def is_site_label(label: object) -> bool:
    return label in _SITE_IDS


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
    # Where in serving (a write inside a forward step; see `step`): -1 / None when unknown.
    step: int = -1  # the process's forward step number
    mode: Optional[str] = None  # sglang's forward mode: extend, decode, target_verify, draft_extend, idle, ...
    batch_size: Optional[int] = None
    request: Optional[str] = None  # the request's rid (or, before rids, its req_pool_indices entry)
    token: Optional[int] = None  # the token's index within its request
    ranks: Optional[str] = None  # "tp 1, pp 0, dp 0"
    # [ownership] what was wrong, and the other side of a write-map or owner violation
    kind: Optional[str] = None  # bounds, freed, double_free, other_request, duplicate, shared_row, owned
    expected: int = -1  # the token's own slot per req_to_token (-1: not checked)
    owner: Optional[str] = None  # the request holding the slot: its rid, or "req_to_token row R"
    owner_token: Optional[int] = None  # the position at which the owner holds the slot

    @classmethod
    def of(cls, record: "Record", pool: str, **where: object) -> "Violation":
        """A pool's record, as the report names it; `where`: the step fields."""
        where.setdefault("kind", KIND_NAMES.get(getattr(record, "kind", 0), "bounds"))  # [ownership]
        return cls(site_label(record.site), pool, record.layer, record.high, record.bad, record.numel,
                   record.pos, record.value, record.total_bad, record.calls, free_param(record.site),
                   **where)  # type: ignore[arg-type]

    def context(self) -> str:
        """Where in serving it happened, when known: step, mode, batch, request, token, ranks."""
        parts = []
        if self.step >= 0:
            parts.append(f"step {self.step}" + (f" ({self.mode}, batch {self.batch_size})" if self.mode else ""))
        if self.request is not None:
            parts.append(f"request {self.request}" + (f" token {self.token}" if self.token is not None else ""))
        if self.ranks:
            parts.append(self.ranks)
        return "; ".join(parts)

    def __str__(self) -> str:
        head = f"{self.label}: " if self.freed or self.layer < 0 else f"{self.label} layer {self.layer}: "
        name = self.freed or "loc"
        if self.kind in WRITE_MAP_KINDS:  # [ownership]
            tail = f" ({self.bad} of {self.numel} ids bad)" if self.bad > 1 else ""
            what = WRITE_MAP_KINDS[self.kind].format(expected=self.expected)
            held = (f"; slot {self.value} is held by request {self.owner} token {self.owner_token}"
                    if self.owner is not None else "")
            return f"{head}{name}[{self.pos}] = {self.value} {what}{held}{tail}"
        if 0 <= self.value < self.high:
            tail = f" ({self.bad} of {self.numel} ids bad)" if self.bad > 1 else ""
            return (f"{head}{name}[{self.pos}] = {self.value} is not allocated "
                    f"({'double free' if self.freed else 'freed'}){tail}")
        return f"{head}{self.bad} of {self.numel} slot ids outside [0, {self.high}): {name}[{self.pos}] = {self.value}"


# [ownership] Kind (record.Kind) -> its name in the report; the write map's kinds in words.
KIND_NAMES = {0: "bounds", 1: "freed", 2: "double_free", 3: "other_request", 4: "duplicate", 5: "shared_row",
              6: "owned"}
WRITE_MAP_KINDS = {
    "other_request": "is not this token's slot (other_request: req_to_token gives {expected})",
    "duplicate": "is written twice in this step (duplicate)",
    "shared_row": "is written by a request whose req_to_token row another request of this step has too (shared_row)",
    "owned": "is owned by another running request (owned)",
}


def described(violation: Violation) -> str:
    """The one-line report: the violation, its pool, and where in serving."""
    context = violation.context()
    return f"{violation} (pool {violation.pool})" + (f"; {context}" if context else "")


def _contained(violation: Violation) -> str:
    """What warn mode did about it, in words."""
    if violation.freed:
        return "bad free (a CPU free passes only the live ids on; a GPU free goes on as asked)"
    return "bad KV slot ids, write contained (the write got a copy with those ids sent to padding slot 0)"


class KVOutOfBoundsError(IndexError):
    """A KV-cache write was handed slot ids outside its pool (or, with liveness,
    slots that are not allocated; a free, slots that are not allocated)."""

    low = 0  # ids must lie in [low, violation.high)

    def __init__(self, violation: Violation) -> None:
        self.violation = violation
        super().__init__(described(violation))

    def __getattr__(self, name: str) -> object:
        """The violation's fields, read through (one schema: no copies)."""
        if name == "violation":
            raise AttributeError(name)
        return getattr(self.violation, name)


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
            logger.warning("sglang_oobguard: %s: %s", _contained(violation), described(violation))
        elif now - self._last_log >= self.warn_interval_s:
            bad = sum(v.total_bad for v in self.latest.values())
            calls = sum(v.calls for v in self.latest.values())
            logger.warning("sglang_oobguard: bad KV slot ids so far: %d in %d calls "
                           "(%d reports not logged since the last line); latest: %s",
                           bad, calls, self._suppressed, described(violation))
        else:
            self._suppressed += 1
            return
        self._last_log, self._suppressed = now, 0
