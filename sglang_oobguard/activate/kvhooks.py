"""KV hooks: where the KV transfer (PD disaggregation) and HiCache checks are wrapped.

`instrument` calls `hook` as each module of `MODULES` is imported (post-import hooks),
with its own `wrap` (the instrumentor's patches, so that uninstall undoes these too).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any, Callable

from ..checks.hicache import make_wrapper as make_hicache_wrapper
from ..checks.hiloads import make_hook as make_load_hook
from ..checks.transfer import make_hook as make_transfer_hook
from ..checks.guard import Guard
from ..model.log import logger
from ..model.targets import module_file
from ..model.transfertargets import (HICACHE_LOAD_HOOKS, HICACHE_METHODS, HICACHE_POOLS, TRANSFER_HOOKS,
                                     TRANSFER_MODULES)

Wrap = Callable[[Any, str, Callable[..., Any]], None]  # (owner, attribute, wrapt wrapper)
MODULES = (*TRANSFER_MODULES, *(where for where, _ in HICACHE_POOLS),
           *dict.fromkeys(where for where, *_ in HICACHE_LOAD_HOOKS))


def hook(module: ModuleType, guard: Guard, wrap: Wrap) -> None:
    """Wrap what the targets name in `module`: PD's queues, HiCache's host pools."""
    def wrap_send(cls: type) -> None:  # a KV sender class, as the first send of its backend comes
        wrap(cls, "send", make_transfer_hook("source", guard, wrap_send))

    for where, owner, method, kind in TRANSFER_HOOKS:
        if where != module.__name__:
            continue
        cls = getattr(module, owner, None)
        if cls is None or method not in cls.__dict__:
            logger.warning("sglang_oobguard: %s.%s.%s not found: the KV transfer check misses it", where, owner, method)
            continue
        wrap(cls, method, make_transfer_hook(kind, guard, wrap_send))
    for where, owner in HICACHE_POOLS:
        cls = getattr(module, owner, None) if where == module.__name__ else None
        for method, what in HICACHE_METHODS if cls is not None else ():
            if method in cls.__dict__:
                wrap(cls, method, make_hicache_wrapper(method, what, guard))
    for where, owner, method, kind in HICACHE_LOAD_HOOKS:  # what the loads are for (a release without: unnamed)
        cls = getattr(module, owner, None) if where == module.__name__ else None
        if cls is not None and method in cls.__dict__:
            wrap(cls, method, make_load_hook(kind, guard))


def absent() -> list[tuple[str, str]]:
    """The checks whose module this sglang does not ship (read from its files), for the activation line."""
    checks = [(f"the KV transfer check ({where.rsplit('.', 1)[1]} side)", where) for where in TRANSFER_MODULES]
    checks += [(f"the HiCache check ({owner})", where) for where, owner in HICACHE_POOLS]
    return [(what, where) for what, where in checks if module_file(where) is None]
