"""Activation: what a process says when its guard installs: what is on, what this sglang
lacks, and each hook that could not install after its module loaded."""

from __future__ import annotations

import os
from typing import Any

from ..checks import reads
from ..checks.registry import UNITS
from ..model import config as config_mod
from ..model.log import logger
from ..model.swatargets import FAMILIES_SHORT
from ..model.maptargets import UNMAPPED
from ..model.targets import FUSED_WRITERS, STEP_HOOK, module_file, write_map_off, write_map_unmeasured


def line(config: config_mod.Config, guarded: int, version: str, on: tuple[str, ...]) -> str:
    unmeasured = "".join(f"; {name} ({why})" for name, why in write_map_unmeasured())
    mapped = f"write map off ({write_map_off()})" if write_map_off() else \
        f"write map on (not for: {'; '.join(name for name, _ in UNMAPPED)}{unmeasured})"
    memory = f"; read check memory {reads.MEMORY}" if "reads" in config.checks else ""
    liveness = f"on (tracks {FAMILIES_SHORT}{memory})" if config.liveness else "off"
    off = [unit.name for unit in UNITS if unit.name in config.switched_off]
    return (f"sglang_oobguard active (pid {os.getpid()}): mode={config.mode.value}, backend={config.backend.value} "
            f"({config_mod.BACKEND_PATHS[config.backend]}), {guarded} guarded methods (of the pool classes defined so "
            f"far), sglang {version}, liveness={liveness} (owner check {'on' if 'owners' in config.checks else 'off'}), "
            f"finite={'on' if config.finite else 'off'}, {mapped}, {features(config)}; "
            f"checks on: {', '.join(on)}" +
            (f"; off by {config_mod.CHECKS_VAR}: {', '.join(off)}" if off else ""))


def features(config: config_mod.Config) -> str:
    """The activation line's words on the checks that run where sglang runs a feature: on, or
    why not (read from sglang's classes where they are imported; else at their import)."""
    return ", ".join(f"{unit.name} check " + ("off" if unit.name not in config.checks else f"off ({why})" if why
                                              else f"on where sglang runs {unit.feature}")
                     for unit in UNITS if unit.feature for why in [unit.where()])


def absent_hooks() -> list[str]:
    """What this sglang lacks a hook for: the step check and fused writers whose module it
    does not ship (read from its files), the feature checks whose classes lack their methods."""
    absent = []
    if module_file(STEP_HOOK.module) is None:
        absent.append(f"the forward-step check ({STEP_HOOK.owner}.{STEP_HOOK.method}) (no {STEP_HOOK.module} in "
                      "this sglang)")
    absent += [f"the {unit.name} check ({why})" for unit in UNITS if unit.feature for why in [unit.where()] if why]
    absent += [f"{writer.label} (no {' or '.join(writer.modules)} in this sglang)" for writer in FUSED_WRITERS
               if all(module_file(module) is None for module in writer.modules)]
    return absent


# The checks each hook outside the pool classes carries (a unit's own hooks carry its check):
# where one does not install, these do not run in that process (the step check's bounds: not
# on out_cache_loc).
ALLOCATORS = ("liveness", "history", "owners", "reads", "swa", "pd")  # the tracked allocators' shadows
STEP = ("bounds", "map", "owners", "reads", "ownids")  # each forward step's out_cache_loc
WRITERS = ("bounds", "finite")


class Missing(LookupError):
    """What a hook wraps is not in its module, which has finished importing."""


def not_installed(config: config_mod.Config, what: str, module: str, carries: tuple[str, ...],
                  exc: Exception) -> dict[str, Any]:
    """The activation record's entry (`unguarded`) of a hook that did not install after its
    module loaded: what, where, the checks asked for that it carries, and why."""
    why = str(exc) if isinstance(exc, Missing) else f"{type(exc).__name__}: {exc}"
    return {"hook": what, "module": module, "checks": [name for name in carries if name in config.checks], "why": why}


def warn(entry: dict[str, Any]) -> None:
    """The loud WARNING of a hook that did not install: what is unguarded in this process."""
    checks = entry["checks"]
    logger.warning("sglang_oobguard: NOT GUARDED in this process (pid %d): %s did not install after %s loaded (%s); "
                   "%s", os.getpid(), entry["hook"], entry["module"], entry["why"],
                   f"checks that do not run here: {', '.join(checks)}" if checks else "no check depends on it")
