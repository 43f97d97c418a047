"""The two probe paths against an oracle and against each other: the host scan
(CPU) and the fused Triton kernel (run by Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_oobguard import probe


def oracle(ids: list[int], high: int):
    bad = [i for i, v in enumerate(ids) if not 0 <= v < high]
    return (len(bad), bad[0], ids[bad[0]]) if bad else None


def host_path(loc, high, site, layer, record):
    finding = probe.scan_host(loc, high)
    if finding is not None:
        probe.fold_host(record, finding, site, layer, high, loc.numel())
        probe.contain_host(loc, high)
    return finding


calls = st.integers(1, 4000).flatmap(
    lambda high: st.tuples(
        st.just(high),
        st.lists(st.lists(st.integers(-3, high + 3) | st.integers(-(2**31), 2**31 - 1), max_size=2100),
                 min_size=1, max_size=3),
        st.sampled_from([torch.int32, torch.int64]),
    )
)


@settings(max_examples=60, deadline=None)
@given(calls)
def test_both_paths_agree_with_the_oracle_and_each_other(case):
    high, batches, dtype = case
    host_rec, dev_rec = probe.new_record("cpu"), probe.new_record("cpu")
    expected_total, expected_calls, first = 0, 0, None
    for site, ids in enumerate(batches):
        want = oracle(ids, high)
        a = torch.tensor(ids, dtype=dtype)
        b = a.clone()
        found = host_path(a, high, site, 7, host_rec)
        probe.launch(b, high, site, 7, dev_rec, None)
        assert (None if found is None else tuple(found)) == want
        assert torch.equal(a, b)  # identical containment
        assert all(0 <= v < high for v in a.tolist())
        if want:
            expected_total += want[0]
            expected_calls += 1
            first = first or probe.Record(0, 0, site, 7, high, want[0], len(ids), want[1], want[2])
    assert torch.equal(host_rec, dev_rec)
    got = probe.read(dev_rec)
    assert (got.total_bad, got.calls) == (expected_total, expected_calls)
    if first:
        assert got[2:] == first[2:]


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 3000])
def test_block_edges_find_the_last_id(n):
    loc = torch.zeros(n, dtype=torch.int64)
    loc[-1] = 10
    record = probe.new_record("cpu")
    probe.launch(loc, 10, 0, 0, record, None)
    got = probe.read(record)
    assert (got.bad, got.pos, got.value, got.numel) == (1, n - 1, 10, n)
    assert probe.scan_host(torch.tensor([0] * (n - 1) + [10]), 10) == probe.Finding(1, n - 1, 10)


rows = st.integers(1, 600).flatmap(
    lambda high: st.tuples(
        st.just(high),
        st.integers(1, 40).flatmap(lambda cols: st.lists(
            st.tuples(st.lists(st.integers(-3, high + 3), min_size=cols, max_size=cols), st.integers(0, cols)),
            min_size=1, max_size=40)),
        st.sampled_from([torch.int32, torch.int64]),
    )
)


@settings(max_examples=40, deadline=None)
@given(rows)
def test_prefix_valid_rows_check_only_the_written_prefix(case):
    """set_kv_buffer_prefix_valid writes loc_2d[i, :lens[i]]: both paths check exactly
    those ids (the rest of a row may hold anything) and contain only those."""
    high, batch, dtype = case
    loc = torch.tensor([ids for ids, _ in batch], dtype=dtype)
    lens = torch.tensor([n for _, n in batch], dtype=torch.int32)
    want = oracle([v if j < n else 0 for ids, n in batch for j, v in enumerate(ids)], high)  # tails: a valid 0
    a, b = loc.clone(), loc.clone()
    found = probe.scan_host(a, high, lens)
    record = probe.new_record("cpu")
    probe.launch(b, high, 3, 1, record, None, lens)
    assert (None if found is None else tuple(found)) == want
    got = probe.read(record)
    assert ((got.bad, got.pos, got.value) if got.calls else None) == want
    probe.contain_host(a, high, lens)
    assert torch.equal(a, b)
    for i, (ids, n) in enumerate(batch):  # unwritten tails untouched, written prefixes in range
        assert b[i, n:].tolist() == ids[n:]
        assert all(0 <= v < high for v in b[i, :n].tolist())
