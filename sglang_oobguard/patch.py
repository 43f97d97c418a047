"""Install and uninstall, idempotent; `coverage` is the same walk, read-only.

`install` discovers the write methods of every KVCache subclass defined so far and
wraps each one a rule covers with `wrapt.wrap_function_wrapper`; a hook on KVCache's
`__init_subclass__` does the same for pool classes that sglang defines later (their
modules load after the plugin runs). In each pool module, the binding of upstream's
own probe skips the calls that duplicate ours. With liveness on, the tracked
allocators' methods are wrapped too (`liveness`). `uninstall` puts back the exact
original objects, hook included.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType
from typing import Any, Optional, Union

import wrapt

from . import config as config_mod
from .discover import Found, Skipped, discover, resolve, write_methods
from .guard import Guard, make_upstream_skip, make_wrapper
from .liveness import AllocatorMethod, allocator_targets
from .liveness import make_wrapper as make_allocator_wrapper
from .report import Violation, ensure_visible, logger
from .reportfile import open_report
from .targets import BASE_CLASS, MEMORY_POOL, UPSTREAM_PROBE, is_supported, version_of_sglang

_guard: Optional[Guard] = None
_installed: list[Union[Found, AllocatorMethod]] = []
_upstream: dict[str, tuple[ModuleType, Any]] = {}  # module name -> (module, its maybe_detect_oob)
_hooked: Optional[tuple[type, Any]] = None  # (KVCache, its own __init_subclass__ or None)


def base_class() -> Union[type, str]:
    """memory_pool's KVCache, or why it cannot be had."""
    try:
        return getattr(importlib.import_module(MEMORY_POOL), BASE_CLASS)
    except (ImportError, AttributeError) as exc:
        return f"{MEMORY_POOL}.{BASE_CLASS} is not importable: {type(exc).__name__}: {exc}"


def coverage() -> Union[list[Union[Found, Skipped]], str]:
    """Every write method of the pool classes defined so far: Found, or Skipped with why."""
    base = base_class()
    return base if isinstance(base, str) else discover(base)


def _config_for(mode: Optional[str]) -> config_mod.Config:
    """The environment's configuration; an explicit `mode` argument wins, and with
    none an explicit call to install() means strict unless the environment says."""
    return config_mod.from_env(mode=config_mod.parse_mode(mode), default=config_mod.Mode.STRICT)


def install(mode: Optional[str] = None) -> tuple[Union[Found, AllocatorMethod], ...]:
    """Guard every write method that a rule covers on this sglang (and, with
    liveness on, wrap the tracked allocators); returns what was wrapped."""
    global _guard
    config = _config_for(mode)
    if not config.active:
        return ()
    _check_backend(config)
    if _guard is not None:  # already installed: same wrappers, new settings
        _guard.configure(config)
        if config.liveness != any(isinstance(entry, AllocatorMethod) for entry in _installed):
            _track_allocators() if config.liveness else _untrack_allocators()
        return tuple(_installed)
    ensure_visible()
    base = base_class()
    if isinstance(base, str):
        logger.warning("sglang_oobguard: nothing guarded: %s", base)
        return ()
    _guard = Guard(config)
    skipped = _guard_classes(discover(base))
    _hook_new_classes(base)
    if config.liveness:
        _track_allocators()
    version = version_of_sglang()
    guarded = [entry.qualname for entry in _installed if isinstance(entry, Found)]
    logger.info("sglang_oobguard active (pid %d): mode=%s, backend=%s, %d guarded methods (of the pool classes "
                "defined so far), sglang %s, liveness=%s", os.getpid(), config.mode.value, config.backend.value,
                len(guarded), version, "on" if config.liveness else "off")
    if skipped or not is_supported(version):
        logger.warning("sglang_oobguard: sglang %s%s; not guarded: %s", version,
                       "" if is_supported(version) else " is outside the supported range",
                       "; ".join(skipped) or "nothing")
    _guard.reporter.file = open_report(config, version, guarded, skipped)
    return tuple(_installed)


def _guard_classes(entries: list[Union[Found, Skipped]]) -> list[str]:
    """Wrap every Found; returns the Skipped that a reader should know of (a method
    that raises or does nothing by design is left alone without a word)."""
    assert _guard is not None
    skipped = []
    for entry in entries:
        if isinstance(entry, Skipped):
            if not entry.by_design:
                skipped.append(f"{entry.qualname} ({entry.reason})")
            continue
        wrapt.wrap_function_wrapper(entry.owner, entry.method, make_wrapper(entry, _guard))
        _installed.append(entry)
        _skip_upstream_duplicates(sys.modules.get(entry.owner.__module__))
    return skipped


def _track_allocators() -> None:
    """Wrap the tracked allocators' methods; name the allocators whose pools get the
    bound check only."""
    assert _guard is not None
    targets = allocator_targets()
    if isinstance(targets, str):
        logger.warning("sglang_oobguard: liveness NOT tracked: %s", targets)
        return
    methods, untracked = targets
    for target in methods:
        wrapt.wrap_function_wrapper(target.owner, target.method, make_allocator_wrapper(target, _guard))
        _installed.append(target)
    if untracked:
        logger.warning("sglang_oobguard: liveness not tracked for the pools of %s (bound check only)",
                       ", ".join(untracked))


def _untrack_allocators() -> None:
    """Liveness turned off by a later install(): unwrap the allocators and forget the
    shadows, which from now on would miss what the allocators hand out."""
    assert _guard is not None
    _restore([entry for entry in _installed if isinstance(entry, AllocatorMethod)])
    _installed[:] = [entry for entry in _installed if not isinstance(entry, AllocatorMethod)]
    for state in list(_guard.states):
        state.live = None


def _restore(entries: list[Union[Found, AllocatorMethod]]) -> None:
    """Put back the original of each entry that still holds our wrapper."""
    for entry in entries:
        current = entry.owner.__dict__.get(entry.method)
        if getattr(current, "__wrapped__", None) is entry.original:
            setattr(entry.owner, entry.method, entry.original)


def _hook_new_classes(base: type) -> None:
    """Guard each pool class sglang defines from now on, as its class body completes."""
    global _hooked
    own = base.__dict__.get("__init_subclass__")

    def __init_subclass__(cls: Any, **kwargs: Any) -> None:
        if own is not None:
            own.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]  # base is a class
        if _guard is not None:
            late = _guard_classes([resolve(cls, name) for name in write_methods(cls)])
            if late:
                logger.warning("sglang_oobguard: not guarded: %s", "; ".join(late))

    base.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]
    _hooked = (base, own)


def _skip_upstream_duplicates(module: Optional[ModuleType]) -> None:
    """Bind this pool module's `maybe_detect_oob` (0.5.13+) to a wrapper that skips
    the calls our probe has just made; a module without it is left as it is."""
    if module is None or module.__name__ in _upstream:
        return
    original = module.__dict__.get(UPSTREAM_PROBE)
    if original is None:
        return
    assert _guard is not None
    wrapt.wrap_function_wrapper(module, UPSTREAM_PROBE, make_upstream_skip(_guard))
    _upstream[module.__name__] = (module, original)


def _check_backend(config: config_mod.Config) -> None:
    """The Triton backend on a machine with no GPU runs only in Triton's interpreter."""
    if config.backend is not config_mod.Backend.TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        raise config_mod.ConfigError(config_mod.BACKEND_VAR, "triton",
                                     "auto | torch on a machine without a GPU (or set TRITON_INTERPRET=1)")


def uninstall() -> None:
    """Put every original object back; a no-op when not installed."""
    global _guard, _hooked
    _restore(_installed)
    _installed.clear()
    for module, original in _upstream.values():
        if getattr(module.__dict__.get(UPSTREAM_PROBE), "__wrapped__", None) is original:
            setattr(module, UPSTREAM_PROBE, original)
    _upstream.clear()
    if _hooked is not None:
        base, own = _hooked
        if own is None:
            del base.__init_subclass__
        else:
            base.__init_subclass__ = own  # type: ignore[assignment]
        _hooked = None
    _guard = None


def is_installed() -> bool:
    return _guard is not None


def check() -> None:
    """A check point: raise (or, in warn mode, log) what the probes have recorded."""
    if _guard is not None:
        _guard.check()


def violations() -> list[Violation]:
    return [] if _guard is None else _guard.violations()
