"""SWA hooks: the sliding-window pools' mapping hook and the allocator wrapper of each family.

The SWA pools name their two id spaces when an allocator registers the full -> SWA
mapping, so that hook is wrapped on every pool class that defines it; the SWA
allocator family gets its own adapter (`checks.swa`), the others liveness's.
"""

from __future__ import annotations

from typing import Any, Callable

from ..checks import swa
from ..checks.guard import Guard
from ..checks.liveness import make_wrapper as make_allocator_wrapper
from ..model.discover import AllocatorMethod, by_design
from ..model.swatargets import SWA_POOL_HOOK, SwaRole

Wrap = Callable[[Any, str, Callable[..., Any]], None]  # (owner, attribute, wrapt wrapper)


def hook_pools(classes: list[type], guard: Guard, wrap: Wrap) -> None:
    """Name the SWA pools' id spaces as their allocators register the mapping."""
    for cls in classes:
        hook = cls.__dict__.get(SWA_POOL_HOOK)
        if hook is not None and not by_design(getattr(hook, "__wrapped__", hook)):
            wrap(cls, SWA_POOL_HOOK, swa.make_mapping_hook(guard))


def allocator_wrapper(target: AllocatorMethod, guard: Guard) -> Callable[..., Any]:
    """An allocator method's wrapper: the SWA family's adapter, or the tracked allocators' liveness."""
    return (swa.make_wrapper if isinstance(target.role, SwaRole) else make_allocator_wrapper)(target, guard)
