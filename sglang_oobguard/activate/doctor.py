"""`python -m sglang_oobguard doctor`: what the guard would do in this environment."""

from __future__ import annotations

import importlib
import inspect
import os
import site
import sys
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path
from typing import Any

from ..checks.unit import import_failure
from ..model import config
from ..model.discover import Found, Skipped, allocator_targets, coverage, import_pool_modules
from ..model.finite import UNSEEN, VALUE_DTYPES, WRITER_VALUES, stored_values
from ..model.quiet import quiet
from ..model.swatargets import FAMILIES, UNTRACKED_WHY
from ..model.targets import (FUSED_WRITERS, MEMORY_POOL, STEP_HOOK, SUPPORTED, TESTED, is_supported, module_file,
                             version_of_sglang)
from ..model.violation import site_label


def _stored(writer: Any) -> tuple[tuple[int, str], ...]:
    """The values the guard reads of a fused writer here: by the signature of the first
    module that defines it (the table's, where no module imports)."""
    for module in writer.modules:
        function = getattr(sys.modules.get(module), writer.function, None)
        if function is not None:
            inner = getattr(function, "__wrapped__", function)
            return stored_values(writer.function, list(inspect.signature(inner).parameters))
    return WRITER_VALUES.get(writer.function, ())


MEMORY_EXAMPLE = (2**20, 4096, 131072)  # doctor's pool for each check's device memory: pages, rows, context


def _bytes(size: int) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def _check_lines(settings: config.Config) -> list[str]:
    """One line per check (`checks.registry`): its name, on or off and why, what it catches and
    its cost; then the unit's own lines. Its modules are imported here (inside quiet()), so
    that what it says of this sglang is read from sglang's classes."""
    from ..checks.registry import UNITS  # (torch: doctor's first lines need none)

    lines = ["checks (each counts its work: the report folder's counts records, `report DIR`, the exit line; "
             f"{config.CHECKS_VAR} turns each on or off: `python -m sglang_oobguard help`):"]
    for unit in UNITS:
        unread = [f"{module} is not importable here ({why})" for module, why in unit.unread().items()]
        why = unit.where()
        if unit.name in settings.switched_off:
            state = f"off ({config.CHECKS_VAR})"
        elif unit.name not in settings.checks:
            state = f"off (set {config.FINITE_VAR if unit.name == 'finite' else config.LIVENESS_VAR}=1)"
        elif why is not None:
            state = f"off ({why})"
        elif unread:
            state = f"unknown here ({unread[0]})"
        elif unit.feature is not None:
            state = f"{'with liveness, ' if settings.liveness else ''}where sglang runs {unit.feature}"
        else:
            state = "on"
        memory = "" if unit.memory is None else f"; device memory: {_bytes(unit.memory(*MEMORY_EXAMPLE))} for a pool " \
            f"of {MEMORY_EXAMPLE[0]} pages and {MEMORY_EXAMPLE[1]} req_to_token rows x {MEMORY_EXAMPLE[2]}, made with them"
        lines.append(f"  {unit.name}: {state} - {unit.catches}; cost: {unit.cost}{memory}; runs in: {unit.rides}")
        lines += [f"    {line}" for line in unit.doctor(_found)]
    return lines


def run() -> int:
    """Prints the report; exits non-zero on an invalid configuration, or where the
    guard's dependencies are missing (one line naming what is missing)."""
    try:
        settings = config.from_env()
    except config.ConfigError as exc:
        print(exc)
        return 2
    try:
        with quiet():  # sglang's import-time warnings and logs would land in the middle of the report
            unimported, entries, allocators = _inspect()
            outside = _outside_pools()
            checks = _check_lines(settings)
    except ModuleNotFoundError as exc:
        print(f"sglang_oobguard doctor: {exc.name} is not installed for {sys.executable}; the guard runs inside "
              "sglang and needs its torch: run doctor with the python that runs sglang")
        return 2
    except _PoolsUnimportable as exc:
        print(exc)
        return 2
    version = version_of_sglang()
    low, high = (".".join(map(str, v)) for v in SUPPORTED)
    support = "supported" if is_supported(version) else f"OUTSIDE {low}..{high}: guards that fit only"
    print(f"sglang {version} ({support}; tested on {', '.join(TESTED)})")
    registered = any(ep.name == "oobguard" for ep in entry_points(group="sglang.srt.plugins"))
    loader = find_spec("sglang.srt.plugins") is not None
    pth = any((Path(d) / "sglang_oobguard.pth").exists() for d in site.getsitepackages())
    print(f"activation: entry point sglang.srt.plugins:oobguard "
          f"{'registered' if registered else 'NOT registered'}, sglang's plugin loader "
          f"{'present' if loader else 'ABSENT (sglang < 0.5.11)'}; .pth import hook "
          f"{'installed' if pth else 'not installed (an editable install places none)'}")
    if not loader and not pth:
        print("  -> nothing activates the guard in sglang's processes: pip install the package (not -e)")
    state = "active" if settings.active else f"inactive; set {config.ENABLE_VAR}=1 to enable"
    print(f"mode: {settings.mode.value} ({state}); backend: {settings.backend.value} "
          f"({config.BACKEND_PATHS[settings.backend]}); "
          f"liveness: {'on' if settings.liveness else f'off (set {config.LIVENESS_VAR}=1 to check it)'}")
    print("\n".join(checks))
    _print_finite(settings)
    _print_report_dir(settings)
    if isinstance(entries, str):
        print(f"guarded: nothing ({entries})")
        return 0
    found = [e for e in entries if isinstance(e, Found)]
    print(f"guarded ({len(found)} methods, of the pool classes of every pool module that imports here; one row "
          "per method, with the ids it checks):")
    for entry in found:
        checks = "; ".join(f"{site_label(number)}: {name} in [0, {ids.bound.rule})"
                           for ids, name, number in zip(entry.rule.ids, entry.id_names, entry.sites))
        print(f"  {entry.qualname:48} {checks}" + (", valid prefix of each row" if entry.rule.lens else ""))
    skipped = [e for e in entries if isinstance(e, Skipped)]
    for title, design in (("not guarded", False), ("left alone, writes nothing", True)):
        rows = [e for e in skipped if e.by_design is design]
        print(f"{title} ({len(rows)} methods):" if rows else f"{title}: none")
        for row in rows:
            print(f"  {row.qualname:48} {row.reason}")
    _print_allocators(allocators)
    print("\n".join(outside))
    if unimported:
        print("pool modules that do not import here (their classes are not listed):")
        for module, why in unimported.items():
            print(f"  {module}: {why[:150]}")
    return 0


def _found(module: str, owner: str, name: str) -> str:
    """Whether this sglang defines `owner.name` in `module` (imported here, inside quiet()): a
    line's last words; `owner` empty: the module's own `name`."""
    if module_file(module) is None:
        return f"ABSENT (no {module} in this sglang)"
    failure = import_failure(module)
    if failure is not None:
        return f"not importable here ({failure})"
    loaded = sys.modules[module]
    target = getattr(loaded, owner, None) if owner else loaded
    return f"found in {module}" if target is not None and name in vars(target) else f"ABSENT ({name} not in {module})"


def _outside_pools() -> list[str]:
    """The forward-step check and the fused writers: found in this sglang or not (the
    lines to print; their modules are imported here, inside quiet())."""
    lines = ["forward step (one check of out_cache_loc per step, reports at step boundaries; the checks that run "
             "there are listed under checks):",
             f"  {STEP_HOOK.owner + '.' + STEP_HOOK.method:48} "
             f"{_found(STEP_HOOK.module, STEP_HOOK.owner, STEP_HOOK.method)}",
             "fused writers (KV stores outside the pool methods, checked against their buffer's slots):"]
    for writer in FUSED_WRITERS:
        states = [_found(module, "", writer.function) for module in writer.modules]
        here = next((state for state in states if state.startswith("found")), states[0])
        values = ", ".join(name for _, name in _stored(writer)) or "NOT seen"
        lines.append(f"  {writer.function:48} {writer.ids.names[0]} in [0, {writer.bound}): {here}; values: {values}")
    return lines


def _inspect() -> tuple[dict[str, str], Any, Any]:
    """Every pool module imported, then the pool write methods and allocator methods
    the guard would wrap. Raises ModuleNotFoundError, torch named first, where the
    guard's dependencies are missing."""
    importlib.import_module("torch")
    _import_pools()
    unimported = import_pool_modules()
    return unimported, coverage(), allocator_targets()


class _PoolsUnimportable(Exception):
    """sglang's memory_pool does not import: the one line that says why and what to do."""


def _import_pools() -> None:
    """Import sglang's memory_pool; any exception it raises (a missing module, or a
    TypeError in a dependency of the wrong version) becomes one line naming the cause:
    with no pools there is nothing to guard, and doctor must not say otherwise."""
    try:
        importlib.import_module(MEMORY_POOL)
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        cause = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        if isinstance(exc, ModuleNotFoundError) and exc.name in ("sglang", "sglang.srt"):
            todo = f"sglang is not installed for {sys.executable}: run doctor with the python that runs sglang"
        elif isinstance(exc, ModuleNotFoundError):
            todo = (f"install {exc.name} into the python that runs sglang ({sys.executable}), "
                    "or run doctor with that python")
        else:
            todo = ("a dependency of sglang is missing or of a version this sglang does not work with: "
                    "install the versions this sglang release requires (pip show sglang; its Requires-Dist)")
        raise _PoolsUnimportable(f"sglang_oobguard doctor: sglang's pools do not import here, nothing can be guarded "
                                 f"({MEMORY_POOL}: {cause}); {todo}") from None


def _print_finite(settings: config.Config) -> None:
    """The value check: on or off, what it reads, and which writers' values it cannot see."""
    unseen = "; ".join(f"{function} ({why})" for function, why in UNSEEN.items())
    state = "on" if settings.finite else f"off (set {config.FINITE_VAR}=1 to check it)"
    print(f"finite values: {state}; every floating argument a guarded write stores (K, V, MLA's parts, scales) "
          f"is checked for NaN and Inf, on GPU tensors for {', '.join(VALUE_DTYPES)} "
          f"rows of contiguous values (another dtype or layout: a WARNING once, not checked); values NOT seen: "
          f"the fused writers {unseen or 'none'}; set_kv_buffer_prefix_valid (it stores each row's valid prefix "
          "only; on the CPU sglang writes that prefix through set_kv_buffer, which is checked); writes by code "
          "the guard does not wrap")


def _print_report_dir(settings: config.Config) -> None:
    folder = settings.report_dir
    if folder is None:
        print(f"report files: none (set {config.REPORT_DIR_VAR} to a folder for CI)")
        return
    existing = next((p for p in (Path(folder), *Path(folder).parents) if p.exists()), None)
    writable = existing is not None and existing.is_dir() and os.access(existing, os.W_OK | os.X_OK)
    print(f"report files: {folder} ({'writable' if writable else 'NOT writable: the guard would warn once and go on'}"
          f"; summarise with: python -m sglang_oobguard report {folder})")


def _print_allocators(targets: Any) -> None:
    """What the liveness guard wraps (when on), and which pools it cannot track."""
    if isinstance(targets, str):
        print(f"liveness tracks nothing: {targets}")
        return
    methods, untracked = targets
    print("liveness tracks these allocator families:")
    for family, how in FAMILIES:
        print(f"  {family}: {how}")
    print(f"liveness wraps ({len(methods)} allocator methods):")
    for target in methods:
        print(f"  {target.qualname:48} {target.role.value}")
    print("liveness not tracked (bound check only): " + (", ".join(untracked) or "none"))
    for why in dict.fromkeys(UNTRACKED_WHY[name] for name in untracked if name in UNTRACKED_WHY):
        print(f"  {', '.join(name for name in untracked if UNTRACKED_WHY.get(name) == why)}: {why}")
