"""TEST-ONLY, pure-torch stand-ins for sgl_kernel's CPU attention ops,
`torch.ops.sgl_kernel.extend_attention_cpu` and `decode_attention_cpu`, which sglang
0.5.23's `intel_amx` attention backend calls (the backend its speculative decoding
needs on a CPU: torch_native has no target-verify path).

Registered as torch ops under sgl_kernel's namespace with the argument lists
IntelAMXAttnBackend passes. Each request attends over its req_to_token row, with
grouped KV heads, and (verify) the per-request [n, n] tree mask. Like the
real decode op, decode_attention_cpu writes the new K/V rows at `loc` itself: that
write never goes through a pool's set_kv_buffer. Raises NotImplementedError for what
it does not implement (FP8 scales, softcap, sliding window, sinks, cross or encoder
attention).
Put on PYTHONPATH for test processes only, never installed.
"""

from __future__ import annotations

from typing import Optional

import torch
from _standin import not_implemented


def _unsupported(op: str, key_scale: float, value_scale: float, logit_cap: float, is_cross_attention: bool,
                 window: int, sinks: Optional[torch.Tensor]) -> None:
    if key_scale != 1.0 or value_scale != 1.0:
        raise not_implemented(op, "scaled (FP8) KV")
    if logit_cap > 0 or is_cross_attention or window > 0 or sinks is not None:
        raise not_implemented(op, "softcap, cross attention, sliding windows or attention sinks")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sm_scale: float, causal: bool = False,
            visible: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [Lq, H, D] over k/v [Lk, Hkv, D] -> [Lq, H, Dv]. The same SDPA call as sglang's
    torch_native backend, query rows aligned to the last Lq keys, so a plain run on
    either backend gives the same tokens."""
    query = q.movedim(0, 1)
    if causal:  # a query row for every key, the real ones last (the others are never read)
        query = q.new_empty(q.shape[1], k.shape[0], q.shape[2])
        query[:, k.shape[0] - q.shape[0]:] = q.movedim(0, 1)
    k, v = (t.to(q.dtype).movedim(0, 1).unsqueeze(0) for t in (k, v))
    out = torch.nn.functional.scaled_dot_product_attention(query.unsqueeze(0), k, v, attn_mask=visible,
                                                           enable_gqa=q.shape[1] != k.shape[1], scale=sm_scale,
                                                           is_causal=causal)
    return out.squeeze(0).movedim(1, 0)[-q.shape[0]:]


@torch.library.custom_op("sgl_kernel::decode_attention_cpu", mutates_args=("k_buffer", "v_buffer", "o"))
def decode_attention_cpu(q: torch.Tensor, k_buffer: torch.Tensor, v_buffer: torch.Tensor, key_scale: float,
                         value_scale: float, o: torch.Tensor, k: Optional[torch.Tensor], v: Optional[torch.Tensor],
                         loc: torch.Tensor, attn_logits: torch.Tensor, req_to_token: torch.Tensor,
                         req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, sm_scale: float, logit_cap: float,
                         is_cross_attention: bool, window: int, encoder_lens: Optional[torch.Tensor],
                         sinks: Optional[torch.Tensor]) -> None:
    """One new token per request: store its K/V at loc (when given), then attend over
    req_to_token[req_pool_indices[i], :seq_lens[i]]."""
    _unsupported("decode_attention_cpu", key_scale, value_scale, logit_cap, is_cross_attention, window, sinks)
    if k is not None and v is not None:
        k_buffer[loc] = k.view(-1, *k_buffer.shape[1:]).to(k_buffer.dtype)
        v_buffer[loc] = v.view(-1, *v_buffer.shape[1:]).to(v_buffer.dtype)
    for i, (row, length) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        slots = req_to_token[row, :length].long()
        o[i] = _attend(q[i:i + 1], k_buffer[slots], v_buffer[slots], sm_scale)[0].to(o.dtype)


@torch.library.custom_op("sgl_kernel::extend_attention_cpu", mutates_args=("o",))
def extend_attention_cpu(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                         k_buffer: torch.Tensor, v_buffer: torch.Tensor, key_scale: float, value_scale: float,
                         req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                         extend_seq_lens: torch.Tensor, extend_start_loc: torch.Tensor, max_len_extend: int,
                         sm_scale: float, logit_cap: float, is_cross_attention: bool, window: int,
                         encoder_lens: Optional[torch.Tensor], sinks: Optional[torch.Tensor],
                         tree_mask: Optional[torch.Tensor], is_causal: bool) -> None:
    """Request i's extend tokens (q/k/v rows extend_start_loc[i] on) attend over its
    cached prefix, read from the pool through req_to_token, and over its own extend
    tokens: causally, or by its [n, n] block of tree_mask when one is given."""
    _unsupported("extend_attention_cpu", key_scale, value_scale, logit_cap, is_cross_attention, window, sinks)
    if not is_causal:
        raise not_implemented("extend_attention_cpu", "non-causal (encoder) attention")
    rows, totals = req_pool_indices.tolist(), seq_lens.tolist()
    for i, (start, length) in enumerate(zip(extend_start_loc.tolist(), extend_seq_lens.tolist())):
        prefix = req_to_token[rows[i], :totals[i] - length].long()
        keys = torch.cat([k_buffer[prefix], k[start:start + length].to(k_buffer.dtype)])
        values = torch.cat([v_buffer[prefix], v[start:start + length].to(v_buffer.dtype)])
        visible = None
        if tree_mask is not None:  # the prefix, then this request's [n, n] block
            visible = torch.cat([torch.ones(length, len(prefix), dtype=torch.bool),
                                 tree_mask.view(-1, length, length)[i].bool()], dim=1)
        o[start:start + length] = _attend(q[start:start + length], keys, values, sm_scale,
                                          causal=tree_mask is None, visible=visible).to(o.dtype)
