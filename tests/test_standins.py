"""The test-only sgl_kernel stand-ins that speculative decoding needs on the CPU
engine (tests/standins/sgl_kernel), each against a reference on small inputs:
sglang 0.5.23's own Triton twin of the op (run here in Triton's interpreter) where
sglang has one, otherwise plain torch. And each raises for what it does not implement.

The stand-ins are loaded by file, not as `sgl_kernel`: this process must not see a
package of that name (sglang changes paths when it imports)."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from helpers import ROOT, needs

try:  # the older releases of the matrix have no sglang.kernels at all
    _SPECULATIVE = importlib.util.find_spec("sglang.kernels.ops.speculative")
except ModuleNotFoundError:
    _SPECULATIVE = None
if _SPECULATIVE is None:
    pytest.skip("the stand-ins follow sglang 0.5.23's speculative CPU ops (sglang.kernels.ops.speculative)",
                allow_module_level=True)

STANDINS = ROOT / "tests" / "standins"


def _load(name: str, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def ops():
    """spec_ops, attention_ops and speculative, as modules of their own."""
    if "_standin" not in sys.modules:
        _load("_standin", STANDINS / "_standin.py")
    return {name: sys.modules.get(f"oobguard_standin_{name}") or
            _load(f"oobguard_standin_{name}", STANDINS / "sgl_kernel" / f"{name}.py")
            for name in ("spec_ops", "attention_ops", "speculative")}


def _table(rows: int = 4, width: int = 16) -> torch.Tensor:
    """A req_to_token table with distinct slot ids."""
    return (torch.arange(rows * width, dtype=torch.int32).view(rows, width) * 7 + 3) % 1000


RPI = torch.tensor([2, 0, 3], dtype=torch.int64)


def test_assign_req_to_token_pool_matches_sglangs_triton_kernel(ops):
    needs("assign_req_to_token_pool")
    from sglang.srt.mem_cache.allocation import assign_req_to_token_pool

    starts, ends = torch.tensor([3, 0, 5], dtype=torch.int32), torch.tensor([6, 2, 9], dtype=torch.int32)
    out_cache_loc = torch.arange(100, 109, dtype=torch.int64)
    ours, theirs = _table(), _table()
    ops["spec_ops"].assign_req_to_token_pool_cpu(RPI, ours, starts, ends, out_cache_loc, 16)
    assign_req_to_token_pool[(3,)](RPI, theirs, starts, ends, out_cache_loc, 16, 4)
    assert torch.equal(ours, theirs) and not torch.equal(ours, _table())


def test_assign_extend_cache_locs_matches_sglangs_triton_kernel(ops):
    needs("assign_extend_cache_locs")
    from sglang.kernels.ops.speculative.cache_locs import assign_extend_cache_locs

    starts, ends = torch.tensor([3, 0, 5]), torch.tensor([6, 2, 9])
    ours, theirs = torch.full((9,), -1, dtype=torch.int64), torch.full((9,), -1, dtype=torch.int64)
    ops["spec_ops"].assign_extend_cache_locs_cpu(RPI, _table(), starts, ends, ours, 16)
    assign_extend_cache_locs[(3,)](RPI, _table(), starts, ends, theirs, 16, 4)
    assert torch.equal(ours, theirs) and (ours >= 0).all()


def test_assign_draft_cache_locs_contiguous_matches_sglangs_triton_kernel(ops):
    needs("assign_draft_cache_locs_contiguous")
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous

    seq_lens = torch.tensor([4, 1, 7])
    ours, theirs = torch.full((6,), -1, dtype=torch.int64), torch.full((6,), -1, dtype=torch.int64)
    ops["spec_ops"].assign_draft_cache_locs_contiguous_cpu(RPI, _table(), seq_lens, ours, 16, 1, 2)
    assign_draft_cache_locs_contiguous[(3,)](RPI, _table(), seq_lens, theirs, 16, 1, 2)
    assert torch.equal(ours, theirs) and (ours >= 0).all()


def test_fill_bonus_tokens_matches_sglangs_triton_kernel(ops):
    needs("fill_bonus_tokens")
    from sglang.kernels.ops.speculative.eagle import fill_bonus_tokens

    accept_tokens = torch.arange(12, dtype=torch.int32).view(3, 4) + 50
    accept_lens = torch.tensor([1, 4, 2], dtype=torch.int32)
    ours, theirs = torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    ops["spec_ops"].fill_bonus_tokens_cpu(accept_tokens, accept_lens, ours, 4)
    fill_bonus_tokens[(3,)](accept_tokens, accept_lens, theirs, 4)
    assert ours.tolist() == theirs.tolist() == [50, 57, 59]


def test_fill_accept_out_cache_loc_matches_sglangs_triton_kernel(ops):
    needs("fill_accept_out_cache_loc")
    from sglang.kernels.ops.speculative.eagle import fill_accept_out_cache_loc

    accept_index = torch.tensor([[0, 2, -1], [3, -1, -1], [6, 7, 8]], dtype=torch.int32)
    out_cache_loc = torch.arange(9, dtype=torch.int64) * 10 + 5
    ours, theirs = torch.full((6,), -1, dtype=torch.int64), torch.full((6,), -1, dtype=torch.int64)
    ops["spec_ops"].fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, ours)
    fill_accept_out_cache_loc[(9,)](accept_index, out_cache_loc, theirs, 16)
    assert ours.tolist() == theirs.tolist() == [5, 25, 35, 65, 75, 85]


# Draft trees as EAGLE's organize_draft_results hands them over (parents of each step's
# candidates, the sorted selected score indices). topk 1: a chain of 2 drafts. topk 2,
# 2 steps: root -> {1, 2}, 1 -> 3, 2 -> 4.
TREES = {1: (torch.tensor([[-1, 0]]), torch.tensor([[0, 1]]), 2, 3),
         2: (torch.tensor([[-1, 0, 1]]), torch.tensor([[0, 1, 2, 5]]), 2, 5)}


def _tree_outputs(n: int, bs: int) -> list[torch.Tensor]:
    """tree_mask (QLEN_ONLY), positions, retrieve_index / next_token / next_sibling."""
    return [torch.zeros(bs * n * n, dtype=torch.bool), torch.zeros(bs * n, dtype=torch.int64),
            *(torch.full((bs, n), -1, dtype=torch.int64) for _ in range(3))]


def _build_tree(build, topk: int, seq_lens: torch.Tensor) -> list[torch.Tensor]:
    needs("TreeMaskMode")
    from sglang.kernels.ops.speculative.spec_tree import TreeMaskMode

    parents, selected, depth, n = TREES[topk]
    bs = len(seq_lens)
    outputs = _tree_outputs(n, bs)
    build(parents.repeat(bs, 1), selected.repeat(bs, 1), seq_lens, *outputs, topk, depth, n, TreeMaskMode.QLEN_ONLY)
    return outputs


@pytest.mark.parametrize("topk", [1, 2])
def test_build_tree_qlen_only_matches_sglangs_triton_kernel(ops, topk):
    needs("sgl_build_tree_kernel_triton")
    from sglang.kernels.ops.speculative.spec_tree import sgl_build_tree_kernel_triton

    seq_lens = torch.tensor([5, 9])
    ours = _build_tree(ops["spec_ops"].build_tree_kernel_efficient_cpu, topk, seq_lens)
    theirs = _build_tree(sgl_build_tree_kernel_triton, topk, seq_lens)
    for mine, upstream in zip(ours, theirs):
        assert torch.equal(mine, upstream), (mine, upstream)
    if topk == 2:  # the tree above: depth 1, 1, 2, 2 below the root; root's first child is 1
        assert ours[1].tolist()[:5] == [5, 6, 6, 7, 7] and ours[3][0, 0] == 1


def test_verify_tree_greedy_matches_sglangs_triton_kernel(ops):
    needs("verify_tree_greedy_triton")
    from sglang.kernels.ops.speculative.spec_tree import verify_tree_greedy_triton

    _, _, index, next_token, next_sibling = _build_tree(ops["spec_ops"].build_tree_kernel_efficient_cpu, 2,
                                                        torch.tensor([5, 9]))
    candidates = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    # request 0: the target agrees with draft node 2, then node 4; request 1: with nothing
    target = torch.tensor([[12, 0, 14, 0, 0], [99, 0, 0, 0, 0]])
    results = []
    for verify in (ops["spec_ops"].verify_tree_greedy_cpu, verify_tree_greedy_triton):
        predicts, accept_index = torch.zeros(10, dtype=torch.int32), torch.full((2, 3), -1, dtype=torch.int32)
        accept_num = torch.zeros(2, dtype=torch.int32)
        verify(predicts, accept_index, accept_num, candidates, index, next_token, next_sibling, target)
        results.append((predicts.tolist(), accept_index.tolist(), accept_num.tolist()))
    assert results[0] == results[1]
    assert results[0][1] == [[0, 2, 4], [5, -1, -1]] and results[0][2] == [2, 0]


def test_build_draft_decode_metadata_topk_1_is_each_requests_own_row(ops):
    table, seq_lens = _table(), torch.tensor([4, 1, 7])
    rows = ops["spec_ops"].build_draft_decode_metadata_cpu(table, RPI, seq_lens, 1, 2, 16)
    for b, (row, length) in enumerate(zip(RPI.tolist(), seq_lens.tolist())):
        assert torch.equal(rows[b, :length + 2], table[row, :length + 2])  # prefix, then the 2 draft slots


def test_reconstruct_indices_from_tree_mask_matches_sglangs_triton_kernel(ops, monkeypatch):
    # the twin's module imports the compiled op by name, on any device but XPU: give it ours
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    monkeypatch.setitem(sys.modules, "sgl_kernel.speculative", ops["speculative"])
    needs("reconstruct_indices_from_tree_mask_triton")
    from sglang.kernels.ops.speculative.reconstruct_tree import reconstruct_indices_from_tree_mask_triton

    # NGRAM's trees, mask[i, j]: j is i or an ancestor of i. 0 -> {1, 2}, 1 -> 3; and a chain
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]], dtype=torch.bool)
    mask = torch.stack([tree, torch.ones(4, 4, dtype=torch.bool).tril()]).flatten()
    seq_lens = torch.tensor([3, 8])
    results = []
    for reconstruct in (ops["speculative"].reconstruct_indices_from_tree_mask,
                        reconstruct_indices_from_tree_mask_triton):
        outputs = [torch.full((8,), -7, dtype=torch.int64) for _ in range(4)]
        reconstruct(mask, seq_lens, *outputs, 2, 4)
        results.append([out.tolist() for out in outputs])
    assert results[0] == results[1]
    positions, _, next_token, next_sibling = results[0]
    assert positions[:4] == [3, 4, 4, 5] and next_token[:4] == [1, 3, -1, -1] and next_sibling[:4] == [-1, 2, -1, -1]


def test_copy_all_layer_kv_cache_moves_rows_in_every_buffer_sources_first(ops):
    buffers = [torch.arange(40, dtype=torch.float32).view(10, 4) + 100 * i for i in range(3)]
    buffers.append(torch.arange(30, dtype=torch.bfloat16).view(10, 3))
    expected = [b.clone() for b in buffers]
    tgt, src = torch.tensor([1, 2, 7]), torch.tensor([2, 1, 9])  # 1 <-> 2 swap: overlapping targets and sources
    for b in expected:
        b[tgt] = b[src].clone()
    ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    ops["spec_ops"].copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for got, want in zip(buffers, expected):
        assert torch.equal(got, want)


def _softmax_attention(q, k, v, scale, visible=None):
    """Plain torch, written out: softmax(q k^T * scale, masked) v, KV heads repeated for GQA."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


HEADS, KV_HEADS, DIM, SLOTS = 4, 2, 8, 64


def _pool():
    torch.manual_seed(0)
    return torch.randn(SLOTS, KV_HEADS, DIM), torch.randn(SLOTS, KV_HEADS, DIM)


def test_decode_attention_writes_the_new_kv_at_loc_then_attends_over_the_row(ops):
    k_buffer, v_buffer = _pool()
    table = torch.randperm(SLOTS)[:48].view(3, 16).int()
    rpi, seq_lens = torch.tensor([1, 2]), torch.tensor([5, 9])
    loc = torch.stack([table[1, 4], table[2, 8]]).long()  # each request's newest slot
    q, k, v = torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    o = torch.empty(2, HEADS, DIM)
    ops["attention_ops"].decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, o, k, v, loc,
                                              torch.zeros(2, HEADS, 8, DIM + 1), table, rpi, seq_lens, 0.3, 0.0,
                                              False, 0, None, None)
    assert torch.equal(k_buffer[loc], k) and torch.equal(v_buffer[loc], v)
    for i, (row, length) in enumerate(zip(rpi.tolist(), seq_lens.tolist())):
        slots = table[row, :length].long()
        want = _softmax_attention(q[i:i + 1], k_buffer[slots], v_buffer[slots], 0.3, None)
        torch.testing.assert_close(o[i:i + 1], want)


@pytest.mark.parametrize("tree", [False, True])
def test_extend_attention_over_prefix_and_extend_causal_or_by_tree_mask(ops, tree):
    k_buffer, v_buffer = _pool()
    table = torch.randperm(SLOTS)[:48].view(3, 16).int()
    rpi, extend_lens = torch.tensor([2, 0]), torch.tensor([3, 3])
    seq_lens, starts = torch.tensor([7, 3]), torch.tensor([0, 3])  # request 0 has a 4-token prefix, request 1 none
    q, k, v = torch.randn(6, HEADS, DIM), torch.randn(6, KV_HEADS, DIM), torch.randn(6, KV_HEADS, DIM)
    own = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # NGRAM-like: 0 -> {1, 2}
    mask = own.repeat(2, 1).flatten() if tree else None
    o = torch.empty(6, HEADS, DIM)
    ops["attention_ops"].extend_attention_cpu(q, k, v, o, k_buffer, v_buffer, 1.0, 1.0, table, rpi, seq_lens,
                                              extend_lens, starts, 3, 0.3, 0.0, False, 0, None, None, mask, True)
    for i in range(2):
        prefix = table[rpi[i], :seq_lens[i] - 3].long()
        rows = slice(3 * i, 3 * i + 3)
        keys, values = torch.cat([k_buffer[prefix], k[rows]]), torch.cat([v_buffer[prefix], v[rows]])
        visible = torch.cat([torch.ones(3, len(prefix), dtype=torch.bool),
                             own if tree else torch.ones(3, 3, dtype=torch.bool).tril()], dim=1)
        torch.testing.assert_close(o[rows], _softmax_attention(q[rows], keys, values, 0.3, visible))


def test_each_stand_in_raises_for_a_mode_it_does_not_implement(ops):
    spec, attention = ops["spec_ops"], ops["attention_ops"]
    with pytest.raises(NotImplementedError, match="EAGLE topk 2"):
        spec.build_draft_decode_metadata_cpu(_table(), RPI, torch.tensor([1, 1, 1]), 2, 2, 16)
    with pytest.raises(NotImplementedError, match="tree_mask_mode 0"):
        spec.build_tree_kernel_efficient_cpu(*TREES[1][:2], torch.tensor([5]), *_tree_outputs(3, 1), 1, 2, 3, 0)
    k_buffer, v_buffer = _pool()
    q, o = torch.randn(1, HEADS, DIM), torch.empty(1, HEADS, DIM)
    args = (torch.zeros(1, HEADS, 8, DIM + 1), _table(1).clamp(max=SLOTS - 1), torch.tensor([0]), torch.tensor([4]))
    with pytest.raises(NotImplementedError, match="sliding windows"):
        attention.decode_attention_cpu(q, k_buffer, v_buffer, 1.0, 1.0, o, None, None, torch.tensor([0]), *args,
                                       0.3, 0.0, False, 4097, None, None)
    with pytest.raises(NotImplementedError, match="FP8"):
        attention.decode_attention_cpu(q, k_buffer, v_buffer, 0.5, 1.0, o, None, None, torch.tensor([0]), *args,
                                       0.3, 0.0, False, 0, None, None)
    with pytest.raises(NotImplementedError, match="non-causal"):
        attention.extend_attention_cpu(q, q[:, :KV_HEADS], q[:, :KV_HEADS], o, k_buffer, v_buffer, 1.0, 1.0,
                                       *args[1:], torch.tensor([1]), torch.tensor([0]), 1, 0.3, 0.0, False, 0, None,
                                       None, None, False)
