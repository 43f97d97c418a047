"""`python -m sglang_oobguard doctor` on the installed sglang."""

from __future__ import annotations

from importlib.metadata import version

from helpers import run_python
from sglang_oobguard.targets import TARGETS

DOCTOR = "import sys; from sglang_oobguard.__main__ import main; sys.exit(main(['doctor']))"


def test_doctor_lists_version_activation_mode_and_every_target():
    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"sglang {version('sglang')} (supported;")
    assert "entry point sglang.srt.plugins:oobguard registered" in out and ".pth import hook" in out
    assert "mode: warn (active); backend: auto" in out
    for target in TARGETS:
        assert f"{target.qualname}" in out and target.label in out and f"[0, {target.bound.rule})" in out
    assert "not guarded: none" in out


def test_doctor_exits_non_zero_on_an_invalid_configuration():
    proc = run_python(DOCTOR, {"SGLANG_ENABLE_ASYNC_ASSERT": "maybe"})
    assert proc.returncode == 2
    assert "invalid SGLANG_ENABLE_ASYNC_ASSERT='maybe'" in proc.stdout
