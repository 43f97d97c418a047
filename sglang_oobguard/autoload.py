"""The `.pth` import hook: activation for sglang releases without a plugin loader.

Before 0.5.11 sglang runs no plugins, and its schedulers are spawned, so a patch made
in the launching process never reaches them. `sglang_oobguard.pth` (installed beside
the package) runs at every interpreter start: with none of the activating variables
set it is one environment read; with one set it calls `arm()`, which patches
`sglang.srt.mem_cache.memory_pool` the moment it is first imported, in every process,
before any pool or CUDA graph exists. On 0.5.11+ the entry point and this hook both
call install(), which installs once.
"""

from __future__ import annotations

from types import ModuleType

from .model.targets import MEMORY_POOL


def arm() -> None:
    import wrapt

    wrapt.register_post_import_hook(_on_import, MEMORY_POOL)


def _on_import(module: ModuleType) -> None:
    """Never breaks sglang's import: an invalid configuration is logged (by load) and
    leaves the guard off, loudly."""
    from .model.config import ConfigError
    from .plugin import load

    try:
        load()
    except ConfigError:
        pass
