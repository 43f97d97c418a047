"""Each check's device memory: sized as sglang sizes its pools (the allocator's first clear),
said in the log for the pool at hand and by doctor for a large one; none is made later."""

from __future__ import annotations

import logging

import pytest

from helpers import mha, run_python, token_allocator


@pytest.fixture(scope="module")
def allocators():
    from sglang.srt.mem_cache import allocator

    return allocator


def test_the_log_names_each_checks_memory_for_the_pool_at_hand(mp, allocators, guard, caplog):
    guard("strict", liveness=True)
    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        token_allocator(allocators, mha(mp, size=64))
    pages = 64 + 1  # size + page_size slots at page 1: one page each
    line = next(r.getMessage() for r in caplog.records if "the checks' memory for MHATokenToKVPool" in r.getMessage())
    assert line.endswith(f"({pages} pages on cpu, made with its allocator): owners {4 * (pages + 1)} B, liveness "
                         f"{4 * (pages + 1)} B, history {24 * (pages + 1)} B"), line


def test_a_check_off_keeps_no_memory_and_is_not_named(mp, allocators, guard, caplog, monkeypatch):
    monkeypatch.setenv("SGLANG_OOBGUARD_CHECKS", "-reads,-history")
    guard("strict", liveness=True)
    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        allocator = token_allocator(allocators, mha(mp, size=64))
    line = next(r.getMessage() for r in caplog.records if "the checks' memory for" in r.getMessage())
    assert "history" not in line and line.endswith("owners 264 B, liveness 264 B"), line
    assert allocator.__dict__.get("_oobguard_live") is not None  # made at the allocator's clear, with the pools


def test_doctor_gives_each_memory_keeping_check_its_bytes():
    proc = run_python("from sglang_oobguard.activate.doctor import run; run()",
                      {"SGLANG_ENABLE_ASYNC_ASSERT": "1", "SGLANG_OOBGUARD_LIVENESS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    example = "for a pool of 1048576 pages and 4096 req_to_token rows x 131072, made with them"
    for name, size in (("liveness", "4.0 MiB"), ("owners", "4.0 MiB"), ("history", "24.0 MiB"), ("reads", "4.0 GiB")):
        assert any(line.startswith(f"  {name}: ") and f"device memory: {size} {example}" in line
                   for line in proc.stdout.splitlines()), name
