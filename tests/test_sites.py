"""Each of the six guarded sites, on its real sglang pool class, in each mode."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import Layer, as_write_loc, needs, needs_site, sglang_can_write, site_cases
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.violation import site_label

LABELS = list(site_cases(None))
HIGH = 65


def call(mp, label, loc):
    make, method, payload = site_cases(mp)[label]
    pool = make()
    getattr(pool, method)(Layer(1), loc, *payload(getattr(loc, "loc", loc).numel()))
    return pool


def test_install_guards_the_six_upstream_sites_under_upstream_labels(mp, guard):
    labels = {site_label(s) for found in guard("strict") for s in found.sites}
    here = {label for label in LABELS if "FP4" not in label or hasattr(mp, "MHATokenToKVPoolFP4")}  # FP4: 0.5.8+
    assert "set_kv_buffer (MHA)" in here and here <= labels


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("mode", ["strict", "raise"])
def test_site_rejects_with_its_label(mp, guard, label, mode):
    """Before any of sglang's own write code runs: this holds even where that code
    cannot run on a CPU (the FP4 writes of 0.5.12)."""
    needs_site(mp, label)
    guard(mode)
    with pytest.raises(KVOutOfBoundsError) as info:
        call(mp, label, as_write_loc(mp, torch.tensor([1, HIGH + 1, 3])))
    assert info.value.label == label and info.value.layer == 1
    assert str(info.value).startswith(f"{label} layer 1: 1 of 3 slot ids outside [0, {HIGH}): loc[1] = {HIGH + 1}")


@pytest.mark.parametrize("label", LABELS)
@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_site_warn_contains_and_records(mp, guard, label, backend):
    sglang_can_write(mp, label)
    guard("warn", backend)
    pool = call(mp, label, torch.tensor([2, -1]))
    sglang_oobguard.check()  # the deferred path reports here; the host path already did
    del pool
    (v,) = sglang_oobguard.violations()
    assert (v.label, v.layer, v.bad, v.pos, v.value, v.high) == (label, 1, 1, 1, -1, HIGH)


def test_mla_bound_follows_the_dcp_span(mp, guard, monkeypatch):
    """0.5.19+: under decode context parallelism set_mla_kv_buffer's loc is logical,
    so the bound is widened by _write_loc_dcp_span exactly as upstream does."""
    needs("MLATokenToKVPool._write_loc_dcp_span")
    guard("raise")
    make, method, payload = site_cases(mp)["set_mla_kv_buffer (MLA)"]
    pool = make()
    monkeypatch.setattr(type(pool), "_write_loc_dcp_span", property(lambda self: 2))
    monkeypatch.setattr(type(pool), "_write_mla_kv_buffer", lambda self, *a: None)
    pool.set_mla_kv_buffer(Layer(0), torch.tensor([2 * HIGH - 1]), *payload(1))  # in range under DCP
    with pytest.raises(KVOutOfBoundsError, match=rf"outside \[0, {2 * HIGH}\)"):
        pool.set_mla_kv_buffer(Layer(0), torch.tensor([2 * HIGH]), *payload(1))
