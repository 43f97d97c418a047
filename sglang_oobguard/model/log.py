"""Log: the guard's logger, heard even before the process configures logging.

Standard library only.
"""

from __future__ import annotations

import logging
import sys

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


def info_at_exit(message: str, *args: object) -> None:
    """logger.info at interpreter exit, where a handler's stream may be closed already
    (pytest's capture): said only when every stream it would reach is still open."""
    handlers = [*logging.getLogger().handlers, *logger.handlers]
    if all(not getattr(getattr(h, "stream", None), "closed", False) for h in handlers):
        logger.info(message, *args)


class Said:
    """Lines said once per owner (a guard): its first-time test and its internal errors."""

    def __init__(self) -> None:
        super().__init__()
        self._said: set[str] = set()

    def first_time(self, key: str) -> bool:
        """True the first time `key` is asked for: a line said once per guard."""
        said = key in self._said
        self._said.add(key)
        return not said

    def internal_error(self, where: str, exc: BaseException) -> None:
        """The guard's own bookkeeping failed: log once per place, never raise into sglang."""
        if self.first_time(f"internal {where}"):
            logger.error("sglang_oobguard: internal error in %s, left unchecked: %s: %s",
                         where, type(exc).__name__, exc)
