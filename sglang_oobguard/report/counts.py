"""Counts: what each check did in this process, so a check that never ran shows as a zero.

A sanitizer that is silent must prove it looked. Per check, the work it did (steps,
writes, frees, hand-outs, allocator events, transfers, loads) and the reports it made.
They go to the report file (a `counts` record when the server idles and a final one at
exit: `checks.flush`), to `python -m sglang_oobguard report DIR`, and to one log line at
exit. A counter is a plain int in a dict: no tensor, no device read.

Standard library only (and `model.switches`, which is too).
"""

from __future__ import annotations

from typing import Iterable, Optional

from ..model.switches import CHECKS  # every check the guard can run: the order of the exit line and the report

UNITS = ("steps", "writes", "frees", "allocs", "events", "transfers", "loads", "reports")


class Counts:
    """The process's counters: (check, unit) -> n."""

    __slots__ = ("by", "filed")

    def __init__(self) -> None:
        self.by: dict[tuple[str, str], int] = {}
        self.filed: dict[tuple[str, str], int] = {}  # as last filed

    def add(self, check: str, unit: str, n: int = 1) -> None:
        key = (check, unit)
        self.by[key] = self.by.get(key, 0) + n

    def changed(self) -> bool:
        """Whether anything was counted since the last `filing`."""
        return self.by != self.filed

    def filing(self, on: Iterable[str]) -> dict[str, dict[str, int]]:
        """The snapshot to file now (and remember as filed)."""
        self.filed = dict(self.by)  # one C-level copy: the idle flusher's thread files while steps count
        return self.snapshot(on, self.filed)

    def snapshot(self, on: Iterable[str] = (), of: Optional[dict[tuple[str, str], int]] = None) -> dict[str, dict[str, int]]:
        """check -> {unit: n}: every check that is `on` (zeros included: a check that never
        ran shows so) or counted anything."""
        out: dict[str, dict[str, int]] = {check: {} for check in on}
        for (check, unit), n in sorted((self.by if of is None else of).items(), key=lambda item: _order(item[0])):
            out.setdefault(check, {})[unit] = n
        return {check: out[check] for check in sorted(out, key=lambda c: _order((c, "")))}


def _order(key: tuple[str, str]) -> tuple[int, int]:
    check, unit = key
    names = list(CHECKS)
    return (names.index(check) if check in CHECKS else len(names),
            UNITS.index(unit) if unit in UNITS else len(UNITS))


def line(snapshot: dict[str, dict[str, int]]) -> str:
    """One line: `bounds: 12 steps, 40 writes; reads: 0 (never ran); ...`."""
    parts = []
    for check, units in snapshot.items():
        work = ", ".join(f"{n} {unit}" for unit, n in units.items() if unit != "reports")
        reports = units.get("reports", 0)
        said = work or "nothing checked"
        parts.append(f"{check}: {said}" + (f", {reports} reports" if reports else ""))
    return "; ".join(parts)
