"""install / uninstall: one wrapper layer however often, exact originals restored."""

from __future__ import annotations

import pytest

import sglang_oobguard
from sglang_oobguard.config import ConfigError
from sglang_oobguard.patch import coverage
from sglang_oobguard.targets import TARGETS


def originals(mp):
    return {t.qualname: getattr(mp, t.class_name).__dict__[t.method] for t in TARGETS}


def test_install_is_idempotent_and_uninstall_restores_identity(mp):
    before = originals(mp)
    first = sglang_oobguard.install("strict")
    assert sglang_oobguard.install("warn") == first  # settings change, wrappers do not
    assert sglang_oobguard.install() == first
    for target in TARGETS:
        wrapped = getattr(mp, target.class_name).__dict__[target.method]
        assert wrapped is not before[target.qualname]
        assert wrapped.__wrapped__ is before[target.qualname]  # exactly one layer
    assert sglang_oobguard.is_installed()
    sglang_oobguard.uninstall()
    sglang_oobguard.uninstall()
    assert not sglang_oobguard.is_installed()
    assert originals(mp) == before and all(originals(mp)[q] is f for q, f in before.items())


def test_reinstall_after_uninstall_wraps_once_again(mp):
    before = originals(mp)
    sglang_oobguard.install("raise")
    sglang_oobguard.uninstall()
    sglang_oobguard.install("raise")
    for target in TARGETS:
        assert getattr(mp, target.class_name).__dict__[target.method].__wrapped__ is before[target.qualname]


def test_install_with_mode_off_in_the_environment_patches_nothing(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_MODE", "off")
    before = originals(mp)
    assert sglang_oobguard.install() == ()
    assert not sglang_oobguard.is_installed() and originals(mp) == before


def test_install_rejects_a_bad_mode_argument(mp):
    with pytest.raises(ConfigError, match="mode='loud'"):
        sglang_oobguard.install("loud")
    assert not sglang_oobguard.is_installed()


def test_triton_backend_without_gpu_or_interpreter_is_refused(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_BACKEND", "triton")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the triton backend is valid")
    with pytest.raises(ConfigError, match="SGLANG_OOBGUARD_BACKEND='triton'"):
        sglang_oobguard.install("strict")
    assert not sglang_oobguard.is_installed()


def test_wrap_only_where_the_class_itself_defines_the_method(mp, monkeypatch):
    from sglang_oobguard.targets import resolve

    fp4 = next(t for t in TARGETS if t.qualname == "MHATokenToKVPoolFP4.set_kv_buffer")
    monkeypatch.delattr(mp.MHATokenToKVPoolFP4, "set_kv_buffer")
    assert "not defined by the class itself" in resolve(fp4, mp)


def test_coverage_names_every_target(mp):
    rows = coverage()
    assert [t for t, _ in rows] == list(TARGETS)
    assert all(not isinstance(found, str) for _, found in rows)
