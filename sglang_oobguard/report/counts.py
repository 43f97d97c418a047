"""Counts: what each check did in this process, so a check that never ran shows as a zero.

A sanitizer that is silent must prove it looked. Per check, the work it did (steps,
writes, frees, hand-outs, allocator events, transfers, loads) and the reports it made.
They go to the report file (a `counts` record at most once a second while steps run, when
the server idles, and a final one at exit: `checks.flush`), to `python -m sglang_oobguard report DIR`, and to one log line at
exit. A counter is a plain int in a dict: no tensor, no device read.

Standard library only (and `model.switches`, which is too).
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..model.switches import NAMES  # every check the guard can run: the order of the exit line and the report

UNITS = ("steps", "writes", "frees", "allocs", "events", "transfers", "loads", "releases", "accounted", "sweeps",
         "scans", "reports")
_SLOTS = {(check, unit): i for i, (check, unit) in enumerate((c, u) for c in NAMES for u in UNITS)}


def slot(check: str, unit: str) -> int:
    """The index of (check, unit) in `Counts.n`: a hot path adds there itself (`n[SLOT] += 1`)."""
    return _SLOTS[check, unit]


class Counts:
    """The process's counters: one int per (check, unit), in a list (an index and an add
    are the cheapest Python counter: the write path pays for it on every write)."""

    __slots__ = ("n", "filed", "due")

    def __init__(self) -> None:
        self.n = [0] * len(_SLOTS)
        self.filed = list(self.n)  # as last filed
        self.due = 0.0  # time.monotonic() of the next filing while steps run (`checks.flush.file_counts`)

    def add(self, check: str, unit: str, n: int = 1) -> None:
        self.n[_SLOTS[check, unit]] += n

    def changed(self) -> bool:
        """Whether anything was counted since the last `filing`."""
        return self.n != self.filed

    def filing(self, on: Iterable[str]) -> dict[str, dict[str, int]]:
        """The snapshot to file now (and remember as filed)."""
        self.filed = list(self.n)  # one C-level copy: the idle flusher's thread files while steps count
        return self.snapshot(on, self.filed)

    def snapshot(self, on: Iterable[str] = (), of: Optional[list[int]] = None) -> dict[str, dict[str, int]]:
        """check -> {unit: n}: every check that is `on` (zeros included: a check that never
        ran shows so) or counted anything, in NAMES' order."""
        values = self.n if of is None else of
        out: dict[str, dict[str, int]] = {check: {} for check in NAMES if check in set(on)}
        for (check, unit), i in _SLOTS.items():
            if values[i]:
                out.setdefault(check, {})[unit] = values[i]
        return {check: out[check] for check in NAMES if check in out}


def line(snapshot: dict[str, dict[str, int]]) -> str:
    """One line: `bounds: 12 steps, 40 writes; reads: 0 (never ran); ...`."""
    parts = []
    for check, units in snapshot.items():
        work = ", ".join(f"{n} {unit}" for unit, n in units.items() if unit != "reports")
        reports = units.get("reports", 0)
        said = work or "nothing checked"
        parts.append(f"{check}: {said}" + (f", {reports} reports" if reports else ""))
    return "; ".join(parts)
