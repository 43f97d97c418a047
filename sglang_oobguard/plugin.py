"""The `sglang.srt.plugins` entry point, run by sglang's `load_plugins()` in every
process (main, each scheduler rank, detokenizer) before any pool or CUDA graph exists.

With none of the activating variables set this is one environment read: no import
(not even our own config), nothing patched.
"""

from __future__ import annotations

import os

# config.ENABLE_VAR, INVARIANT_VAR, MODE_VAR turn the guard on; LIVENESS_VAR, FINITE_VAR or
# CHECKS_VAR alone is an error that must be heard (tests/test_plugin_loader.py keeps the lists equal).
TRIGGERS = ("SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_INVARIANT_CHECK", "SGLANG_OOBGUARD_MODE",
            "SGLANG_OOBGUARD_LIVENESS", "SGLANG_OOBGUARD_FINITE", "SGLANG_OOBGUARD_CHECKS")


def load() -> None:
    if not any(os.environ.get(name) for name in TRIGGERS):
        return
    from .model import config

    try:
        settings = config.from_env()
    except config.ConfigError as exc:
        # sglang's loader logs a plugin's exception after a generic line; say it first.
        import logging

        logging.getLogger("sglang_oobguard").error("%s", exc)
        raise
    if settings.active:
        from .activate.instrument import install

        install(settings.mode.value)
