"""install / uninstall: one wrapper layer however often, exact originals restored."""

from __future__ import annotations

import pytest

import sglang_oobguard
from sglang_oobguard.model.config import ConfigError
from sglang_oobguard.model.discover import Found
from sglang_oobguard.model.discover import coverage
from helpers import mha


def originals(mp):
    """Every write method of every pool class, as the classes hold them now."""
    return {(e.owner, e.method): e.owner.__dict__[e.method] for e in coverage()}


def test_install_is_idempotent_and_uninstall_restores_identity(mp):
    before = originals(mp)
    first = sglang_oobguard.install("strict")
    assert first and sglang_oobguard.install("warn") == first  # settings change, wrappers do not
    assert sglang_oobguard.install() == first
    for found in first:
        wrapped = found.owner.__dict__[found.method]
        assert wrapped is not before[found.owner, found.method]
        assert wrapped.__wrapped__ is before[found.owner, found.method]  # exactly one layer
    assert "__init_subclass__" in mp.KVCache.__dict__  # the hook for pool classes defined later
    assert sglang_oobguard.is_installed()
    sglang_oobguard.uninstall()
    sglang_oobguard.uninstall()
    assert not sglang_oobguard.is_installed()
    assert "__init_subclass__" not in mp.KVCache.__dict__
    after = originals(mp)
    assert after.keys() == before.keys() and all(after[k] is f for k, f in before.items())


def test_reinstall_after_uninstall_wraps_once_again(mp):
    before = originals(mp)
    sglang_oobguard.install("raise")
    sglang_oobguard.uninstall()
    for found in sglang_oobguard.install("raise"):
        assert found.owner.__dict__[found.method].__wrapped__ is before[found.owner, found.method]


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


def test_coverage_guards_the_six_upstream_sites_and_inherits_nothing(mp):
    found = {(e.owner.__name__, e.method) for e in coverage() if isinstance(e, Found)}
    six = {("MHATokenToKVPool", "set_kv_buffer"), ("MHATokenToKVPoolFP4", "set_kv_buffer"),
           ("MLATokenToKVPool", "set_kv_buffer"), ("MLATokenToKVPool", "set_mla_kv_buffer"),
           ("MLATokenToKVPoolFP4", "set_kv_buffer"), ("MLATokenToKVPoolFP4", "set_mla_kv_buffer")}
    here = {pair for pair in six if hasattr(mp, pair[0])}  # FP4 pools arrived in 0.5.8
    assert ("MHATokenToKVPool", "set_kv_buffer") in here and here <= found
    for entry in coverage():  # only what a class defines itself: inherited methods are guarded once, at home
        assert entry.method in entry.owner.__dict__


def test_a_pool_gets_its_state_when_built_not_on_its_first_write(mp, guard):
    """The record, copy buffer and (on a GPU) the warm-up compiles exist before serving
    or graph capture: made by KVCache's constructor, or by install() over a pool built before."""
    from sglang_oobguard.probes.pools import STATE_ATTR

    before = mha(mp)
    guard("raise")
    built = mha(mp)
    for pool in (before, built):
        state = pool.__dict__.get(STATE_ATTR)
        assert state is not None and state.pool_name == "MHATokenToKVPool"
        assert state.record.read_now().calls == 0


def test_uninstall_takes_the_guards_attributes_off_sglangs_objects(mp, guard):
    from sglang.srt.mem_cache import allocator

    from helpers import token_allocator

    guard("raise", liveness=True)
    pool = mha(mp)
    alloc = token_allocator(allocator, pool)
    assert any(name.startswith("_oobguard") for name in vars(pool)) and any(name.startswith("_oobguard") for name in vars(alloc))
    sglang_oobguard.uninstall()
    assert not [name for obj in (pool, alloc) for name in vars(obj) if name.startswith("_oobguard")]
