"""Install and uninstall: one pass over `targets.TARGETS` each way, idempotent.

`install` wraps each target that resolves on the installed sglang with
`wrapt.wrap_function_wrapper`, once however often it is called; `uninstall` puts
the exact original function objects back. `coverage` is the same walk, read-only,
for the activation log line and `doctor`. While installed, memory_pool's binding of
upstream's own probe skips the calls that duplicate ours.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import replace
from typing import Optional, Union

import wrapt

from . import config as config_mod
from .guard import Guard, make_upstream_skip, make_wrapper
from .report import Violation, ensure_visible, logger
from .targets import MEMORY_POOL, TARGETS, UPSTREAM_PROBE, Resolved, Target, is_supported, resolve, version_of_sglang

_guard: Optional[Guard] = None
_installed: list[Resolved] = []
_upstream: Optional[tuple[object, object]] = None  # (memory_pool, its original maybe_detect_oob)


def coverage() -> list[tuple[Target, Union[Resolved, str]]]:
    """Every target with what it resolves to here: a Resolved, or why not."""
    out: list[tuple[Target, Union[Resolved, str]]] = []
    modules: dict[str, object] = {}
    for target in TARGETS:
        if target.module not in modules:
            try:
                modules[target.module] = importlib.import_module(target.module)
            except ImportError as exc:
                modules[target.module] = f"{target.module} does not import: {exc}"
        module = modules[target.module]
        out.append((target, module if isinstance(module, str) else resolve(target, module)))
    return out


def _config_for(mode: Optional[str]) -> config_mod.Config:
    """The environment's configuration; an explicit `mode` argument wins, and with
    none an explicit call to install() means strict unless the environment says."""
    env = config_mod.from_env()
    chosen = config_mod.parse_mode(mode)
    if chosen is not None:
        return replace(env, mode=chosen)
    if env.active or os.environ.get(config_mod.MODE_VAR, "").lower() == "off":
        return env
    return replace(env, mode=config_mod.Mode.STRICT)


def install(mode: Optional[str] = None) -> tuple[Target, ...]:
    """Guard every target that fits this sglang; returns the guarded targets."""
    global _guard
    config = _config_for(mode)
    if not config.active:
        return ()
    _check_backend(config)
    if _guard is not None:  # already installed: same wrappers, new settings
        _guard.configure(config)
        return tuple(r.target for r in _installed)
    ensure_visible()
    guard = Guard(config)
    skipped: list[str] = []
    for target, found in coverage():
        if isinstance(found, str):
            skipped.append(f"{target.qualname} ({found})")
            continue
        wrapt.wrap_function_wrapper(found.owner, found.target.method, make_wrapper(found, guard))
        _installed.append(found)
    _skip_upstream_duplicates()
    _guard = guard
    version = version_of_sglang()
    logger.info("sglang_oobguard active (pid %d): mode=%s, backend=%s, %d guarded methods, sglang %s",
                os.getpid(), config.mode.value, config.backend.value, len(_installed), version)
    if skipped or not is_supported(version):
        logger.warning("sglang_oobguard: sglang %s%s; not guarded: %s", version,
                       "" if is_supported(version) else " is outside the supported range",
                       "; ".join(skipped) or "nothing")
    return tuple(r.target for r in _installed)


def _skip_upstream_duplicates() -> None:
    global _upstream
    if not _installed:
        return
    module = importlib.import_module(MEMORY_POOL)
    original = getattr(module, UPSTREAM_PROBE, None)
    if original is None:  # before 0.5.13: no in-source probe
        return
    wrapt.wrap_function_wrapper(module, UPSTREAM_PROBE,
                                make_upstream_skip(frozenset(r.target.label for r in _installed)))
    _upstream = (module, original)


def _check_backend(config: config_mod.Config) -> None:
    """The Triton backend on a machine with no GPU runs only in Triton's interpreter."""
    if config.backend is not config_mod.Backend.TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        raise config_mod.ConfigError(config_mod.BACKEND_VAR, "triton",
                                     "auto | torch on a machine without a GPU (or set TRITON_INTERPRET=1)")


def uninstall() -> None:
    """Put every original function object back; a no-op when not installed."""
    global _guard, _upstream
    for found in _installed:
        current = found.owner.__dict__.get(found.target.method)
        if getattr(current, "__wrapped__", None) is found.original:
            setattr(found.owner, found.target.method, found.original)
    _installed.clear()
    if _upstream is not None:
        module, original = _upstream
        if getattr(getattr(module, UPSTREAM_PROBE), "__wrapped__", None) is original:
            setattr(module, UPSTREAM_PROBE, original)
        _upstream = None
    _guard = None


def is_installed() -> bool:
    return _guard is not None


def check() -> None:
    """A check point: raise (or, in warn mode, log) what the probes have recorded."""
    if _guard is not None:
        _guard.check()


def violations() -> list[Violation]:
    return [] if _guard is None else _guard.violations()
