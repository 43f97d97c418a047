"""sglang 0.5.13+ runs its own probe inside the methods we guard when
SGLANG_ENABLE_ASYNC_ASSERT is set: the same check twice. While installed, the guard
skips upstream's copy under our six labels and leaves every other probe alone."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import Layer, mha, needs


@pytest.fixture(autouse=True)
def upstream_probe(mp):
    needs(mp, "maybe_detect_oob", "0.5.13")


def test_duplicates_skipped_others_untouched_and_restored(mp, monkeypatch):
    from sglang.srt.utils import async_probe

    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    assert mp.maybe_detect_oob is async_probe.maybe_detect_oob
    sglang_oobguard.install("warn")
    bad = torch.tensor([99])
    for target in sglang_oobguard.install():
        assert mp.maybe_detect_oob(bad, 0, 65, target.label) is None
    with pytest.raises(RuntimeError, match="out of range"):
        mp.maybe_detect_oob(bad, 0, 65, "move_kv_cache tgt_loc")
    sglang_oobguard.uninstall()
    assert mp.maybe_detect_oob is async_probe.maybe_detect_oob


def test_upstream_probe_alone_kills_the_write_and_names_nothing(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    k = torch.zeros(1, 2, 4)
    with pytest.raises(RuntimeError, match=r"^index >= 65 \(out of range\): set_kv_buffer \(MHA\)$"):
        mha(mp).set_kv_buffer(Layer(0), torch.tensor([70]), k, k)


def test_warn_mode_is_not_overruled_by_upstreams_strict_copy(mp, monkeypatch):
    monkeypatch.setenv("SGLANG_ENABLE_ASYNC_ASSERT", "1")
    monkeypatch.setenv("SGLANG_INVARIANT_CHECK", "1")  # our mode: warn
    from sglang_oobguard.config import Mode, from_env

    assert from_env().mode is Mode.WARN
    sglang_oobguard.install()
    k = torch.ones(1, 2, 4)
    pool = mha(mp)
    pool.set_kv_buffer(Layer(0), torch.tensor([70]), k, k)  # contained, served
    assert torch.equal(pool.k_buffer[0][0], k[0])
    assert [v.value for v in sglang_oobguard.violations()] == [70]
