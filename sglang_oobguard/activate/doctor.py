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

from ..model import config
from ..model.discover import Found, Skipped, allocator_targets, coverage, import_pool_modules
from ..model.finite import UNSEEN, VALUE_DTYPES, WRITER_VALUES, stored_values
from ..model.quiet import quiet
from ..model.swatargets import FAMILIES, UNTRACKED_WHY
from ..model.targets import (FUSED_WRITERS, MEMORY_POOL, POOL_IDS, STEP_HOOK, SUPPORTED, TESTED, UNMAPPED,
                             is_supported, module_file, version_of_sglang, write_map_off)
from ..model.transfertargets import (DRAIN_ARMED, DRAIN_SIGNAL, HICACHE_LOAD_HOOKS, HICACHE_METHODS, HICACHE_POOLS,
                                     HICACHE_SINCE, TRANSFER_HOOKS, TRANSFER_SINCE)
from ..model.violation import site_label
from ..report.counts import CHECKS


def _stored(writer: Any) -> tuple[tuple[int, str], ...]:
    """The values the guard reads of a fused writer here: by the signature of the first
    module that defines it (the table's, where no module imports)."""
    for module in writer.modules:
        function = getattr(sys.modules.get(module), writer.function, None)
        if function is not None:
            inner = getattr(function, "__wrapped__", function)
            return stored_values(writer.function, list(inspect.signature(inner).parameters))
    return WRITER_VALUES.get(writer.function, ())


def _print_checks(settings: config.Config) -> None:
    """One line per check: on or off (and why), and what it catches; each counts its work."""
    from ..checks.guard import MAPPED

    features = {"swa": "sliding-window models", "pd": "PD disaggregation", "hicache": "HiCache"}
    print("checks (each counts its work: the report folder's counts records, `report DIR`, the exit line; "
          f"{config.CHECKS_VAR} turns each on or off: `python -m sglang_oobguard help`):")
    for name, catches in CHECKS.items():
        if name in settings.switched_off:
            state = f"off ({config.CHECKS_VAR})"
        elif name not in settings.checks:
            state = f"off (set {config.FINITE_VAR if name == 'finite' else config.LIVENESS_VAR}=1)"
        elif name in features:
            state = f"{'with liveness, ' if settings.liveness else ''}where sglang runs {features[name]}"
        elif name in MAPPED and write_map_off():
            state = f"off ({write_map_off()})"
        else:
            state = "on"
        print(f"  {name}: {state} - {catches}")


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
    _print_checks(settings)
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


def _gib(size: int) -> str:
    return f"{size / 2**30:.1f} GiB"


def _outside_pools() -> list[str]:
    """The forward-step check and the fused writers: found in this sglang or not (the
    lines to print; their modules are imported here, inside quiet())."""

    def found(module: str, owner: str, name: str) -> str:
        if module_file(module) is None:
            return f"ABSENT (no {module} in this sglang)"
        try:
            loaded = importlib.import_module(module)
        except Exception as exc:  # a module the CPU cannot import: said, not hidden
            return f"not importable here ({type(exc).__name__}: {str(exc)[:80]})"
        target = getattr(loaded, owner, None) if owner else loaded
        return f"found in {module}" if target is not None and name in vars(target) else f"ABSENT ({name} not in {module})"

    from ..checks import reads  # (torch: doctor's first lines need none)
    from ..probes.readmap import Seen

    lines = ["forward step (one check of out_cache_loc per step, reports at step boundaries):",
             f"  {STEP_HOOK.owner + '.' + STEP_HOOK.method:48} "
             f"{found(STEP_HOOK.module, STEP_HOOK.owner, STEP_HOOK.method)}",
             "  the write map (each token's slot is req_to_token's; no slot or row twice), the owner check with "
             f"liveness: {'OFF, ' + write_map_off() if write_map_off() else 'on'}; not checked:",
             *(f"    {name}: {why}" for name, why in UNMAPPED),
             "  fused writers that take out_cache_loc themselves are reported, not contained, for ownership",
             "  a layer's write with ids of its own (not the step's out_cache_loc): one id per token, each its "
             "token's own slot; another shape, each id a slot of the step's tokens (CPU ids)",
             "  the read check, with liveness: every slot each request reads (req_to_token[row, 0:seq_len]) live "
             "and of the generation it first read (host path on CPU tensors, one launch on a GPU); where the write "
             "map runs (" + (write_map_off() or "on here") + ")",
             f"  the read check's memory, with liveness: {reads.MEMORY} as sglang sizes its pools (sglang's "
             f"budget does not count it), before serving and capture: {_gib(Seen.bytes_for(4096, 131072))} for "
             f"4096 rows x 131072 context, {_gib(Seen.bytes_for(2048, 131072))} for 2048",
             "  the owner and read checks read the shadow of the ids req_to_token holds (an SWA pool's: its full "
             "sub-pool's); a step pool no shadow holds: both off, said once in the log (WARNING)",
             "  slot history, with liveness: each report names the slot's last free and allocation (step, call "
             "site) and generation",
             "fused writers (KV stores outside the pool methods, checked against their buffer's slots):"]
    for writer in FUSED_WRITERS:
        states = [found(module, "", writer.function) for module in writer.modules]
        here = next((state for state in states if state.startswith("found")), states[0])
        values = ", ".join(name for _, name in _stored(writer)) or "NOT seen"
        lines.append(f"  {writer.function:48} {writer.ids.names[0]} in [0, {writer.bound}): {here}; values: {values}")
    from ..checks.hiloads import LOAD_ROLES  # needs torch, as the next
    from ..checks.transfer import HOOK_ROLES, NO_DRAIN  # needs torch: imported after _inspect checked for it

    lines.append(f"KV transfers (PD disaggregation, sglang {TRANSFER_SINCE}+, with liveness; only the ids are seen, "
                 "the transfer engine's RDMA write itself is not observable):")
    for module, owner, method, kind in TRANSFER_HOOKS:
        lines.append(f"  {owner + '.' + method:48} {HOOK_ROLES[kind]}: {found(module, owner, method)}")
    lines += [f"  every backend's transfers (mooncake, nixl, mori, ascend, fake); an aborted one ends at the drain "
              f"signal kv_mgr.{DRAIN_SIGNAL} (armed by {DRAIN_ARMED}), never at sglang's release-anyway timeout;",
              f"  {NO_DRAIN}; the prefill side's sends are checked where a sender's send is wrapped at its first call"]
    lines.append(f"HiCache (sglang {HICACHE_SINCE}+: the host pool's copies into and out of device slots, probed like "
                 "a write of the device pool):")
    for where, owner in HICACHE_POOLS:
        for method, what in HICACHE_METHODS:
            lines.append(f"  {owner + '.' + method:48} {what}: device_indices in [0, {POOL_IDS.rule}), live: "
                         f"{found(where, owner, method)}")
    lines.append("  the holder check, with liveness, where the write map runs (" + (write_map_off() or "on here") +
                 "): a load's slot another running request owns (the owner table) is reported, naming what the load "
                 "is for:")
    for where, owner, method, kind in HICACHE_LOAD_HOOKS:
        lines.append(f"  {owner + '.' + method:48} {LOAD_ROLES[kind]}: {found(where, owner, method)}")
    lines.append("  not checked: loads on a GPU (the owner table is device memory: no host sync); a slot freed under its "
                 "request and handed to a load (the read check names its reader); the other host pools (their ids are "
                 "virtual or paged)")
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
