"""sglang-oobguard: bounds-checks every KV-cache write of an unmodified sglang.

Importing the package stays cheap (standard library only): the heavy parts load on
first use of the API below, so the entry point costs nothing when the guard is off.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from .config import ConfigError

__all__ = ["install", "uninstall", "is_installed", "check", "violations",
           "KVOutOfBoundsError", "ConfigError", "Violation"]

_LAZY = {name: ".patch" for name in ("install", "uninstall", "is_installed", "check", "violations")}
_LAZY.update(KVOutOfBoundsError=".report", Violation=".report")


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
