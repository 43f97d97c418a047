"""Activation: the one line a process logs when its guard installs: what is on, and where."""

from __future__ import annotations

import os

from ..checks import reads
from ..checks.guard import checks_on
from ..model import config as config_mod
from ..model.swatargets import FAMILIES_SHORT
from ..model.targets import UNMAPPED, write_map_off
from . import kvhooks


def line(config: config_mod.Config, guarded: int, version: str) -> str:
    mapped = f"write map off ({write_map_off()})" if write_map_off() else \
        f"write map on (not for: {'; '.join(name for name, _ in UNMAPPED)})"
    liveness = f"on (tracks {FAMILIES_SHORT}; read check memory {reads.MEMORY})" if config.liveness else "off"
    return (f"sglang_oobguard active (pid {os.getpid()}): mode={config.mode.value}, backend={config.backend.value} "
            f"({config_mod.BACKEND_PATHS[config.backend]}), {guarded} guarded methods (of the pool classes defined so "
            f"far), sglang {version}, liveness={liveness} (owner check {'on' if config.liveness else 'off'}), "
            f"finite={'on' if config.finite else 'off'}, {mapped}, {kvhooks.releases()}; "
            f"checks on: {', '.join(checks_on(config))}")
