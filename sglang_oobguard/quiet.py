"""Quiet: keeps what other code says (sglang's import-time warnings such as "Only
CUDA, HIP and XPU support AWQ currently", log records, our own activation lines) out
of the reports that `doctor` and `demo` print themselves. The log records are kept,
for a caller that wants to show one of them as part of its story."""

from __future__ import annotations

import logging
import warnings
from contextlib import contextmanager
from typing import Iterator


class Captured(logging.Handler):
    """Keeps every record that reaches the root logger. While it is a root handler,
    our own stderr fallback (`report._FallbackHandler`) stays silent too."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, logger: str, level: int = logging.NOTSET) -> list[str]:
        return [r.getMessage() for r in self.records if r.name == logger and r.levelno >= level]


@contextmanager
def quiet() -> Iterator[Captured]:
    """Python warnings ignored and log records captured, for the block; the root
    logger's own handlers (if the process set any) are set aside meanwhile."""
    root = logging.getLogger()
    captured = Captured()
    saved = root.handlers[:]
    root.handlers[:] = [captured]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield captured
    finally:
        root.handlers[:] = saved
