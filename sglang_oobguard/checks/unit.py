"""Unit: what one check declares, so that the guard can run it without knowing it.

A check is a module under `checks/` (or a small package) that defines `UNIT`; the
registry (`checks.registry`) lists them, one line each, and the instrumentor hands that
list to the guard. The guard imports no unit: what a check needs from the guard is the
shared state every check reads (configuration, pools, steps, reporter); what the guard
needs from a check is in its `Unit`: its state, its hooks, what it adds to a report.

The switch itself (name, dependencies, default) is the one table of `model.switches`:
sglang's processes read it before torch imports, where no unit may load.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Iterable, Optional

from ..model.targets import module_file

Wrap = Callable[[Any, str, Callable[..., Any]], None]  # (owner, attribute, wrapt wrapper): the instrumentor's patch
Found = Callable[[str, str, str], str]  # doctor's look-up: (module, class, method) -> "found in ..." or why not
# A unit's own hooks: called with each of its modules as the module finishes importing.
Hook = Callable[[ModuleType, Any, Wrap], None]


def everywhere() -> Optional[str]:
    return None


def no_lines(found: Found) -> list[str]:
    return []


@dataclass(frozen=True)
class Unit:
    """One check. `where` answers from sglang's classes, as they are imported (None: it
    runs on this sglang; else why not); `feature`: the sglang feature it needs at run time."""

    name: str  # its switch's name (`model.switches.NAMES`)
    catches: str  # one line: what it reports
    cost: str  # its cost class, in a few words (bench/engine.py measures it)
    counts: tuple[str, ...]  # the work it counts (`report.counts.UNITS`)
    rides: str  # the entry points it runs in, in words (doctor's)
    where: Callable[[], Optional[str]] = everywhere
    feature: Optional[str] = None  # e.g. "PD disaggregation": counted when it first works there
    state: Optional[Callable[[], Any]] = None  # its own state, one per guard: `guard.held[name]`
    modules: tuple[str, ...] = ()  # the modules whose import runs `hook`
    hook: Optional[Hook] = None
    pool_hook: Optional[Callable[[list, Any, Wrap], None]] = None  # (sglang's pool classes, guard, wrap), as defined
    allocators: Optional[Callable[[Any, Any], Optional[Callable[..., Any]]]] = None  # (AllocatorMethod, guard) ->
    # the wrapper of a tracked allocator method this unit owns, or None (with liveness on)
    fields: Optional[Callable[[Any, Any], dict[str, Any]]] = None  # (pool state, record) -> what it adds to a report
    doctor: Callable[[Found], list[str]] = no_lines  # its lines under its doctor line
    # (pool pages, req_to_token rows, context) -> the bytes it keeps on the pool's device, made with the pools
    memory: Optional[Callable[[int, int, int], int]] = None
    idle: Optional[Callable[[Any, Any], None]] = None  # (guard, sglang's scheduler): as the scheduler idles, before
    # sglang's own idle check (while the check is on)

    def unread(self) -> dict[str, str]:
        """Imports this unit's modules, so that `where` can read sglang's classes (doctor, and a
        test's choice of checks, ask it first); returns those that exist but do not import here,
        each with why (`where` cannot say whether the check would run)."""
        return {module: why for module in self.modules for why in [import_failure(module)] if why is not None}


def import_failure(module: str) -> Optional[str]:
    """Imports `module`; why it does not import here ("Error: message"), or None where it
    imported or this sglang has no such module. A module the CPU cannot import is said by the
    caller, not hidden (doctor's lines, its checks' states)."""
    if module_file(module) is None:
        return None
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc)[:80]}"
    return None


def defines(module: str, owner: str, method: str) -> Optional[bool]:
    """Whether sglang's class defines `method`, read from the class where its module is
    imported; False where this sglang has no such module; None where it is not imported
    (yet): the fact comes with the import (doctor imports every unit's modules)."""
    loaded = sys.modules.get(module)
    if loaded is None:
        return False if module_file(module) is None else None
    cls = getattr(loaded, owner, None)
    return cls is not None and method in vars(cls)


def kept(units: Iterable[Unit], on: Iterable[str], pages: int) -> str:
    """What the checks on keep per pool of `pages` pages on its device, in bytes ("" for none)."""
    return ", ".join(f"{unit.name} {unit.memory(pages, 0, 0)} B" for unit in units
                     if unit.memory is not None and unit.name in on and unit.memory(pages, 0, 0))
