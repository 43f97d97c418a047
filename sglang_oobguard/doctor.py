"""`python -m sglang_oobguard doctor`: what the guard would do in this environment."""

from __future__ import annotations

import site
from importlib.metadata import entry_points
from importlib.util import find_spec
from pathlib import Path

from . import config
from .patch import coverage
from .targets import SUPPORTED, TESTED, is_supported, version_of_sglang


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
    print(f"mode: {settings.mode.value} ({state}); backend: {settings.backend.value}")
    print("guarded:")
    missing = []
    for target, found in coverage():
        if isinstance(found, str):
            missing.append(f"  {target.qualname}: {found}")
        else:
            print(f"  {target.qualname:40} {target.label:30} [0, {target.bound.rule})")
    print("not guarded:" + ("" if missing else " none"))
    for line in missing:
        print(line)
    return 0
