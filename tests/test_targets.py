"""The target table and version gate, without sglang."""

from __future__ import annotations

import pytest

from sglang_oobguard.targets import SITES, TARGETS, is_supported


def test_table_holds_the_six_upstream_labels_once_each():
    assert [t.label for t in TARGETS] == [
        "set_kv_buffer (MHA)", "set_kv_buffer (MHA-FP4)", "set_kv_buffer (MLA)", "set_mla_kv_buffer (MLA)",
        "set_kv_buffer (MLA-FP4)", "set_mla_kv_buffer (MLA-FP4)"]
    assert [SITES[t] for t in TARGETS] == list(range(6))


@pytest.mark.parametrize("version,ok", [("0.5.23", True), ("0.5.10", True), ("0.5.13.post1", True),
                                        ("0.5.9", False), ("0.4.10.post2", False), ("0.5.24", False),
                                        ("unknown", False), ("0.6.0rc1", False)])
def test_declared_support(version, ok):
    assert is_supported(version) is ok


def test_unsupported_version_still_installs_and_says_so(mp, monkeypatch, caplog):
    import sglang_oobguard
    from sglang_oobguard import patch

    monkeypatch.setattr(patch, "version_of_sglang", lambda: "0.9.0")
    caplog.set_level("INFO", logger="sglang_oobguard")
    assert len(sglang_oobguard.install("strict")) == 6
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_oobguard"]
    assert any("sglang 0.9.0 is outside the supported range; not guarded: nothing" in line for line in lines)


def test_missing_class_is_skipped_and_named(mp, monkeypatch, caplog):
    import sglang_oobguard

    monkeypatch.delattr(mp, "MHATokenToKVPoolFP4")
    caplog.set_level("INFO", logger="sglang_oobguard")
    targets = sglang_oobguard.install("strict")
    assert len(targets) == 5 and "set_kv_buffer (MHA-FP4)" not in {t.label for t in targets}
    lines = [r.getMessage() for r in caplog.records if r.name == "sglang_oobguard"]
    assert any("not guarded: MHATokenToKVPoolFP4.set_kv_buffer (MHATokenToKVPoolFP4 is not in this sglang)" in line
               for line in lines), lines
