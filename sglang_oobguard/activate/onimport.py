"""On import: each of the guard's hooks runs when its own module has finished importing.

sglang's modules import one another at their tops, so the import that installs the
guard (memory_pool's, for the `.pth` hook) often ends while the modules that asked for
it are still half run: 0.5.4's `allocator` imports memory_pool before it defines its
classes, and the engine imports `allocator` first. A hook run then finds half a module,
and the check it installs would be missing for the life of the process (issue #43). So
every hook waits for its own module: wrapt's post-import hook when the module is not
imported yet, at once when it is complete, and, when it is still initializing, at the
end of that import: the moment importlib clears `__spec__._initializing` (the flag its
own "partially initialized module" error reads).
"""

from __future__ import annotations

import sys
import threading
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Callable

import wrapt

from ..model.log import logger

Hook = Callable[[ModuleType], None]

_lock = threading.Lock()
_waiting: dict[str, list[Hook]] = {}  # a module still initializing -> the hooks its import's end runs
_watched: set[str] = set()  # modules `watch` hooked (wrapt keeps its hooks for the process)


def initializing(module: ModuleType) -> bool:
    """Whether `module`'s import is still running (in this thread or another)."""
    return bool(getattr(getattr(module, "__spec__", None), "_initializing", False))


def when_loaded(name: str, hook: Hook) -> None:
    """Run `hook(module)` once module `name` has finished importing: now if it has, else then."""
    module = sys.modules.get(name)
    if module is None:
        wrapt.register_post_import_hook(hook, name)
    elif not initializing(module):
        hook(module)
    elif not _wait(module, hook):  # a spec importlib did not make: nothing marks the import's end
        logger.warning("sglang_oobguard: %s is still importing and its end cannot be watched (spec %s): "
                       "its hooks run now, on what it has defined so far", name, type(module.__spec__).__name__)
        hook(module)


def watch(name: str, hook: Hook) -> None:
    """`hook` on module `name` when it finishes importing, registered once per process, and
    again at once on each later call while the module is complete (a guard installed again)."""
    if name not in _watched:
        _watched.add(name)
        when_loaded(name, hook)
        return
    module = sys.modules.get(name)
    if module is not None and not initializing(module):
        hook(module)


class _Importing(ModuleSpec):
    """A module's own spec, for the rest of its import: importlib's last step on it,
    `_initializing = False`, runs the hooks that wait for it, and makes the spec a plain
    ModuleSpec again."""

    def __setattr__(self, name: str, value: object) -> None:
        object.__setattr__(self, name, value)
        if name == "_initializing" and not value:
            _finished(self)


def _wait(module: ModuleType, hook: Hook) -> bool:
    spec = module.__spec__
    with _lock:
        if type(spec) not in (ModuleSpec, _Importing):
            return False
        _waiting.setdefault(spec.name, []).append(hook)
        spec.__class__ = _Importing
        ended = not getattr(spec, "_initializing", False)  # in another thread, before the swap
    if ended:
        _finished(spec)
    return True


def _finished(spec: ModuleSpec) -> None:
    """The import of `spec.name` ended: its waiting hooks run on the module, or, when the
    import failed (sglang's import error propagates), on the next import of it."""
    name = spec.name
    with _lock:
        spec.__class__ = ModuleSpec
        hooks = _waiting.pop(name, [])
    module = sys.modules.get(name)
    for hook in hooks:
        if module is None:
            wrapt.register_post_import_hook(hook, name)
            continue
        try:
            hook(module)
        except Exception as exc:  # inside importlib's own bookkeeping: never raised into sglang's import
            logger.error("sglang_oobguard: internal error in a hook of %s: %s: %s", name, type(exc).__name__, exc)
