"""Module hooks: what the guard wraps outside the pool classes, in each module as it finishes importing.

The forward-step check (`ModelRunner.forward`), the scheduler's idle hook, the fused
writers, the units' own hooks (PD's and HiCache's) and, with liveness on, the tracked
allocators' methods. `instrument` watches their modules (`onimport`) and hands each
one here when it has finished importing, whatever order sglang imports them in. A hook
that still cannot install is a loud WARNING naming what is unguarded, and an entry of
the activation record (`activation.not_installed`): `report DIR` fails on it.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any, Callable

from ..checks import flush
from ..checks.guard import Guard
from ..checks.registry import UNITS
from ..checks.stepcheck import make_forward_hook
from ..checks.writers import make_writer_wrapper
from ..model.discover import AllocatorMethod, allocator_targets, defining
from ..model.log import logger
from ..model.swatargets import SWA_ALLOCATOR_MODULE
from ..model.targets import ALLOCATOR_MODULE, FUSED_WRITERS, IDLE_HOOK, STEP_HOOK, Writer
from . import activation
from .activation import Missing
from .patches import Patches

ALLOCATOR_MODULES = (ALLOCATOR_MODULE, SWA_ALLOCATOR_MODULE)  # the SWA allocators' module (0.5.16+) loads later


def modules() -> list[str]:
    """Every module a hook waits for."""
    return [STEP_HOOK.module, IDLE_HOOK.module, *ALLOCATOR_MODULES, *(m for unit in UNITS for m in unit.modules),
            *(module for writer in FUSED_WRITERS for module in writer.modules)]


class ModuleHooks:
    """The installed guard's hooks outside the pool classes, and those that did not install."""

    def __init__(self, guard: Guard, patches: Patches) -> None:
        self.guard = guard
        self.patches = patches
        self.unguarded: list[dict[str, Any]] = []  # activation.not_installed's entries

    def patch_module(self, module: ModuleType) -> None:
        """`module` finished importing: install each hook the targets name in it (one that
        fails is named, and leaves the others)."""
        name = module.__name__
        for unit in UNITS:
            if unit.hook is not None and name in unit.modules:
                self._hook(f"the {unit.name} check's hooks", module, (unit.name,),
                           functools.partial(unit.hook, module, self.guard, self.patches.of_kind("units")))
        if name in ALLOCATOR_MODULES and self.guard.config.liveness:
            self._hook("liveness (the tracked allocators)", module, activation.ALLOCATORS, self.track_allocators)
        if name == STEP_HOOK.module:
            self._hook(f"the forward-step check ({STEP_HOOK.owner}.{STEP_HOOK.method})", module, activation.STEP,
                       lambda: self._hook_step(module))
        if name == IDLE_HOOK.module:
            self._hook(f"the idle hook ({IDLE_HOOK.owner}: counts are filed by the idle thread and at exit only)",
                       module, (), lambda: self._hook_idle(module))
        for writer in FUSED_WRITERS:
            if name in writer.modules:
                self._hook(writer.label, module, activation.WRITERS, functools.partial(self._wrap_writer, module, writer))

    def _hook(self, what: str, module: ModuleType, carries: tuple[str, ...], install: Callable[[], None]) -> None:
        try:
            install()
        except Exception as exc:  # never raised into sglang's import
            self.not_installed(what, module.__name__, carries, exc)

    def not_installed(self, what: str, module: str, carries: tuple[str, ...], exc: Exception) -> None:
        """A hook that did not install after its module loaded: a WARNING, and the activation record."""
        entry = activation.not_installed(self.guard.config, what, module, carries, exc)
        if any(entry["hook"] == e["hook"] and entry["why"] == e["why"] for e in self.unguarded):
            return  # the same failure again: the SWA allocators' module retries the allocators' hook
        activation.warn(entry)
        self.unguarded.append(entry)
        if self.guard.reporter.file is not None:
            self.guard.reporter.file.unguarded(entry)

    def _hook_step(self, module: ModuleType) -> None:
        owner = getattr(module, STEP_HOOK.owner, None)
        if owner is None or STEP_HOOK.method not in owner.__dict__:
            raise Missing(f"{STEP_HOOK.module}.{STEP_HOOK.owner}.{STEP_HOOK.method} not found")
        self.patches.wrap(owner, STEP_HOOK.method, make_forward_hook(self.guard, STEP_HOOK.pool_attr), "step")

    def _hook_idle(self, module: ModuleType) -> None:
        owner, method = defining(getattr(module, IDLE_HOOK.owner, None), IDLE_HOOK.methods)
        if owner is None:
            raise Missing(f"no {IDLE_HOOK.module}.{IDLE_HOOK.owner}.({' or '.join(IDLE_HOOK.methods)})")
        self.patches.wrap(owner, method, flush.make_idle_hook(self.guard), "other")

    def _wrap_writer(self, module: ModuleType, writer: Writer) -> None:
        if writer.function in module.__dict__:
            self.patches.wrap(module, writer.function,
                              make_writer_wrapper(writer, self.guard, module.__dict__[writer.function]), "writer")

    def track_allocators(self) -> None:
        """Wrap the tracked allocators' methods; name those whose pools get the bound check only."""
        targets = allocator_targets()
        if isinstance(targets, str):
            raise Missing(targets)
        methods, untracked = targets
        for target in methods:
            self.patches.wrap(target.owner, target.method, _allocator_wrapper(target, self.guard), "allocator", target)
        if untracked:
            logger.warning("sglang_oobguard: liveness not tracked for the pools of %s (bound check only)",
                           ", ".join(untracked))


def _allocator_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """A tracked allocator method's wrapper: the first unit's that owns its family."""
    return next(wrapper for unit in UNITS if unit.allocators is not None
                for wrapper in [unit.allocators(target, guard)] if wrapper is not None)
