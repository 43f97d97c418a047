"""Activation: what a process says when its guard installs: what is on, and what this sglang lacks."""

from __future__ import annotations

import os

from ..checks import reads
from ..checks.guard import checks_on
from ..model import config as config_mod
from ..model.swatargets import FAMILIES_SHORT
from ..model.switches import CHECKS
from ..model.targets import FUSED_WRITERS, STEP_HOOK, UNMAPPED, module_file, write_map_off
from . import kvhooks


def line(config: config_mod.Config, guarded: int, version: str) -> str:
    mapped = f"write map off ({write_map_off()})" if write_map_off() else \
        f"write map on (not for: {'; '.join(name for name, _ in UNMAPPED)})"
    memory = f"; read check memory {reads.MEMORY}" if "reads" in config.checks else ""
    liveness = f"on (tracks {FAMILIES_SHORT}{memory})" if config.liveness else "off"
    off = [name for name in CHECKS if name in config.switched_off]
    return (f"sglang_oobguard active (pid {os.getpid()}): mode={config.mode.value}, backend={config.backend.value} "
            f"({config_mod.BACKEND_PATHS[config.backend]}), {guarded} guarded methods (of the pool classes defined so "
            f"far), sglang {version}, liveness={liveness} (owner check {'on' if 'owners' in config.checks else 'off'}), "
            f"finite={'on' if config.finite else 'off'}, {mapped}, {kvhooks.releases()}; "
            f"checks on: {', '.join(checks_on(config))}" +
            (f"; off by {config_mod.CHECKS_VAR}: {', '.join(off)}" if off else ""))


def absent_hooks() -> list[tuple[str, str]]:
    """The step check and fused writers whose module this sglang does not ship
    (read from its files: nothing is imported)."""
    absent = []
    if module_file(STEP_HOOK.module) is None:
        absent.append((f"the forward-step check ({STEP_HOOK.owner}.{STEP_HOOK.method})", STEP_HOOK.module))
    absent += kvhooks.absent()
    for writer in FUSED_WRITERS:
        if all(module_file(module) is None for module in writer.modules):
            absent.append((writer.label, " or ".join(writer.modules)))
    return absent
