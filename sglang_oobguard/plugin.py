"""The `sglang.srt.plugins` entry point, run by sglang's `load_plugins()` in every
process (main, each scheduler rank, detokenizer) before any pool or CUDA graph exists.

With the guard off this reads the environment and returns: no torch, triton or
sglang import, nothing patched.
"""

from __future__ import annotations

from . import config


def load() -> None:
    try:
        settings = config.from_env()
    except config.ConfigError as exc:
        # sglang's loader logs a plugin's exception after a generic line; say it first.
        import logging

        logging.getLogger("sglang_oobguard").error("%s", exc)
        raise
    if not settings.active:
        return
    from .patch import install

    install(settings.mode.value)
