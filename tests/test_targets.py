"""The rule table and version gate, without sglang; then the install-time log lines."""

from __future__ import annotations

import pytest

from sglang_oobguard.model.targets import CONTRACT, DCP_TOKEN_SLOTS, OWN, TOKEN_SLOTS, WRITE_METHOD, is_supported, label_for, rule_for


@pytest.mark.parametrize("name", ["set_kv_buffer", "set_mla_kv_buffer", "move_kv_cache", "set_kv_buffer_prefix_valid",
                                  "set_index_k_scale_buffer", "set_index_k_and_scale_buffer", "set_k_buffer",
                                  "set_key_buffer_fused", "set_swa_key_buffer_radix", "set_index_fp4",
                                  "set_index_fused", "set_index_k_scale", "set_quantized_kv_buffer",
                                  "set_qsa_rope_position_buffer"])
def test_write_method_names_across_releases_are_recognised(name):
    assert WRITE_METHOD.match(name)


@pytest.mark.parametrize("name", ["set_swa_loc", "_set_kv_buffer_impl", "get_kv_buffer", "move_kv_cache_native",
                                  "set_layer_transfer_counter"])
def test_other_names_are_not_write_methods(name):
    assert WRITE_METHOD.match(name) is None


def test_rules_own_beats_contract_and_labels_follow_upstream():
    assert rule_for("MLATokenToKVPool", "set_mla_kv_buffer").ids[0].bound is DCP_TOKEN_SLOTS
    assert rule_for("MLATokenToKVPoolFP4", "set_mla_kv_buffer").ids[0].bound is TOKEN_SLOTS  # upstream: no widening
    assert rule_for("AnyPool", "set_kv_buffer") is CONTRACT["set_kv_buffer"]
    assert rule_for("DeepSeekV4TokenToKVPool", "set_swa_key_buffer") is None  # no rule: not guarded
    move = rule_for("MHATokenToKVPool", "move_kv_cache")
    assert [label_for("MHATokenToKVPool", "move_kv_cache", ids) for ids in move.ids] == [
        "move_kv_cache tgt_loc", "move_kv_cache src_loc"]
    assert label_for("MHATokenToKVPool", "set_kv_buffer", CONTRACT["set_kv_buffer"].ids[0]) == "set_kv_buffer (MHA)"
    assert label_for("SWAKVPool", "set_kv_buffer", CONTRACT["set_kv_buffer"].ids[0]) == "set_kv_buffer (SWAKVPool)"
    assert all(rule.ids for rule in [*CONTRACT.values(), *OWN.values()])


@pytest.mark.parametrize("version,ok", [("0.5.23", True), ("0.5.10", True), ("0.5.13.post1", True),
                                        ("0.4.10.post2", True), ("0.4.9", False), ("0.5.24", False),
                                        ("unknown", False), ("0.6.0rc1", False)])
def test_declared_support(version, ok):
    assert is_supported(version) is ok


def test_unsupported_version_still_installs_and_says_so(mp, monkeypatch, caplog):
    import sglang_oobguard
    from sglang_oobguard.activate import instrument as patch

    monkeypatch.setattr(patch, "version_of_sglang", lambda: "0.9.0")
    caplog.set_level("INFO", logger="sglang_oobguard")
    assert sglang_oobguard.install("strict")
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_oobguard"]
    assert any("sglang 0.9.0 is outside the supported range; not guarded:" in line for line in lines), lines


@pytest.mark.parametrize("version, supported", [
    ("0.5.23", True), ("0.5.23+cu130", True), ("0.5.6rc2", True), ("0.4.10.post2", True), ("0.5.23.post1", True),
    ("0.4.9", False), ("0.5.24", False), ("0.5.24rc1", False), ("1.0.0", False), ("unknown", False), ("", False),
])
def test_supported_range_reads_release_numbers(version, supported):
    """A local build or a pre-release of a release in range is in range (no false warning)."""
    assert is_supported(version) is supported
