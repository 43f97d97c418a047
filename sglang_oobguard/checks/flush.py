"""Flush: what the device recorded reaches the report even when no step comes to read it.

A step boundary reads what landed (`record.PoolRecord.poll`); three moments have no
next step, and are covered here:

- an idle server (warn mode, records on a GPU): a daemon thread (`Idle`) looks every
  `IDLE_S`. Once no step and no new copy has happened since its last look, it polls
  every record (never waits: by then the device is idle and the copies have landed)
  and starts one more copy, read at its next look. A timer thread, because an idle
  server makes no call into the guard at all: a check "at the next call" would wait
  for the next request. It takes only the records' locks, never a CUDA sync. Raise
  and strict mode leave a record to the next step boundary, which raises into
  sglang (a report taken by the thread would have no caller to raise into), or to
  the exit flush.
- process exit (atexit), shutdown and uninstall: `flush(guard)` waits for each record's copies
  (an event synchronize) and publishes what they read.

The same moments file what each check did (`report.counts`): a `counts` record at a
step's end at most once a second, when the server idles after new work (a server's
schedulers are killed, not exited: the last second before a kill can be lost), a final one
and one log line at exit.
- before the report folder is read in this process: the pytest plugin's
  sessionfinish calls check() (which flushes); `python -m sglang_oobguard report`
  runs in another process and reads what the guarded processes filed: their idle
  and exit flushes.

What an exit flush finds is published as at a step boundary: filed in the report
folder and logged; in raise and strict mode the exception has no caller to reach
there, so it is logged at ERROR instead.
A process killed by SIGKILL runs no atexit; the idle flush is what covers it.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
import weakref
from typing import Any, Optional

from ..model.config import Mode
from ..model.log import info_at_exit, logger
from ..probes import device
from ..report import counts
from ..report.reporter import KVOutOfBoundsError
from .guard import Guard

IDLE_S = 0.5  # seconds without a step or a new copy before the idle flush

_guards: "weakref.WeakSet[Guard]" = weakref.WeakSet()
_lock = threading.Lock()
_idle: Optional["Idle"] = None
_atexit_registered = False


def watch(guard: Guard) -> None:
    """Flush this guard's records when the server idles and at process exit."""
    global _atexit_registered
    with _lock:
        _guards.add(guard)
        if not _atexit_registered:
            atexit.register(at_exit)
            os.register_at_fork(after_in_child=_after_fork)
            _atexit_registered = True
        _start_idle()


def _start_idle() -> None:
    global _idle
    if _idle is None:
        _idle = Idle(IDLE_S)
        _idle.start()


def _after_fork() -> None:
    """A forked child has no threads but the one that forked: its own idle flusher."""
    global _idle, _lock
    _lock = threading.Lock()  # the parent's may have been held at the fork
    _idle = None
    for guard in list(_guards):  # so may a record's, by the parent's idle flusher
        for state in list(guard.states):
            state.record.after_fork()
    if len(_guards):
        _start_idle()


def _publish(guard: Guard, state: Any, record: Any) -> None:
    """Publish outside any sglang call: a raise has no caller, so it is logged."""
    try:
        guard.publish(state, record)
    except KVOutOfBoundsError as exc:
        logger.error("sglang_oobguard: %s (found while no step ran: filed, logged, raised at no caller)", exc)


def flush(guard: Guard) -> None:
    """Wait for every record's copies and publish them (exit, shutdown)."""
    for state in list(guard.states):
        _publish(guard, state, state.record.flush())


def at_shutdown(guard: Guard) -> None:
    """Exit or uninstall: flush one guard; never raise into the interpreter's exit or
    the caller of uninstall."""
    try:
        flush(guard)
    except Exception as exc:  # e.g. a CUDA error after a device-side assert
        logger.error("sglang_oobguard: flush at shutdown failed: %s: %s", type(exc).__name__, exc)


COUNTS_EVERY_S = 1.0  # while steps run, counts are filed at most this often


def file_counts_while_busy(guard: Guard) -> None:
    """At a step's end, at most once a COUNTS_EVERY_S: a scheduler killed while busy, or
    before its idle method runs again (sglang's shutdown), keeps what it counted until then."""
    now = time.monotonic()
    if now >= guard.counts.due:
        guard.counts.due = now + COUNTS_EVERY_S
        file_counts(guard)


def file_counts(guard: Guard, final: bool = False) -> None:
    """File what each check did since the last filing (final: always, and the exit line).
    Called from a step's end, sglang's idle method and exit: it never raises into them."""
    try:
        if not (final or guard.counts.changed()):
            return
        snapshot = guard.counts.filing(guard.checks_on())
        if guard.reporter.file is not None:
            guard.reporter.file.counts(snapshot, final)
        if final:
            info_at_exit("sglang_oobguard: checked in this process (pid %d): %s", os.getpid(), counts.line(snapshot))
    except Exception as exc:
        guard.internal_error("filing the counts", exc)


def make_idle_hook(guard: Guard) -> Any:
    """The wrapt wrapper of sglang's scheduler idle method: the units' idle work before it (a
    strict report raises into sglang's loop, as sglang's own failed check does), the counts after."""

    def wrapper(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        for unit in guard.units.values():  # the units' idle work (the leak sweep), before sglang's own check
            if unit.idle is not None and unit.name in (guard.config.checks or ()):
                try:
                    unit.idle(guard, instance)
                except KVOutOfBoundsError:
                    raise
                except Exception as exc:
                    guard.internal_error(f"{unit.name} at idle", exc)
        result = wrapped(*args, **kwargs)
        file_counts(guard)
        return result

    return wrapper


def at_exit() -> None:
    """Process exit: flush every live guard, and file its counts."""
    for guard in list(_guards):
        at_shutdown(guard)
        file_counts(guard, final=True)


def idle_tick(guard: Guard, seen: dict) -> None:
    """One look of the idle flusher at one guard. `seen`: what it saw at its last look
    (the step number and the copies started), kept per guard by the caller."""
    now = (guard.steps.number, sum(state.record.started for state in list(guard.states)))
    if seen.get("last") != now:  # a step ran, or a copy was started: not idle yet
        seen["last"] = now
        seen["restarted"] = False
        return
    if guard.steps.open:
        return
    file_counts(guard)
    if guard.config.mode is not Mode.WARN:
        return
    states = [state for state in list(guard.states) if device.is_gpu(state.device)]
    for state in states:
        _publish(guard, state, state.record.poll(restart=False))
    if not seen.get("restarted"):  # one more copy of what the last probes recorded, read at the next look
        seen["restarted"] = True
        for state in states:
            state.record.start_copy()
        seen["last"] = (guard.steps.number, sum(state.record.started for state in list(guard.states)))


class Idle(threading.Thread):
    """The idle flusher: a daemon thread (it never keeps the process alive)."""

    def __init__(self, period: float) -> None:
        super().__init__(name="sglang_oobguard-idle-flush", daemon=True)
        self.period = period
        self.stop = threading.Event()
        self.seen: "weakref.WeakKeyDictionary[Guard, dict]" = weakref.WeakKeyDictionary()

    def run(self) -> None:
        while not self.stop.wait(self.period):
            if device.backend() is not device.CUDA:  # a test's device model: the test ticks itself
                continue
            for guard in list(_guards):
                began = time.perf_counter_ns()
                try:
                    idle_tick(guard, self.seen.setdefault(guard, {}))
                except Exception as exc:
                    guard.internal_error("idle flush", exc)
                if guard.own_time is not None:
                    guard.own_time.add("flush", time.perf_counter_ns() - began)
