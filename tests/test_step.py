"""The forward step (sglang's ModelRunner.forward, its real ForwardBatch and pool, on the
CPU): one check of out_cache_loc per step, later probes of the same ids skipped, reports
at the step boundary that name the request; and the fused RoPE + KV writer."""

from __future__ import annotations

import logging

import pytest
import torch

import sglang_oobguard
from helpers import Layer, mha
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.probes import hostscan, kernels

LAYERS, HIGH = 4, 65


def decode_batch(loc, rids=("r0", "r1", "r2"), seq_lens=(5, 9, 3)):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    size = len(rids)
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=size, input_ids=torch.zeros(size, dtype=torch.int64),
                         req_pool_indices=torch.arange(size), seq_lens=torch.tensor(seq_lens),
                         out_cache_loc=loc, seq_lens_sum=sum(seq_lens))
    batch.seq_lens_cpu, batch.rids = torch.tensor(seq_lens), list(rids)
    return batch


def count_probes(monkeypatch):
    calls = []
    for module, name in ((hostscan, "scan_host"), (kernels, "launch")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, real=real, **k: calls.append(1) or real(*a, **k))
    return calls


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_one_probe_per_ids_tensor_per_step_instead_of_one_per_layer(mp, guard, runner, monkeypatch, backend):
    guard("strict", backend)
    pool = mha(mp)
    run = runner(pool)
    calls = count_probes(monkeypatch)
    k = torch.ones(3, 2, 4)
    for layer in range(LAYERS):  # outside a forward step: every write is probed
        pool.set_kv_buffer(Layer(layer), torch.tensor([1, 2, 3]), k, k)
    assert len(calls) == LAYERS
    calls.clear()
    for _ in range(3):
        assert run.forward(decode_batch(torch.tensor([1, 2, 3]))) == "output"
    assert len(calls) == 3  # one per step: the step check; the layers' writes of the same ids are skipped


def test_the_same_ids_tensor_with_new_contents_is_checked_again_next_step(mp, guard, runner):
    """CUDA-graph static buffers: one tensor, new ids every step."""
    guard("strict")
    run = runner(mha(mp))
    loc = torch.tensor([1, 2, 3])
    run.forward(decode_batch(loc))
    loc[1] = HIGH + 1
    with pytest.raises(KVOutOfBoundsError, match=r"^out_cache_loc \(forward step\): 1 of 3 slot ids outside"):
        run.forward(decode_batch(loc))


def test_the_report_names_the_request_token_mode_step_and_ranks(mp, guard, runner):
    guard("strict")
    run = runner(mha(mp))
    run.forward(decode_batch(torch.tensor([1, 2, 3])))
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode_batch(torch.tensor([4, -1, 6])))
    v = info.value.violation
    assert (v.label, v.pos, v.value, v.step, v.mode, v.batch_size) == ("out_cache_loc (forward step)", 1, -1, 1, "decode", 3)
    assert (v.request, v.token, v.ranks) == ("r1", 8, "tp 1, pp 0, dp 0")  # r1's 9th token: seq_len 9 - 1
    assert str(info.value).endswith("(pool MHATokenToKVPool); step 1 (decode, batch 3); request r1 token 8; tp 1, pp 0, dp 0")


def test_ranks_sglang_never_wrote_do_not_cost_the_step_its_check(mp, guard, runner):
    """0.5.2x's runtime context raises RuntimeError for a rank not written in this
    process (a runner that knows only its tp rank, outside a launched server)."""
    guard("strict")
    run = runner(mha(mp))
    del run.pp_rank, run.dp_rank
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode_batch(torch.tensor([4, -1, 6])))
    assert info.value.violation.label == "out_cache_loc (forward step)"  # not a layer's write: the step check ran
    assert info.value.violation.ranks.startswith("tp 1")


def test_a_deferred_violation_is_reported_at_the_next_step_boundary(mp, guard, runner, caplog):
    """The GPU path (the kernel, forced on CPU tensors): the record is read at the step
    boundary, not by a later write; the report still names the step it came from."""
    guard("warn", backend="triton", poll_every=10**6)
    run = runner(mha(mp))
    run.forward(decode_batch(torch.tensor([1, 2, 3])))
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        run.forward(decode_batch(torch.tensor([1, HIGH + 4, 3])))  # recorded, contained, not read yet
        assert sglang_oobguard.violations() == []
        run.forward(decode_batch(torch.tensor([], dtype=torch.int64), rids=(), seq_lens=()))  # an idle step
    (v,) = sglang_oobguard.violations()
    assert (v.step, v.request, v.token, v.value) == (1, "r1", 8, HIGH + 4)
    assert "step 1 (decode, batch 3); request r1 token 8" in caplog.text


def test_each_step_of_a_contained_write_gets_the_cleaned_copy_and_the_batch_is_untouched(mp, guard, runner):
    guard("warn", backend="triton")
    pool = mha(mp)
    run = runner(pool)
    batch = decode_batch(torch.tensor([7, HIGH + 2, 8]))
    last_row = pool.k_buffer[0][HIGH - 1].clone()
    run.forward(batch)
    assert batch.out_cache_loc.tolist() == [7, HIGH + 2, 8]
    for layer in range(LAYERS):
        assert pool.k_buffer[layer][7].sum() == 8 and pool.k_buffer[layer][0].sum() == 8  # the bad token went to slot 0
    assert torch.equal(pool.k_buffer[0][HIGH - 1], last_row)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_contained_step_is_reported_once_not_once_per_layer(mp, guard, runner, backend):
    """The layers' writes of the step's ids get the step check's cleaned copy: one
    violating call per step, whichever path made the copy."""
    guard("warn", backend)
    run = runner(mha(mp))
    for _ in range(3):
        run.forward(decode_batch(torch.tensor([1, HIGH + 2, 3])))
    sglang_oobguard.check()
    (v,) = sglang_oobguard.violations()
    assert v.calls == 3


# -- the fused RoPE + KV store: a writer that no pool method sees ------------------

def rope_module():
    import importlib

    for name in ("sglang.kernels.ops.attention.rope", "sglang.jit_kernel.rope"):
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    pytest.skip("this sglang has no fused RoPE + KV store")


def fused_call(rope, loc, rows=HIGH):
    heads, dim, n = 2, 8, loc.numel()
    q, k, v = torch.randn(n, heads, dim), torch.randn(n, heads, dim), torch.randn(n, heads * dim)
    k_buffer, v_buffer = torch.zeros(rows, heads * dim), torch.zeros(rows, heads * dim)
    cos_sin = torch.randn(64, dim)
    args = rope.FusedSetKVBufferArg(value=v, k_buffer=k_buffer, v_buffer=v_buffer, cache_loc=loc)
    rope.apply_rope_with_cos_sin_cache_inplace(q, k, cos_sin, torch.arange(n), is_neox=True, fused_args=args)


@pytest.fixture
def fused_kernel(monkeypatch):
    """The fused RoPE + KV module with its CUDA kernel (a JIT build, no CPU one) replaced,
    under the guard's wrapper, by a test-only recorder of the arguments it would get."""
    rope = rope_module()
    reached: list[tuple] = []

    def recorder(*args, **kwargs):
        """Test-only: stands in for the CUDA kernel, which cannot run here; records its call."""
        reached.append(args)

    def make(guard, mode: str):
        guard(mode)
        monkeypatch.setattr(rope.__dict__["apply_rope_inplace_with_kvcache"], "__wrapped__", recorder)
        return rope, reached

    return make


@pytest.mark.parametrize("bad", [HIGH + 2, -1])
def test_fused_rope_kv_store_raises_before_the_kernel_in_strict(guard, fused_kernel, bad):
    rope, reached = fused_kernel(guard, "strict")
    with pytest.raises(KVOutOfBoundsError, match=rf"^apply_rope_inplace_with_kvcache \(fused RoPE \+ KV store\): "
                                                 rf"1 of 3 slot ids outside \[0, {HIGH}\): loc\[1\] = {bad}"):
        fused_call(rope, torch.tensor([3, bad, 5]))
    assert not reached
    fused_call(rope, torch.tensor([3, 4, 5]))
    assert len(reached) == 1  # a clean call goes on to the kernel


def test_fused_rope_kv_store_warn_contains_into_a_copy_and_logs(guard, fused_kernel, caplog):
    rope, reached = fused_kernel(guard, "warn")
    loc = torch.tensor([3, -1, 5])
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        fused_call(rope, loc)
    (args,) = reached
    assert args[7].tolist() == [3, 0, 5] and loc.tolist() == [3, -1, 5]
    assert "apply_rope_inplace_with_kvcache (fused RoPE + KV store): 1 of 3 slot ids outside [0, 65): loc[1] = -1" in caplog.text
