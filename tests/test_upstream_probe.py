"""sglang 0.5.13+ runs its own probe inside the methods we guard when
SGLANG_ENABLE_ASYNC_ASSERT is set: the same check twice. While installed, the guard
skips upstream's copy inside the methods it guards and leaves every other probe alone."""

from __future__ import annotations

import importlib

import pytest
import torch

import sglang_oobguard
from helpers import Layer, has, mha, needs


@pytest.fixture(autouse=True)
def upstream_probe(mp):
    needs("maybe_detect_oob")


def test_duplicates_skipped_inside_our_methods_only_and_restored(mp, monkeypatch):
    from sglang.srt.utils import async_probe

    # a second pool module that binds the probe, where this release has it (0.5.16+)
    binders = [mp] + ([importlib.import_module("sglang.srt.mem_cache.dsa_cache_layer_split")]
                      if has("dsa_cache_layer_split") else [])
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    original = async_probe.maybe_detect_oob
    assert all(module.maybe_detect_oob is original for module in binders)
    sglang_oobguard.install("warn")
    assert all(module.maybe_detect_oob.__wrapped__ is original for module in binders)
    bad = torch.tensor([99])
    with pytest.raises(RuntimeError, match="out of range"):  # outside our methods: upstream's probe runs
        mp.maybe_detect_oob(bad, 0, 65, "set_kv_buffer (MHA)")
    asserts = []
    real_assert = torch._assert_async
    monkeypatch.setattr(torch, "_assert_async", lambda *a, **k: (asserts.append(a[-1]), real_assert(*a, **k)))
    k = torch.zeros(1, 2, 4)
    mha(mp).set_kv_buffer(Layer(0), torch.tensor([7]), k, k)
    assert asserts == []  # inside: upstream's duplicate (two asserts, 4-6 launches on a GPU) skipped
    sglang_oobguard.uninstall()
    mha(mp).set_kv_buffer(Layer(0), torch.tensor([7]), k, k)
    assert len(asserts) == 2  # restored: upstream's low and high asserts run again
    assert all(module.maybe_detect_oob is original for module in binders)


def test_upstream_probe_alone_kills_the_write_and_names_nothing(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    k = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match=r"^index >= 65 \(out of range\): set_kv_buffer \(MHA\)$"):
        mha(mp).set_kv_buffer(Layer(0), torch.tensor([70]), k, k)


def test_warn_mode_is_not_overruled_by_upstreams_strict_copy(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    monkeypatch.setenv("SGLANG_INVARIANT_CHECK", "1")  # our mode: warn
    from sglang_oobguard.model.config import Mode, from_env

    assert from_env().mode is Mode.WARN
    sglang_oobguard.install()
    k = torch.ones(1, 2, 4)
    pool = mha(mp)
    pool.set_kv_buffer(Layer(0), torch.tensor([70]), k, k)  # contained, served
    assert torch.equal(pool.k_buffer[0][0], k[0])
    assert [v.value for v in sglang_oobguard.violations()] == [70]


def test_with_sglangs_flag_off_its_probe_is_left_unwrapped_until_a_later_install_sets_it(mp, monkeypatch):
    """Off, sglang's probe returns at once: a skip wrapper would only add a call to every write."""
    from sglang.srt.utils import async_probe

    original = async_probe.maybe_detect_oob
    sglang_oobguard.install("strict")
    assert mp.maybe_detect_oob is original
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    sglang_oobguard.install("strict")  # the same guard, reconfigured: now sglang's duplicate is skipped
    assert mp.maybe_detect_oob.__wrapped__ is original
    asserts = []
    monkeypatch.setattr(torch, "_assert_async", lambda *a, **k: asserts.append(a[-1]))
    k = torch.zeros(1, 2, 4)
    mha(mp).set_kv_buffer(Layer(0), torch.tensor([7]), k, k)
    assert asserts == []
    sglang_oobguard.uninstall()
    assert mp.maybe_detect_oob is original
