"""`python -m sglang_oobguard doctor` on the installed sglang."""

from __future__ import annotations

from importlib.metadata import version

from helpers import run_python

DOCTOR = "import sys; from sglang_oobguard.__main__ import main; sys.exit(main(['doctor']))"
# What the doctor's own discovery should list, from the same walk in a second interpreter.
EXPECTED = """
import json
from sglang_oobguard.discover import Found, import_pool_modules
from sglang_oobguard.patch import coverage
from sglang_oobguard.report import site_label
import_pool_modules()
rows = []
for e in coverage():
    if isinstance(e, Found):
        rows += [[e.qualname, site_label(s), f"[0, {i.bound.rule})", "guarded"] for i, s in zip(e.rule.ids, e.sites)]
    else:
        rows.append([e.qualname, e.reason, "", "alone" if e.by_design else "not"])
print(json.dumps(rows))
"""


def test_doctor_lists_version_activation_mode_and_every_write_method():
    import json

    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"sglang {version('sglang')} (supported;")
    assert "entry point sglang.srt.plugins:oobguard registered" in out and ".pth import hook" in out
    assert "mode: warn (active); backend: auto (the kernel on CUDA tensors (no sync); the host scan on CPU tensors, " \
           "and on NPU, XPU and MUSA tensors at one host sync per write); liveness: off (set SGLANG_OOBGUARD_LIVENESS=1" in out
    assert "  TokenToKVPoolAllocator.alloc " in out and "  PagedTokenToKVPoolAllocator.alloc_extend " in out
    assert "liveness not tracked (bound check only): " in out and "SWATokenToKVPoolAllocator" in out
    expected = run_python(EXPECTED, {})
    rows = json.loads(expected.stdout.strip().splitlines()[-1])
    assert any(kind == "guarded" for *_, kind in rows)
    sections = out.split("\nnot guarded:")
    guarded, rest = sections[0], sections[1]
    for qualname, what, bound, kind in rows:
        if kind == "guarded":
            assert any(qualname in line and what in line and bound in line for line in guarded.splitlines()), qualname
        else:  # named with its reason, under "not guarded" or "left alone"
            part = rest.split("left alone")[0 if kind == "not" else 1]
            assert any(qualname in line and what in line for line in part.splitlines()), qualname


def test_doctor_exits_non_zero_on_an_invalid_configuration():
    proc = run_python(DOCTOR, {"SGLANG_ENABLE_ASYNC_ASSERT": "maybe"})
    assert proc.returncode == 2
    assert "invalid SGLANG_ENABLE_ASYNC_ASSERT='maybe'" in proc.stdout


def test_doctor_exits_non_zero_when_liveness_is_asked_for_with_the_guard_off():
    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_LIVENESS": "1"})
    assert proc.returncode == 2
    assert "invalid SGLANG_OOBGUARD_LIVENESS='1'" in proc.stdout and "SGLANG_ENABLE_ASYNC_ASSERT=1" in proc.stdout
