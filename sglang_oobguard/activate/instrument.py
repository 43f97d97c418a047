"""Instrument: install and uninstall; one instrumentor owns everything it wrapped.

`install` discovers the write methods of every KVCache subclass defined so far and
wraps each one a rule covers with `wrapt.wrap_function_wrapper`; a hook on KVCache's
`__init_subclass__` does the same for pool classes that sglang defines later (their
modules load after the plugin runs), and one on `KVCache.__init__` gives every pool
its state as it is built. In each pool module, the binding of upstream's own probe
skips the calls that duplicate ours. The hooks outside the pool classes (the step
check, the idle hook, the fused writers, the units' own hooks, and with liveness on
the tracked allocators' methods: `modulehooks`) each install when their own module
finishes importing (`onimport`), whatever order sglang imports them in; one that
cannot is named (`activation.not_installed`). Every patch is recorded as it is made
(`patches`), and `uninstall` puts back the exact original objects in one place,
newest first.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
from types import ModuleType
from typing import Any, Callable, Optional, Union

from ..checks import flush, reads
from . import activation, modulehooks, onimport
from .modulehooks import ModuleHooks
from .patches import MISSING, Patch, Patches
from ..checks.guard import Guard
from ..checks.registry import UNITS
from ..checks.writes import attach_existing, make_constructor_hook, make_upstream_skip, make_wrapper
from ..model import config as config_mod
from ..model.discover import (AllocatorMethod, Found, Skipped, base_class, discover, pool_classes, resolve,
                              write_methods)
from ..model.log import ensure_visible, logger
from ..model.targets import UPSTREAM_PROBE, is_supported, version_of_sglang
from ..model.violation import Violation
from ..report.files import open_report

class Instrumentor:
    """The installed guard: its Guard and the patches it made."""

    def __init__(self, config: config_mod.Config) -> None:
        self.guard = Guard(config, UNITS)
        self.patches = Patches(self.guard.own_time)
        self.hooks = ModuleHooks(self.guard, self.patches)  # outside the pool classes, as their modules load

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
        for module in modulehooks.modules():
            onimport.watch(module, _on_import)
        return skipped

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


_active: Optional[Instrumentor] = None
_lock = threading.RLock()  # one install at a time; re-entered by the .pth hook's install inside ours


def _on_import(module: ModuleType) -> None:
    """One hook per module for the process (`onimport.watch`): it reaches whichever
    instrumentor is active then (an uninstalled one is not kept alive by it)."""
    if _active is not None:
        _active.hooks.patch_module(module)


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
    if config.liveness and not tracking:  # tracked now if their module is complete, else when it is
        for module in modulehooks.ALLOCATOR_MODULES:
            onimport.watch(module, _on_import)
    elif tracking and not config.liveness:
        _active.untrack_allocators()
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
    _active.guard.reporter.file = open_report(config, version, guarded, skipped + absent, _active.guard.checks_on(),
                                              _active.hooks.unguarded)
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
