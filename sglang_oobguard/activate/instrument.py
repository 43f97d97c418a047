"""Instrument: install and uninstall; one instrumentor owns everything it wrapped.

`install` discovers the write methods of every KVCache subclass defined so far and
wraps each one a rule covers with `wrapt.wrap_function_wrapper`; a hook on KVCache's
`__init_subclass__` does the same for pool classes that sglang defines later (their
modules load after the plugin runs), and one on `KVCache.__init__` gives every pool
its state as it is built. In each pool module, the binding of upstream's own probe
skips the calls that duplicate ours. With liveness on, the tracked allocators'
methods are wrapped too (`liveness`). Every patch is recorded as it is made, and
`uninstall` puts back the exact original objects in one place, newest first.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Union

import wrapt

from ..checks import flush, reads
from . import activation
from .patches import MISSING, Patch, Patches
from ..checks.guard import Guard
from ..checks.registry import UNITS
from ..checks.stepcheck import make_forward_hook
from ..checks.writers import make_writer_wrapper
from ..checks.writes import attach_existing, make_constructor_hook, make_upstream_skip, make_wrapper
from ..model import config as config_mod
from ..model.discover import (AllocatorMethod, Found, Skipped, allocator_targets, base_class, defining, discover,
                              pool_classes, resolve, write_methods)
from ..model.swatargets import SWA_ALLOCATOR_MODULE
from ..model.log import ensure_visible, logger
from ..model.targets import (FUSED_WRITERS, IDLE_HOOK, STEP_HOOK, UPSTREAM_PROBE, is_supported,
                             version_of_sglang)
from ..model.violation import Violation
from ..report.files import open_report

class Instrumentor:
    """The installed guard: its Guard and the patches it made."""

    def __init__(self, config: config_mod.Config) -> None:
        self.guard = Guard(config, UNITS)
        self.patches = Patches(self.guard.own_time)

    def instrument(self, base: type) -> list[str]:
        """Wrap what discovery finds; returns the methods a reader should know are not guarded."""
        skipped = self.guard_classes(discover(base))
        _hook_pools(pool_classes(base), self.guard, self.patches.of_kind("other"))
        self.patches.wrap(base, "__init__", make_constructor_hook(self.guard), "other")
        table_pool = getattr(sys.modules.get(base.__module__), "ReqToTokenPool", None)
        if table_pool is not None:  # the read check's memory, made with the table (liveness on)
            self.patches.wrap(table_pool, "__init__", reads.make_table_hook(self.guard), "other")
        self._hook_new_classes(base)
        classes = set(pool_classes(base))  # exact types: an ABC subclass check per object costs seconds
        attach_existing(self.guard, (obj for obj in gc.get_objects() if type(obj) in classes))
        if self.guard.config.liveness:
            self.track_allocators()
        for module in _hooked_modules():
            _when_imported(module)
        return skipped

    def patch_module(self, module: ModuleType) -> None:
        """A module outside the pools was imported: hook what the targets name in it."""
        if module.__name__ == STEP_HOOK.module:
            self._hook_step(module)
        if module.__name__ == IDLE_HOOK.module:
            self._hook_idle(module)
        for writer in FUSED_WRITERS:
            if module.__name__ in writer.modules:
                try:
                    self._wrap_writer(module, writer)
                except Exception as exc:  # one writer that does not fit leaves the others guarded
                    self.guard.internal_error(f"wrapping {writer.function}", exc)

    def _hook_step(self, module: ModuleType) -> None:
        owner = getattr(module, STEP_HOOK.owner, None)
        if owner is None or STEP_HOOK.method not in owner.__dict__:
            logger.warning("sglang_oobguard: %s.%s.%s not found: no forward-step check in this sglang",
                           STEP_HOOK.module, STEP_HOOK.owner, STEP_HOOK.method)
            return
        self.patches.wrap(owner, STEP_HOOK.method, make_forward_hook(self.guard, STEP_HOOK.pool_attr), "step")

    def _hook_idle(self, module: ModuleType) -> None:
        owner, method = defining(getattr(module, IDLE_HOOK.owner, None), IDLE_HOOK.methods)
        if owner is None:
            logger.warning("sglang_oobguard: no %s.%s.(%s): counts are filed by the idle thread and at exit only",
                           IDLE_HOOK.module, IDLE_HOOK.owner, " or ".join(IDLE_HOOK.methods))
            return
        self.patches.wrap(owner, method, flush.make_idle_hook(self.guard), "other")

    def _wrap_writer(self, module: ModuleType, writer: Any) -> None:
        if writer.function in module.__dict__:
            self.patches.wrap(module, writer.function,
                       make_writer_wrapper(writer, self.guard, module.__dict__[writer.function]), "writer")

    def guard_classes(self, entries: list[Union[Found, Skipped]]) -> list[str]:
        """Wrap every Found; returns the Skipped that a reader should know of (a method
        that raises or does nothing by design is left alone without a word)."""
        skipped = []
        for entry in entries:
            if isinstance(entry, Skipped):
                if not entry.by_design:
                    skipped.append(f"{entry.qualname} ({entry.reason})")
                continue
            self.patches.wrap(entry.owner, entry.method, make_wrapper(entry, self.guard), "write", entry)
            self.guard.found.append(entry)
            for site, ids in zip(entry.sites, entry.rule.ids):
                self.guard.name_site(site, ids.bound.rule)
            self._skip_upstream_duplicates(sys.modules.get(entry.owner.__module__))
        return skipped

    def track_allocators(self) -> None:
        """Wrap the tracked allocators' methods; name those whose pools get the bound check only."""
        targets = allocator_targets()
        if isinstance(targets, str):
            logger.warning("sglang_oobguard: liveness NOT tracked: %s", targets)
            return
        methods, untracked = targets
        for target in methods:
            self.patches.wrap(target.owner, target.method, _allocator_wrapper(target, self.guard), "allocator", target)
        if untracked:
            logger.warning("sglang_oobguard: liveness not tracked for the pools of %s (bound check only)",
                           ", ".join(untracked))

    def untrack_allocators(self) -> None:
        """Liveness turned off by a later install(): unwrap the allocators and forget the
        shadows, which from now on would miss what the allocators hand out."""
        self.patches.undo(lambda p: isinstance(p.entry, AllocatorMethod))
        for state in list(self.guard.states):
            state.live = None

    def _hook_new_classes(self, base: type) -> None:
        """Guard each pool class sglang defines from now on, as its class body completes."""
        own = base.__dict__.get("__init_subclass__")

        def __init_subclass__(cls: Any, **kwargs: Any) -> None:
            if own is not None:
                own.__func__(cls, **kwargs)
            else:
                super(base, cls).__init_subclass__(**kwargs)  # type: ignore[arg-type]  # base is a class
            late = self.guard_classes([resolve(cls, name) for name in write_methods(cls)])
            _hook_pools([cls], self.guard, self.patches.of_kind("other"))
            if late:
                logger.warning("sglang_oobguard: not guarded: %s", "; ".join(late))

        self.patches.made.append(Patch(base, "__init_subclass__", own if own is not None else MISSING))
        base.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment]

    def _skip_upstream_duplicates(self, module: Optional[ModuleType]) -> None:
        """Bind this pool module's `maybe_detect_oob` (0.5.13+) to a wrapper that skips
        the calls our probe has just made; a module without it is left as it is, and so
        is every module while sglang's flag is off (its probe returns at once then)."""
        if self.guard.config.upstream_probe and module is not None and UPSTREAM_PROBE in module.__dict__:
            self.patches.wrap(module, UPSTREAM_PROBE, make_upstream_skip(self.guard), "write")



def _hook_pools(classes: list[type], guard: Guard, wrap: Callable[[Any, str, Callable[..., Any]], None]) -> None:
    """The units' hooks on sglang's pool classes (the SWA pools' mapping hook)."""
    for unit in UNITS:
        if unit.pool_hook is not None:
            unit.pool_hook(classes, guard, wrap)


def _allocator_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """A tracked allocator method's wrapper: the first unit's that owns its family."""
    return next(wrapper for unit in UNITS if unit.allocators is not None
                for wrapper in [unit.allocators(target, guard)] if wrapper is not None)


_active: Optional[Instrumentor] = None
_lock = threading.RLock()  # one install at a time; re-entered by the .pth hook's install inside ours
_watched: set[str] = set()  # modules with our post-import hook (wrapt keeps hooks for the process)


def _hooked_modules() -> list[str]:
    return [STEP_HOOK.module, IDLE_HOOK.module, SWA_ALLOCATOR_MODULE, *(m for unit in UNITS for m in unit.modules),
            *(module for writer in FUSED_WRITERS for module in writer.modules)]


def _when_imported(module: str) -> None:
    """Patch `module` for the active instrumentor: now if it is imported, else when it
    is. One hook per module for the process, which reaches whichever instrumentor is
    active then (an uninstalled one is not kept alive by it)."""
    if module in _watched:
        if module in sys.modules and _active is not None:
            _on_import(sys.modules[module])
        return
    _watched.add(module)
    wrapt.register_post_import_hook(_on_import, module)


def _on_import(module: ModuleType) -> None:
    if _active is not None:
        try:
            for unit in UNITS:
                if unit.hook is not None and module.__name__ in unit.modules:
                    unit.hook(module, _active.guard, _active.patches.of_kind("transfer"))
            if module.__name__ == SWA_ALLOCATOR_MODULE and _active.guard.config.liveness:
                _active.track_allocators()  # the SWA allocators' module loads after the plugin runs
            _active.patch_module(module)
        except Exception as exc:  # never raised into sglang's import
            _active.guard.internal_error(f"patching {module.__name__}", exc)


def _config_for(mode: Optional[str]) -> config_mod.Config:
    """The environment's configuration; an explicit `mode` argument wins, and with
    none an explicit call to install() means strict unless the environment says."""
    return config_mod.from_env(mode=config_mod.parse_mode(mode), default=config_mod.Mode.STRICT)


def install(mode: Optional[str] = None) -> tuple[Union[Found, AllocatorMethod], ...]:
    """Guard every write method that a rule covers on this sglang (and, with
    liveness on, wrap the tracked allocators); returns what was wrapped."""
    config = _config_for(mode)
    if not config.active:
        return ()
    _check_backend(config)
    with _lock:
        if _active is not None:
            return _reconfigure(config)
        ensure_visible()
        base = base_class()  # importing memory_pool may fire the .pth hook, which installs first
        if _active is not None:
            return _reconfigure(config)
        if isinstance(base, str):
            logger.warning("sglang_oobguard: nothing guarded: %s", base)
            return ()
        return _install(config, base)


def _reconfigure(config: config_mod.Config) -> tuple[Union[Found, AllocatorMethod], ...]:
    """Already installed (whichever door came first): the same wrappers, new settings."""
    assert _active is not None
    tracking = any(isinstance(entry, AllocatorMethod) for entry in _active.patches.entries)
    _active.guard.configure(config)
    for entry in _active.guard.found:  # sglang's flag on now: its duplicate probes skipped from now on
        _active._skip_upstream_duplicates(sys.modules.get(entry.owner.__module__))
    if config.liveness != tracking:
        _active.track_allocators() if config.liveness else _active.untrack_allocators()
    return _active.patches.entries


def _install(config: config_mod.Config, base: type) -> tuple[Union[Found, AllocatorMethod], ...]:
    global _active
    _active = Instrumentor(config)
    skipped = _active.instrument(base)
    flush.watch(_active.guard)  # reports reach the folder when the server idles and at exit
    version = version_of_sglang()
    guarded = [entry.qualname for entry in _active.patches.entries if isinstance(entry, Found)]
    logger.info("%s", activation.line(config, len(guarded), version, _active.guard.checks_on()))
    absent = activation.absent_hooks()
    if skipped or absent or not is_supported(version):
        logger.warning("sglang_oobguard: sglang %s%s; not guarded: %s", version,
                       "" if is_supported(version) else " is outside the supported range",
                       "; ".join(skipped + absent) or "nothing")
    _active.guard.reporter.file = open_report(config, version, guarded, skipped + absent, _active.guard.checks_on())
    return _active.patches.entries


def _check_backend(config: config_mod.Config) -> None:
    """The Triton backend on a machine with no GPU runs only in Triton's interpreter."""
    if config.backend is not config_mod.Backend.TRITON or os.environ.get("TRITON_INTERPRET") == "1":
        return
    import torch

    if not torch.cuda.is_available():
        raise config_mod.ConfigError(config_mod.BACKEND_VAR, "triton",
                                     "auto | torch on a machine without a GPU (or set TRITON_INTERPRET=1)")


def uninstall() -> None:
    """Put every original object back; a no-op when not installed. What the device
    recorded and no step read yet is published first (a shutdown: it may wait)."""
    global _active
    with _lock:
        if _active is not None:
            flush.at_shutdown(_active.guard)
            _active.patches.undo()
            _active.guard.forget()
            _active = None


def is_installed() -> bool:
    return _active is not None


def check() -> None:
    """A check point: raise (or, in warn mode, log) what the probes have recorded."""
    if _active is not None:
        _active.guard.check()


def violations() -> list[Violation]:
    return [] if _active is None else list(_active.guard.reporter.latest.values())
