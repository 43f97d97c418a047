"""Own time: the guard's host time at each of its entry points, minus the sglang call
each wraps, kept for a benchmark (`SGLANG_OOBGUARD_OWN_TIME=DIR`).

A throughput ratio on a 2-core machine cannot resolve a few percent; the guard's own
time can. Unset (the default) nothing here runs: the instrumentor wraps its wrappers
in `OwnTime.timed` only when the folder is set. Set, each process keeps its totals in
a file of its own, `DIR/owntime-<pid>.bin`, memory-mapped: for each kind of entry
point, int64 own nanoseconds, calls and inclusive nanoseconds (the sglang call too:
for `step`, the forward's own time), added in place at every call (no system call),
read by `read()` (bench/engine.py, between rounds) while the process runs.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path
from typing import Any, Callable, Optional

from ..model.log import logger

# The guard's entry points by kind: `step` counts the forward steps (its calls); `units` the check
# units' own hooks (rows, leaks, positions, transfers, hicache: "transfer" in tables before 2026-12-08).
KINDS = ("write", "step", "allocator", "writer", "units", "flush", "other")
PREFIX, SUFFIX = "owntime-", ".bin"
SLOTS = 3  # per kind: own ns, calls, inclusive ns
_BYTES = 8 * SLOTS * len(KINDS)


class OwnTime:
    """One process's totals: kind k's own ns, calls and inclusive ns at slots 3k, 3k + 1, 3k + 2."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self._open()
        os.register_at_fork(after_in_child=self._open)  # a forked child counts in a file of its own

    def _open(self) -> None:
        Path(self.folder).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(self.folder) / f"{PREFIX}{os.getpid()}{SUFFIX}", os.O_RDWR | os.O_CREAT | os.O_TRUNC,
                     0o644)
        try:
            os.ftruncate(fd, _BYTES)
            self._slots = memoryview(mmap.mmap(fd, _BYTES)).cast("q")
        finally:
            os.close(fd)

    def add(self, kind: str, ns: int) -> None:
        at = SLOTS * KINDS.index(kind)
        self._slots[at] += ns
        self._slots[at + 1] += 1
        self._slots[at + 2] += ns

    def timed(self, kind: str, wrapper: Callable[..., Any]) -> Callable[..., Any]:
        """`wrapper` (a wrapt wrapper) timed: its inclusive time minus the time of the
        sglang call it makes, added to `kind`. A guarded call nested in another's
        sglang call counts in its own kind only."""
        at = SLOTS * KINDS.index(kind)
        clock = time.perf_counter_ns

        def timed_wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
            inner = 0

            def call(*a: Any, **k: Any) -> Any:
                nonlocal inner
                began = clock()
                try:
                    return wrapped(*a, **k)
                finally:
                    inner += clock() - began

            start = clock()
            try:
                return wrapper(call, instance, args, kwargs)
            finally:
                slots, took = self._slots, clock() - start
                slots[at] += took - inner
                slots[at + 1] += 1
                slots[at + 2] += took

        return timed_wrapper


def open_for(folder: Optional[str]) -> Optional[OwnTime]:
    """The process's own-time file when the benchmark asked for one, else None (also
    when the folder cannot be written: one WARNING, and the guard goes on untimed)."""
    if folder is None:
        return None
    try:
        return OwnTime(folder)
    except OSError as exc:
        logger.warning("sglang_oobguard: own time not kept: %s: %s", folder, exc)
        return None


def read(folder: str) -> dict[str, tuple[int, int, int]]:
    """kind -> (own ns, calls, inclusive ns), summed over every process that filed in `folder`."""
    totals = {kind: (0, 0, 0) for kind in KINDS}
    for path in Path(folder).glob(f"{PREFIX}*{SUFFIX}"):
        data = memoryview(path.read_bytes()).cast("q")
        if len(data) != SLOTS * len(KINDS):
            continue  # a file being created this instant
        for k, kind in enumerate(KINDS):
            totals[kind] = tuple(a + b for a, b in zip(totals[kind], data[SLOTS * k:SLOTS * (k + 1)]))
    return totals
