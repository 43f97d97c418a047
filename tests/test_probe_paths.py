"""The two probe paths against an oracle and against each other: the host scan
(CPU) and the fused Triton kernel (run by Triton's interpreter on CPU tensors)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_oobguard.probes import hostscan, kernels
from sglang_oobguard.probes.record import Record, fold_host


STEP = 5  # the step counter the kernel reads and the host folds in


def new_record():
    return torch.zeros(len(Record._fields), dtype=torch.int64)


def kernel(loc, high, site, layer, record, lens=None, live=None):
    """The kernel path (Triton's interpreter here): returns its cleaned copy; `loc` is only read."""
    clean = torch.empty_like(loc, memory_format=torch.contiguous_format)
    scratch = torch.tensor(kernels.SCRATCH_INIT)
    kernels.launch(loc, high, site, layer, record, scratch, torch.tensor([STEP]), clean, None, lens, live)
    assert scratch.tolist() == list(kernels.SCRATCH_INIT)  # a split probe leaves its scratch as it found it
    return clean


def oracle(ids: list[int], high: int):
    bad = [i for i, v in enumerate(ids) if not 0 <= v < high]
    return (len(bad), bad[0], ids[bad[0]]) if bad else None


def host_path(loc, high, site, layer, record):
    """The host path: returns (finding, what the write gets)."""
    finding = hostscan.scan_host(loc, high)
    if finding is None:
        return None, loc
    fold_host(record, finding.record(site, layer, high, loc.numel(), STEP))
    return finding, hostscan.cleaned(loc, high)


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
    host_rec, dev_rec = new_record(), new_record()
    expected_total, expected_calls, first = 0, 0, None
    for site, ids in enumerate(batches):
        want = oracle(ids, high)
        loc = torch.tensor(ids, dtype=dtype)
        found, host_copy = host_path(loc, high, site, 7, host_rec)
        dev_copy = kernel(loc, high, site, 7, dev_rec)
        assert loc.tolist() == ids  # the caller's ids are never changed
        assert (None if found is None else tuple(found)) == want
        assert torch.equal(host_copy, dev_copy)  # identical containment
        assert dev_copy.tolist() == [v if 0 <= v < high else 0 for v in ids]
        if want:
            expected_total += want[0]
            expected_calls += 1
            first = first or Record(0, 0, site, 7, high, want[0], len(ids), want[1], want[2], STEP)
    assert torch.equal(host_rec, dev_rec)
    got = Record(*dev_rec.tolist())
    assert (got.total_bad, got.calls) == (expected_total, expected_calls)
    if first:
        assert got[2:] == first[2:]


@pytest.mark.parametrize("n", [1, 1023, 1024, 1025, 3000, kernels.SPLIT_ABOVE, kernels.SPLIT_ABOVE + 1, 65536])
def test_block_and_program_edges_find_the_last_id(n):
    loc = torch.zeros(n, dtype=torch.int64)
    loc[-1] = 10
    record = new_record()
    kernel(loc, 10, 0, 0, record)
    got = Record(*record.tolist())
    assert (got.calls, got.bad, got.pos, got.value, got.numel) == (1, 1, n - 1, 10, n)
    assert hostscan.scan_host(torch.tensor([0] * (n - 1) + [10]), 10) == hostscan.Finding(1, n - 1, 10)


@pytest.mark.parametrize("n", [kernels.SPLIT_ABOVE + 1, 3 * kernels.SPLIT_CHUNK + 5, 65536])
def test_a_probe_split_over_programs_folds_like_one(n):
    """Several programs (a large prefill chunk): one call counted, the least bad position
    and its value, whatever program found it; then a clean call adds nothing."""
    assert kernels.programs(n)[0] > 1
    gen = torch.Generator().manual_seed(n)
    loc = torch.randint(0, 1000, (n,), generator=gen)
    bad_at = sorted(torch.randperm(n, generator=gen)[:7].tolist())
    for i, at in enumerate(bad_at):
        loc[at] = 1000 + i if i % 2 else -1 - i
    record = new_record()
    clean = kernel(loc, 1000, 4, 2, record)
    want = oracle(loc.tolist(), 1000)
    assert Record(*record.tolist()) == Record(7, 1, 4, 2, 1000, 7, n, want[1], want[2], STEP)
    assert torch.equal(clean, hostscan.cleaned(loc, 1000))
    kernel(loc.clamp(0, 999), 1000, 4, 2, record)
    assert Record(*record.tolist()).calls == 1


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
    before = loc.clone()
    found = hostscan.scan_host(loc, high, lens)
    record = new_record()
    clean = kernel(loc, high, 3, 1, record, lens)
    assert torch.equal(loc, before)
    assert (None if found is None else tuple(found)) == want
    got = Record(*record.tolist())
    assert ((got.bad, got.pos, got.value) if got.calls else None) == want
    assert torch.equal(hostscan.cleaned(loc, high, lens), clean)
    for i, (ids, n) in enumerate(batch):  # unwritten tails copied as they are, written prefixes in range
        assert clean[i, n:].tolist() == ids[n:]
        assert all(0 <= v < high for v in clean[i, :n].tolist())


@settings(max_examples=300, deadline=None)
@given(page=st.sampled_from([1, 4]), pages=st.integers(1, 12), data=st.data())
def test_a_free_s_fast_answer_agrees_with_the_full_scan(page, pages, data):
    """scan_free's fast answer (plain Python for a few ids, numpy for many) finds exactly
    what the full scan finds: ids outside the bound, on a page not live (page 0
    included), outside the shadow, and (page 1) an id named twice."""
    from sglang_oobguard.probes import shadow

    live = shadow.new_live(pages, page, torch.device("cpu"), owners=False, history=False)
    held = data.draw(st.booleans())  # every page live, and ids on them only: the clean frees and the repeats
    flags = [1] * pages if held else data.draw(st.lists(st.integers(0, 1), min_size=pages, max_size=pages))
    live.flags[:pages].copy_(torch.tensor(flags))
    high = pages * page + data.draw(st.integers(0, 3))  # ids past the shadow may still be in the bound
    count = data.draw(st.sampled_from([1, 3, 40]))
    low, top = (page, pages * page - 1) if held and pages > 1 else (-1, high)
    unique = count <= top - low + 1 and data.draw(st.booleans())
    ids = torch.tensor(data.draw(st.lists(st.integers(low, top), min_size=count, max_size=count, unique=unique)))
    flat = ids.reshape(-1)
    assert hostscan.scan_free(ids, high, live) == hostscan._finding(flat, hostscan.bad_free(flat, high, live))
