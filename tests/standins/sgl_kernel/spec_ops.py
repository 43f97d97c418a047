"""TEST-ONLY, pure-torch stand-ins for the CPU index ops of sgl_kernel that sglang
0.5.23's speculative decoding calls (EAGLE, NGRAM): slot-id bookkeeping between
req_to_token and out_cache_loc, the draft tree, and the all-layer KV move.

No sgl_kernel build runs on these CPU machines; these follow the C++ kernels of
sgl-kernel/csrc/cpu/spec.cpp and kvcache.cpp one for one (tests/test_standins.py
checks each against sglang's own Triton twin or a plain-torch reference). Each raises
NotImplementedError for a mode it does not implement. Put on PYTHONPATH for test
processes only, never installed; slow by design (per-request loops on the host).
"""

from __future__ import annotations

import ctypes
from typing import Iterator

import torch
from _standin import not_implemented

QLEN_ONLY = 1  # sglang's TreeMaskMode.QLEN_ONLY: one [n, n] mask per request


def _segments(starts: torch.Tensor, ends: torch.Tensor) -> Iterator[tuple[int, int, int, int]]:
    """(request i, start, end, offset of its first id in the packed out_cache_loc)."""
    offset = 0
    for i, (start, end) in enumerate(zip(starts.tolist(), ends.tolist())):
        yield i, start, end, offset
        offset += end - start


def assign_req_to_token_pool_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """req_to_token[rpi[i], start[i]:end[i]] = the i-th segment of out_cache_loc."""
    rows = req_pool_indices.tolist()
    for i, start, end, offset in _segments(start_offset, end_offset):
        req_to_token[rows[i], start:end] = out_cache_loc[offset:offset + end - start].to(req_to_token.dtype)


def assign_extend_cache_locs_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                 start_offset: torch.Tensor, end_offset: torch.Tensor,
                                 out_cache_loc: torch.Tensor, pool_len: int) -> None:
    """The reverse: the i-th segment of out_cache_loc = req_to_token[rpi[i], start[i]:end[i]]."""
    rows = req_pool_indices.tolist()
    for i, start, end, offset in _segments(start_offset, end_offset):
        out_cache_loc[offset:offset + end - start] = req_to_token[rows[i], start:end]


def assign_draft_cache_locs_contiguous_cpu(req_pool_indices: torch.Tensor, req_to_token: torch.Tensor,
                                           seq_lens: torch.Tensor, out_cache_loc: torch.Tensor, pool_len: int,
                                           topk: int, num_steps: int) -> None:
    """Request i's topk * num_steps draft slots, from seq_lens[i] on, packed in order."""
    width = topk * num_steps
    assign_extend_cache_locs_cpu(req_pool_indices, req_to_token, seq_lens, seq_lens + width, out_cache_loc, pool_len)


def build_draft_decode_metadata_cpu(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
                                    seq_lens: torch.Tensor, topk: int, num_steps: int,
                                    pool_len: int) -> torch.Tensor:
    """The req_to_token rows the draft decode steps read: with topk 1, each request's
    own row (its prefix, then its draft slots in order)."""
    if topk != 1:
        raise not_implemented("build_draft_decode_metadata_cpu", f"EAGLE topk {topk} (only topk 1)")
    return req_to_token[req_pool_indices.long()].clone()


def fill_bonus_tokens_cpu(accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor,
                          accept_stride: int) -> None:
    """bonus[i] = the last accepted token of request i."""
    rows = torch.arange(accept_lens.numel())
    bonus_tokens.copy_(accept_tokens.reshape(-1)[rows * accept_stride + accept_lens.long() - 1])


def fill_accept_out_cache_loc_cpu(accept_index: torch.Tensor, out_cache_loc: torch.Tensor,
                                  accept_out_cache_loc: torch.Tensor) -> None:
    """The slots of the accepted drafts, packed in order: out_cache_loc[i] for every
    accept_index entry i that is not -1."""
    accepted = accept_index.reshape(-1)
    accepted = accepted[accepted > -1].long()
    accept_out_cache_loc[:accepted.numel()] = out_cache_loc[accepted]


def build_tree_kernel_efficient_cpu(parent_list: torch.Tensor, selected_index: torch.Tensor,
                                    verified_seq_len: torch.Tensor, tree_mask: torch.Tensor,
                                    positions: torch.Tensor, retrieve_index: torch.Tensor,
                                    retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                    topk: int, depth: int, draft_token_num: int, tree_mask_mode: int) -> None:
    """EAGLE's draft tree from the draft steps' parents and the selected tokens: the
    retrieve_* links (first child, next sibling; pre-filled with -1 by the caller), each
    node's position, and its QLEN_ONLY mask row (the root and its ancestors)."""
    if int(tree_mask_mode) != QLEN_ONLY:
        raise not_implemented("build_tree_kernel_efficient_cpu", f"tree_mask_mode {int(tree_mask_mode)} "
                               "(only QLEN_ONLY, the mode sglang uses on a CPU)")
    n = draft_token_num
    parents, selected, seq_lens = parent_list.tolist(), selected_index.tolist(), verified_seq_len.tolist()
    mask = tree_mask.view(-1, n, n)
    for b, seq_len in enumerate(seq_lens):
        sel, par, off = selected[b], parents[b], b * n

        def parent_of(node: int) -> int:  # node >= 1 -> its parent's node index (0 = root); n if not selected
            token = sel[node - 1] // topk
            return 0 if token == 0 else next((j + 1 for j in range(n - 1) if sel[j] == par[token]), n)

        positions[off] = seq_len
        retrieve_index[b, 0] = off
        for i in range(n - 1, 0, -1):
            retrieve_index[b, i] = off + i
            parent = parent_of(i)
            if parent == n:
                continue
            if retrieve_next_token[b, parent] != -1:
                retrieve_next_sibling[b, i] = retrieve_next_token[b, parent]
            retrieve_next_token[b, parent] = i
        mask[b] = False
        mask[b, :, 0] = True
        for tid in range(1, n):
            node, depth_of = tid, 0
            while node not in (0, n):
                mask[b, tid, node] = True
                depth_of += 1
                node = parent_of(node)
            positions[off + tid] = seq_len + depth_of


def verify_tree_greedy_cpu(predicts: torch.Tensor, accept_index: torch.Tensor, accept_token_num: torch.Tensor,
                           candidates: torch.Tensor, retrive_index: torch.Tensor,
                           retrive_next_token: torch.Tensor, retrive_next_sibling: torch.Tensor,
                           target_predict: torch.Tensor) -> None:
    """Greedy verification: follow the tree from the root, at each level accept the
    child whose draft token is the target's prediction; predicts holds the target's
    token at every accepted node, accept_index their flat ids."""
    cand, index = candidates.tolist(), retrive_index.tolist()
    next_token, next_sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    target = target_predict.reshape(-1).tolist()
    for b in range(len(cand)):
        last = index[b][0]
        accept_index[b, 0] = last
        accepted, node = 0, 0
        for _ in range(1, accept_index.shape[1]):
            node = next_token[b][node]
            while node != -1 and cand[b][node] != target[last]:
                node = next_sibling[b][node]
            if node == -1:
                break
            predicts[last] = target[last]
            accepted += 1
            last = index[b][node]
            accept_index[b, accepted] = last
        accept_token_num[b] = accepted
        predicts[last] = target[last]


def copy_all_layer_kv_cache_cpu(data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor,
                                src_loc: torch.Tensor) -> None:
    """move_kv_cache's copy: in every K/V buffer (given by base address and row bytes),
    row tgt_loc[i] = row src_loc[i], all sources read before any target is written.
    Like the C++ kernel it trusts the ids: bounds are the caller's (and the guard's) job."""
    if tgt_loc.numel() == 0:
        return
    rows = int(torch.maximum(tgt_loc.max(), src_loc.max())) + 1
    for address, row_bytes in zip(data_ptrs.tolist(), strides.tolist()):
        raw = (ctypes.c_uint8 * (rows * row_bytes)).from_address(address)
        buffer = torch.frombuffer(raw, dtype=torch.uint8).view(rows, row_bytes)
        buffer[tgt_loc.long()] = buffer[src_loc.long()]  # the gather copies first
