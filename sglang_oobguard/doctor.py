"""`python -m sglang_oobguard doctor`: what the guard would do in this environment."""

from __future__ import annotations

import site
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path

from . import config
from .discover import Found, Skipped, import_pool_modules
from .liveness import allocator_targets
from .patch import coverage
from .report import site_label
from .targets import FUSED_WRITERS, STEP_HOOK, SUPPORTED, TESTED, is_supported, module_file, version_of_sglang


def run() -> int:
    """Prints the report; exits non-zero on an invalid configuration."""
    try:
        settings = config.from_env()
    except config.ConfigError as exc:
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
    unimported = import_pool_modules()
    entries = coverage()
    if isinstance(entries, str):
        print(f"guarded: nothing ({entries})")
        return 0
    found = [e for e in entries if isinstance(e, Found)]
    print(f"guarded ({len(found)} methods):")
    for entry in found:
        for ids, name, number in zip(entry.rule.ids, entry.id_names, entry.sites):
            print(f"  {entry.qualname:48} {site_label(number):50} {name} "
                  f"in [0, {ids.bound.rule})" + (", valid prefix of each row" if entry.rule.lens else ""))
    skipped = [e for e in entries if isinstance(e, Skipped)]
    for title, design in (("not guarded", False), ("left alone (writes nothing)", True)):
        rows = [e for e in skipped if e.by_design is design]
        print(f"{title}:" + ("" if rows else " none"))
        for row in rows:
            print(f"  {row.qualname:48} {row.reason}")
    _print_allocators()
    _print_outside_pools()
    if unimported:
        print("pool modules that do not import here (their classes are not listed):")
        for module, why in unimported.items():
            print(f"  {module}: {why[:150]}")
    return 0


def _print_outside_pools() -> None:
    """The forward-step check and the fused writers: present in this sglang or not."""
    import importlib

    def found(module: str, owner: str, name: str) -> str:
        if module_file(module) is None:
            return f"ABSENT (no {module} in this sglang)"
        try:
            loaded = importlib.import_module(module)
        except Exception as exc:  # a module the CPU cannot import: said, not hidden
            return f"not importable here ({type(exc).__name__}: {str(exc)[:80]})"
        target = getattr(loaded, owner, None) if owner else loaded
        return f"found in {module}" if target is not None and name in vars(target) else f"ABSENT ({name} not in {module})"

    print("forward step (one check of out_cache_loc per step, reports at step boundaries):")
    print(f"  {STEP_HOOK.owner}.{STEP_HOOK.method:40} "
          f"{found(STEP_HOOK.module, STEP_HOOK.owner, STEP_HOOK.method)}")
    print("fused writers (KV stores outside the pool methods, checked against their buffer's rows):")
    for writer in FUSED_WRITERS:
        states = [found(module, "", writer.function) for module in writer.modules]
        here = next((state for state in states if state.startswith("found")), states[0])
        print(f"  {writer.function:48} {writer.ids.names[0]} in [0, {writer.rows[1]}.shape[0]): {here}")


def _print_allocators() -> None:
    """What the liveness guard wraps (when on), and which pools it cannot track."""
    targets = allocator_targets()
    if isinstance(targets, str):
        print(f"liveness tracks nothing: {targets}")
        return
    methods, untracked = targets
    print(f"liveness tracks ({len(methods)} allocator methods):")
    for target in methods:
        print(f"  {target.qualname:48} {target.role.value}")
    print("liveness not tracked (bound check only): " + (", ".join(untracked) or "none"))
