"""Quiet: keeps what other code says (sglang's import-time warnings such as "Only
CUDA, HIP and XPU support AWQ currently", torch's own log lines, our activation
lines) out of the reports that `doctor` and `demo` print themselves on stdout. The
log records that reach the root logger are kept, for a caller that wants to show one
of them as part of its story."""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from typing import Iterator


class Captured(logging.Handler):
    """Keeps every record that reaches the root logger. While it is a root handler,
    our own stderr fallback (`log._FallbackHandler`) stays silent too."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, logger: str, level: int = logging.NOTSET) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == logger and r.levelno >= level]


@contextlib.contextmanager
def quiet() -> Iterator[Captured]:
    """For the block: Python warnings ignored, log records captured (the root
    logger's own handlers, if the process set any, set aside), and stderr, Python's
    and the file descriptor's (libraries with handlers of their own, C code), sent
    to nowhere."""
    root = logging.getLogger()
    captured = Captured()
    saved = root.handlers[:]
    root.handlers[:] = [captured]
    try:
        with warnings.catch_warnings(), _stderr_discarded():
            warnings.simplefilter("ignore")
            yield captured
    finally:
        root.handlers[:] = saved


@contextlib.contextmanager
def _stderr_discarded() -> Iterator[None]:
    sys.stderr.flush()
    kept = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        os.dup2(kept, 2)
        os.close(kept)
