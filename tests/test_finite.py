"""SGLANG_OOBGUARD_FINITE: the values every guarded write stores, checked for NaN and
+-Inf on the six sites of sglang's real pools (MHA, MLA's latent and its nope and rope
parts, the FP4 pools), by the host scan (CPU tensors) and by the value kernel (forced,
run by Triton's interpreter). A report names the site, layer, part, token, slot, head and
what the value is; the values are written as given except in strict, which stops first."""

from __future__ import annotations

import inspect
import logging
import re

import pytest
import torch

import sglang_oobguard
from helpers import Layer, as_write_loc, mha, sglang_can_write, site_cases
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.probes import kernels, valuekernel

PATHS = ["auto", "triton"]  # the host scan; the kernel
LAYERS = 4  # the `runner` fixture's model


def write(pool, method: str, layer: int, loc: list[int], a, b, mp) -> None:
    getattr(pool, method)(Layer(layer), as_write_loc(mp, torch.tensor(loc)), a, b)
    sglang_oobguard.check()  # the kernel's record is read at a check point


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("which", [0, 1])
@pytest.mark.parametrize("label", list(site_cases(None)))
def test_a_nan_in_each_part_of_each_site_is_reported_by_part_layer_token_slot_and_head(mp, guard, label, which,
                                                                                         backend):
    sglang_can_write(mp, label)
    make, method, payload = site_cases(mp)[label]
    guard("raise", backend=backend, finite=True)
    pool = make()
    given = list(payload(3))
    if given[which] is None:
        pytest.skip(f"{label} stores one part (MLA's latent)")
    part = given[which]
    heads = part.shape[1]
    part[2, heads - 1, 1] = float("nan")
    name = [p for p in inspect.signature(getattr(type(pool), method)).parameters][3 + which]
    with pytest.raises(KVOutOfBoundsError) as info:
        write(pool, method, 1, [7, 8, 9], *given, mp)
    v = info.value.violation
    assert (v.kind, v.layer, v.pos, v.value, v.part, v.head, v.element, v.padding, v.bad) == \
        ("nonfinite", 1, 2, 9, name, heads - 1, "nan", False, 1), v
    assert str(v) == f"{label} layer 1: {name} of loc[2] (slot 9) head {heads - 1} is nan, not finite " \
                     "(1 non-finite values written)"


@pytest.mark.parametrize("backend", PATHS)
def test_clean_writes_report_nothing(mp, guard, backend):
    guard("raise", backend=backend, finite=True)
    pool = mha(mp)
    for layer in range(4):
        write(pool, "set_kv_buffer", layer, [1, 2, 3], torch.randn(3, 2, 4), torch.randn(3, 2, 4) * 1e30, mp)
    assert not sglang_oobguard.violations()


@pytest.mark.parametrize("backend", PATHS)
@pytest.mark.parametrize("mode", ["raise", "warn"])
def test_raise_and_warn_write_the_values_unchanged_and_count_every_non_finite_one(mp, guard, backend, mode, caplog):
    guard(mode, backend=backend, finite=True)
    pool = mha(mp)
    k, v = torch.randn(4, 2, 4), torch.randn(4, 2, 4)
    k[1, 1, 0], k[3, 0, 2], v[0, 0, 0] = float("inf"), float("nan"), float("-inf")
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        try:
            write(pool, "set_kv_buffer", 2, [10, 11, 12, 13], k, v, mp)
        except KVOutOfBoundsError:
            assert mode == "raise"
    assert torch.equal(pool.k_buffer[2][10:14], k) is False and torch.allclose(
        pool.k_buffer[2][10:14].nan_to_num(), k.nan_to_num())  # NaN != NaN: compare them as numbers
    assert torch.isinf(pool.k_buffer[2][11, 1, 0]) and torch.isneginf(pool.v_buffer[2][10, 0, 0])
    first = sglang_oobguard.violations()[0]
    assert (first.part, first.pos, first.value, first.head, first.element, first.bad) == \
        ("cache_k", 1, 11, 1, "+inf", 2)  # K's first; V's -inf is the second call of the record
    assert first.calls == 2 and first.total_bad == 3
    if mode == "warn":
        assert "non-finite KV values, written unchanged" in caplog.text
        assert "set_kv_buffer (MHA) layer 2: cache_k of loc[1] (slot 11) head 1 is +inf" in caplog.text


def test_strict_stops_before_the_write(mp, guard):
    guard("strict", finite=True)  # the host path: on a GPU the device-side assert stops the stream
    pool = mha(mp)
    k = torch.ones(2, 2, 4)
    k[0, 0, 0] = float("-inf")
    with pytest.raises(KVOutOfBoundsError, match=r"cache_k of loc\[0\] \(slot 3\) head 0 is -inf"):
        write(pool, "set_kv_buffer", 0, [3, 4], k, k, mp)
    assert not pool.k_buffer[0][3:5].any()  # nothing written


def nan_v_at(bad: list[int]):
    """A model whose layers in `bad` (a list the test may change) write V with a NaN at the
    second token (head 1)."""
    def values(layer: int, ones: torch.Tensor):
        v = ones.clone()
        if layer in bad:
            v[1, 1, 0] = float("nan")
        return ones, v
    return values


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_a_step_s_small_parts_are_checked_when_its_forward_returns(mp, guard, runner, mode, caplog):
    """Inside a forward step a host write's small parts wait for the step's end (each
    write's own check runs cold between the model's ops): the report names the layer, the
    part, the token and its slot, as at the write; strict and raise raise as the forward
    returns, before the scheduler reads its results; warn returns them."""
    from test_step import decode_batch

    guard(mode, finite=True)
    pool = mha(mp)
    bad: list[int] = []
    run = runner(pool, nan_v_at(bad))
    assert run.forward(decode_batch(torch.tensor([1, 2, 3]))) == "output"
    bad.append(2)
    if mode == "warn":
        with caplog.at_level(logging.WARNING):
            assert run.forward(decode_batch(torch.tensor([4, 5, 6]))) == "output"
        said = caplog.text
    else:
        with pytest.raises(KVOutOfBoundsError) as raised:
            run.forward(decode_batch(torch.tensor([4, 5, 6])))
        said = str(raised.value)
    assert re.search(r"layer 2\b.*cache_v of loc\[1\] \(slot 5\) head 1 is nan", said), said
    assert pool.v_buffer[2][5].isnan().any()  # written, as the write was: the report came after it
    bad.clear()
    assert run.forward(decode_batch(torch.tensor([7, 8, 9]))) == "output"  # nothing left over
    counts = sglang_oobguard.activate.instrument._active.guard.counts.snapshot(("finite",))
    assert counts["finite"]["writes"] == 3 * LAYERS


def test_a_step_s_large_parts_are_checked_at_the_write(mp, guard, runner, monkeypatch):
    """A part larger than `values.SMALL` is checked at its write even inside a step (its own
    data outweighs the call): strict stops before that layer writes."""
    from sglang_oobguard.checks import values
    from test_step import decode_batch

    monkeypatch.setattr(values, "SMALL", 8)  # (3 tokens x 2 heads x 4: 24 values)
    guard("strict", finite=True)
    pool = mha(mp)
    with pytest.raises(KVOutOfBoundsError, match=r"cache_v of loc\[1\] \(slot 5\) head 1 is nan"):
        runner(pool, nan_v_at([2])).forward(decode_batch(torch.tensor([4, 5, 6])))
    assert pool.v_buffer[1][5].eq(1).all() and not pool.v_buffer[2][5].any()  # layer 1 written, layer 2 not


@pytest.mark.parametrize("backend", PATHS)
def test_a_nan_written_to_padding_slot_0_is_named_so(mp, guard, backend, caplog):
    """sglang #36207 starts so: every padded batch then reads the NaN."""
    guard("warn", backend=backend, finite=True)
    pool = mha(mp)
    k, v = torch.randn(2, 2, 4), torch.randn(2, 2, 4)
    v[0, 1, 3] = float("nan")
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        write(pool, "set_kv_buffer", 1, [0, 6], k, v, mp)
    (violation,) = sglang_oobguard.violations()
    assert violation.padding is True and violation.value == 0 and violation.pos == 0
    assert "set_kv_buffer (MHA) layer 1: cache_v of loc[0] (padding slot 0) head 1 is nan" in caplog.text
    assert torch.isnan(pool.v_buffer[1][0, 1, 3])  # not dropped: the README says why


def test_a_non_finite_scale_is_reported_without_a_token(mp, guard):
    guard("raise", finite=True)
    pool = mha(mp)
    k = torch.ones(2, 2, 4)
    with pytest.raises(KVOutOfBoundsError, match=r"set_kv_buffer \(MHA\) layer 0: k_scale is nan, not finite"):
        pool.set_kv_buffer(Layer(0), torch.tensor([1, 2]), k, k, k_scale=float("nan"))
    v = sglang_oobguard.violations()[0]
    assert (v.pos, v.value, v.head, v.padding) == (-1, -1, None, None)


def test_the_kernel_split_over_programs_finds_the_first_and_counts_all(mp, guard):
    guard("raise", backend="triton", finite=True)
    pool = mha(mp, size=8192)
    n = 5000  # 8 values a token: 40000 values, 3 programs of CHUNK
    assert -(-n * 8 // valuekernel.CHUNK) == 3
    k = torch.zeros(n, 2, 4)
    k[4500, 0, 0] = float("nan")
    k[3000, 1, 2] = float("-inf")  # the first, in the second program
    with pytest.raises(KVOutOfBoundsError) as info:
        write(pool, "set_kv_buffer", 0, list(range(1, n + 1)), k, k.clone().zero_(), mp)
    v = info.value.violation
    assert (v.pos, v.value, v.head, v.element, v.bad, v.numel) == (3000, 3001, 1, "-inf", 2, n)
    assert pool._oobguard_state.scratch.tolist() == list(kernels.SCRATCH_INIT)  # put back


def test_finite_off_checks_no_value(mp, guard):
    guard("raise")
    pool = mha(mp)
    k = torch.full((2, 2, 4), float("nan"))
    write(pool, "set_kv_buffer", 0, [1, 2], k, k, mp)
    assert not sglang_oobguard.violations()


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu])
def test_fp8_stored_values_and_scales_are_read_where_the_format_holds_nan(dtype):
    """FP8 (E4M3, E5M2) values and MXFP8's UE8M0 scales can hold NaN: the host scan reads
    them through a float copy (torch has no isfinite for them); FP4 (E2M1) has no NaN or Inf."""
    from sglang_oobguard.probes.values import scan_values

    clean = torch.ones(3, 2, 4)
    assert scan_values(clean.to(dtype), 3) is None
    clean[1, 1, 2] = float("nan")
    assert scan_values(clean.to(dtype), 3) == (1, 1, 1, 0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_sum_that_overflows_is_no_finding(dtype):
    """The clean path sums the values: large finite values whose sum overflows the dtype
    (float16 at 65504) are checked again, and reported only if one of them is not finite."""
    from sglang_oobguard.probes.values import scan_values

    big = torch.full((64, 2, 4), torch.finfo(dtype).max / 4, dtype=dtype)
    assert not torch.isfinite(big.sum()) and scan_values(big, 64) is None
    big[5, 1, 0] = float("-inf")
    assert scan_values(big, 64) == (1, 5, 1, 2)


def test_a_prefix_valid_write_checks_only_the_rows_it_stores(mp, guard):
    """set_kv_buffer_prefix_valid stores loc_2d[i, :commit_lens[i]]; a NaN in a row past
    the prefix is never stored and is no finding; one in the prefix is (sglang's CPU path
    stores the prefix through set_kv_buffer, checked there)."""
    from helpers import needs

    needs("MHATokenToKVPool.set_kv_buffer_prefix_valid")
    guard("raise", finite=True)
    pool = mha(mp)
    loc_2d, lens = torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([2, 1])
    k = torch.ones(6, 2, 4)
    k[2, 0, 0] = k[5, 1, 1] = float("nan")  # past each row's prefix
    pool.set_kv_buffer_prefix_valid(Layer(0), loc_2d, lens, k, k.clone())
    assert not sglang_oobguard.violations()
    k[3, 1, 2] = float("inf")  # row 1's stored token: the third of the three stored
    with pytest.raises(KVOutOfBoundsError, match=r"set_kv_buffer \(MHA\) layer 0: cache_k of loc\[2\] \(slot 4\) "
                                                 r"head 1 is \+inf"):
        pool.set_kv_buffer_prefix_valid(Layer(0), loc_2d, lens, k, k.clone())
