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
from ..model.transfertargets import (HICACHE_LOAD_HOOKS, HICACHE_METHODS, HICACHE_POOLS, HICACHE_SINCE,
                                     TRANSFER_ENTRIES, TRANSFER_HOOKS, TRANSFER_MODULES, TRANSFER_SINCE)

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


def _defines(module: str, owner: str, method: str) -> bool:
    """Whether sglang's file of `module` defines `method` in class `owner` (read, not imported)."""
    path = module_file(module)
    if path is None:
        return False
    with open(path, encoding="utf-8", errors="replace") as source:
        text = source.read()
    start = text.find(f"class {owner}")
    return start >= 0 and f"def {method}(" in text[start:]


def absent() -> list[tuple[str, str]]:
    """The checks this sglang has no hook for (read from its files), for the activation line."""
    checks = [(f"the KV transfer check ({where.rsplit('.', 1)[1]} side; sglang {TRANSFER_SINCE}+)", where, owner,
               method) for where, owner, method in TRANSFER_ENTRIES]
    checks += [(f"the HiCache check ({owner}; sglang {HICACHE_SINCE}+)", where, owner, HICACHE_METHODS[0][0])
               for where, owner in HICACHE_POOLS]
    return [(what, f"{owner}.{method}") for what, where, owner, method in checks if not _defines(where, owner, method)]


def releases() -> str:
    """The activation line's words: which KV transfer checks run here, and from which release."""
    gone = {what.split(" (")[0] for what, _ in absent()}
    pd = "off" if "the KV transfer check" in gone else "on"
    hicache = "off" if "the HiCache check" in gone else "on"
    return (f"PD transfer check {pd} (sglang {TRANSFER_SINCE}+, with liveness), HiCache check {hicache} (sglang "
            f"{HICACHE_SINCE}+; its holder check with liveness, where the write map runs)")
