"""Report files: each guarded process appends JSON lines to a file of its own in
SGLANG_OOBGUARD_REPORT_DIR, for a CI job to gate on (`summary` reads them back).

One activation record when the guard installs (naming the checks that are on, and
in `unguarded` each hook that could not install after its module loaded), one
`unguarded` record for each such hook after it, one `role` record where the
activation came before the sglang process entry was running (a `.pth` install on a
release without the plugin loader: the scheduler's ranks are known only later), one
record per reported violation: `Violation.as_dict()`, so every field the report
has (or gains) is in the file with no second schema; and a `counts` record
(`report.counts`: what each check did) whenever the server idles after new work, and
a final one at exit. Each line is one `os.write` on
an O_APPEND descriptor, so concurrent writers never interleave within a line. Writes
happen when a violation is published, never on the guarded write's path, and never
raise into sglang: a folder that cannot be written gets one warning and the guard
goes on without its file.

Standard library only.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import weakref
from typing import Any, Optional, Sequence

from ..model.log import logger
from ..model.violation import Violation

FORMAT = 1  # bumped when a record's meaning changes; `summary` reads this format
ACTIVATION, VIOLATION, COUNTS, UNGUARDED, ROLE = "activation", "violation", "counts", "unguarded", "role"
PREFIX, SUFFIX = "oobguard-", ".jsonl"


def file_name(host: str, pid: int) -> str:
    """`oobguard-HOST-PID.jsonl`: one file per process, unique across the hosts of a job."""
    return f"{PREFIX}{host.replace(os.sep, '_')}-{pid}{SUFFIX}"


class ReportFile:
    """The process's report file. Opened lazily and again after a fork, so that a
    child's records land in a file of its own, headed by its own activation record."""

    def __init__(self, folder: str, activation: dict[str, Any]) -> None:
        self.folder = folder
        self.activation = activation
        self._fd: Optional[int] = None
        self._close: Optional[weakref.finalize] = None  # closes _fd when this object goes (uninstall)
        self._pid = -1
        self._host = ""
        self._broken = False
        self._role_pending = False  # the activation named no sglang process: looked for at each filing

    def start(self) -> None:
        """Create the file with its activation record."""
        self._append(None)

    def violation(self, pool_key: int, violation: Violation) -> None:
        self._append({"kind": VIOLATION, "pool_key": pool_key, "violation": violation.as_dict()})

    def counts(self, counts: dict[str, dict[str, int]], final: bool) -> None:
        if self._role_pending and self._pid == os.getpid():
            role, ranks = process_role()
            if role is not None:
                self._role_pending = False
                self._append({"kind": ROLE, "role": role, "ranks": ranks})
        self._append({"kind": COUNTS, "counts": counts, "final": final})

    def unguarded(self, entry: dict[str, Any]) -> None:
        """A hook that did not install after the activation record: its own record, and in
        the activation record of any child forked from now on."""
        self.activation.setdefault(UNGUARDED, []).append(entry)
        self._append({"kind": UNGUARDED, **entry})

    def _append(self, record: Optional[dict[str, Any]]) -> None:
        """Write one record (None: only make sure the file is open); never raises. The
        first failure is logged once, and the file is given up."""
        if self._broken:
            return
        try:
            if self._pid != os.getpid():
                self._open()
            if record is not None:
                self._write(record)
        except Exception as exc:  # the guard is an observer: a report it cannot file must not fail sglang
            self._broken = True
            logger.warning("sglang_oobguard: cannot write reports to %s (%s: %s); the guard goes on without "
                           "a report file", self.folder, type(exc).__name__, exc)

    def _open(self) -> None:
        if self._close is not None:
            self._close()  # a forked child: its copy of the parent's descriptor
        os.makedirs(self.folder, exist_ok=True)
        self._host, self._pid = socket.gethostname(), os.getpid()
        self._fd = os.open(os.path.join(self.folder, file_name(self._host, self._pid)),
                           os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._close = weakref.finalize(self, os.close, self._fd)
        self._write({"kind": ACTIVATION, "format": FORMAT, **self.activation})
        self._role_pending = self.activation.get("role") is None

    def _write(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, "time": time.time(), "pid": self._pid, "host": self._host},
                          default=str, separators=(",", ":")) + "\n"
        assert self._fd is not None
        os.write(self._fd, line.encode())


def activation_record(config: Any, sglang_version: str, guarded: list[str], not_guarded: list[str],
                      checks: tuple[str, ...] = (), unguarded: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What the activation record says of this process: the guard's settings, what it
    guards, the hooks that did not install, and which sglang process (and ranks) it
    runs in, where that is known."""
    role, ranks = process_role()
    return {"oobguard": _our_version(), "sglang": sglang_version, "mode": config.mode.value,
            "backend": config.backend.value, "liveness": config.liveness, "finite": config.finite,
            "checks": list(checks), "guarded": len(guarded),
            "methods": guarded, "not_guarded": not_guarded, UNGUARDED: list(unguarded), "role": role, "ranks": ranks,
            "argv": " ".join(sys.argv)[:300]}


def process_role() -> tuple[Optional[str], dict[str, int]]:
    """The sglang process entry this runs in (e.g. `run_scheduler_process`, whose first
    statement runs the plugin loader) and its `*_rank` arguments; plus torchrun's
    RANK, LOCAL_RANK and WORLD_SIZE. (None, {}) where neither is known. The calling
    thread's frames first, then the main thread's (a filing from sglang's forward thread)."""
    ranks = {name.lower(): int(os.environ[name]) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")
             if os.environ.get(name, "").isdigit()}
    entry = _entry(sys._getframe(1))
    if entry is None:  # a filing from sglang's forward thread: the entry runs on the main thread
        entry = _entry(sys._current_frames().get(threading.main_thread().ident or -1))
    if entry is None:
        return None, ranks
    ranks.update({key: value for key, value in entry.f_locals.items() if key.endswith("_rank") and type(value) is int})
    return entry.f_code.co_name, ranks


def _entry(frame: Any) -> Any:
    """The frame of an sglang process entry (`run_*_process` in an sglang module) at or
    above `frame`; None."""
    while frame is not None:
        name, module = frame.f_code.co_name, str(frame.f_globals.get("__name__", ""))
        if module.startswith("sglang.") and name.startswith("run_") and name.endswith("_process"):
            return frame
        frame = frame.f_back
    return None


def _our_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang-oobguard")
    except PackageNotFoundError:
        return "unknown"


def open_report(config: Any, sglang_version: str, guarded: list[str], not_guarded: list[str],
                checks: tuple[str, ...] = (), unguarded: Sequence[dict[str, Any]] = ()) -> Optional[ReportFile]:
    """The process's report file with its activation record written, when the
    configuration names a folder; None otherwise."""
    if config.report_dir is None:
        return None
    report = ReportFile(config.report_dir, activation_record(config, sglang_version, guarded, not_guarded, checks, unguarded))
    report.start()
    return report
