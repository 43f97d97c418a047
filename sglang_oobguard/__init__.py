"""sglang-oobguard: bounds-checks every KV-cache write of an unmodified sglang.

Importing the package costs nothing (no import at all): the entry point must be free
when the guard is off, so the API below loads on first use.
"""

from __future__ import annotations

from importlib import import_module

__all__ = ["install", "uninstall", "is_installed", "check", "violations",
           "KVOutOfBoundsError", "ConfigError", "Violation"]

_LAZY = {name: ".activate.instrument" for name in ("install", "uninstall", "is_installed", "check", "violations")}
_LAZY.update(KVOutOfBoundsError=".report.reporter", Violation=".model.violation",
             ConfigError=".model.config")


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
