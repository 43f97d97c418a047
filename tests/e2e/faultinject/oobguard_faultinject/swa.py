"""Test-only: sglang's torch_native SWA reads translated, and the SWA allocator faults.

`OOBGUARD_SWA_READS=1` replaces one thing upstream gets wrong on the CPU: sglang's
torch_native backend (`layers/attention/torch_native_backend.py`,
`TorchNativeAttnBackend._run_sdpa_forward_decode` and `_run_sdpa_forward_extend`) reads
an SWA layer's K/V at `k_cache[req_to_token[...]]`, full-pool ids, from the SWA sub-pool's
buffer: once the full allocator hands out ids above the SWA sub-pool's rows it fails
(IndexError), and below that it silently reads other tokens' rows. sglang's intel_amx
backend translates these reads (`_swa_kv_indices`); this patch does the same for
torch_native's, through the pool's own `translate_loc_from_full_to_swa`, on SWA layers
only (those called with a sliding window). It changes reads, never a write, so the
guard sees exactly sglang's writes.

`OOBGUARD_FAULT=site=swa,step=N,value=double|handout|door|evict`, or a +-joined sequence of
them (one warn-mode run serves several: each AFTER decodes after the last, on other
requests and other SWA pages), on the first decode forward from the Nth on where a token
opens a page (so the page is its own request's alone):
- `double`: that token's page goes back to the SWA free list twice, through sglang's own
  `SWATokenToKVPoolAllocator.free_swa_segment` (an SWA page freed twice);
- `handout`: that token's live SWA page is put at the head of the SWA sub-allocator's free
  list behind every allocator method (as a tool the guard has never seen would), so the
  next allocation hands it to another request while the token's request still holds it;
- `evict`: the first page of that token's request (its oldest KV, a prefix the radix cache
  may share) goes back to the full sub-allocator's free list behind the SWA allocator (as an
  eviction under a running request would), the mapping left alone: no write names it, only
  the next step's read check (the full sub-pool's shadow) sees it read;
- `door`: for that one forward, token t's SWA id (torch_native's `swa_out_cache_loc`, the
  translation the backend computes per forward) is token t + 1's, another request's SWA
  slot, the mapping left alone (a stale or crossed translation).
"""

from __future__ import annotations

import os
import sys

import torch

_decodes = [0]
_done: list[tuple[int, str, int]] = []  # (decode, rid, SWA page) of each fault applied, once each per process
AFTER = 2  # double+handout: decodes between the two faults


def _translated(instance, args: tuple, kwargs: dict) -> tuple:
    """`_run_sdpa_forward_*`'s arguments with req_to_token (the 5th) mapped into SWA ids."""
    pool = instance.token_to_kv_pool
    if kwargs.get("sliding_window_size") is None or not getattr(instance, "use_sliding_window_kv_pool", False):
        return args
    table = args[4]
    return (*args[:4], pool.translate_loc_from_full_to_swa(table.clamp(min=0)), *args[5:])


def _read(wrapped, instance, args, kwargs):
    return wrapped(*_translated(instance, args, kwargs), **kwargs)


def patch_reads(module) -> None:
    import wrapt

    for name in ("_run_sdpa_forward_decode", "_run_sdpa_forward_extend"):
        wrapt.wrap_function_wrapper(module, f"TorchNativeAttnBackend.{name}", _read)


def fault(spec: dict[str, str], runner, batch) -> None:
    """Apply the SWA fault on the chosen decode forward, before it runs."""
    if batch.forward_mode.name.lower() != "decode" or batch.out_cache_loc is None or not batch.out_cache_loc.numel():
        return
    step = _decodes[0]
    _decodes[0] += 1
    allocator = runner.token_to_kv_pool_allocator
    page = int(allocator.page_size)
    values = spec["value"].split("+")
    rids = getattr(batch, "rids", None) or [None] * batch.out_cache_loc.numel()
    swa_ids = allocator.translate_loc_from_full_to_swa(batch.out_cache_loc).tolist()
    opens = [t for t in (batch.out_cache_loc % page == 0).nonzero().flatten().tolist()  # a page of its own request,
             if rids[t] not in {rid for _, rid, _ in _done} and swa_ids[t] // page not in {p for _, _, p in _done}]
    if len(_done) >= len(values) or not opens or step < (_done[-1][0] + AFTER if _done else int(spec["step"])):
        return  # (the second fault: on another request and another SWA page than the first's)
    value = values[len(_done)]
    if value == "door":
        _door_fault(step, rids, batch, allocator)
        return
    if value == "evict":
        _evict_fault(step, rids, batch, runner, allocator)
        return
    token = opens[0]
    full, swa = int(batch.out_cache_loc[token]), swa_ids[token]
    _done.append((step, rids[token], swa // page))
    print(f"oobguard_faultinject: swa {value} at decode {step}: token {token} (rid {rids[token]}) full slot {full}, "
          f"SWA slot {swa} (pid {os.getpid()})", file=sys.stderr, flush=True)
    if value == "double":
        base = full - full % page
        segment = torch.arange(base, base + page, dtype=batch.out_cache_loc.dtype)
        allocator.free_swa_segment(segment, start_pos=0)
        allocator.free_swa_segment(segment, start_pos=0)
    elif value == "handout":
        sub = allocator.swa_attn_allocator
        back = torch.tensor([swa // page], dtype=sub.free_pages.dtype)
        sub.free_pages = torch.cat([back, sub.free_pages])
    else:
        raise ValueError(f"OOBGUARD_FAULT: site=swa takes value=double, handout, door, evict or a +-joined "
                         f"sequence of them, not {value!r}")


def _evict_fault(step: int, rids: list, batch, runner, allocator) -> None:
    """evict: a request's first page freed in the full sub-allocator while it still reads it."""
    page = int(allocator.page_size)
    lens = batch.seq_lens_cpu.tolist()
    token = next((t for t, n in enumerate(lens) if n > 3 * page), None)
    if token is None:
        return
    row = int(batch.req_pool_indices[token])
    slots = runner.req_to_token_pool.req_to_token[row, :page].to(torch.int64).clone()
    _done.append((step, rids[token], -1))
    allocator.full_attn_allocator.free(slots)
    print(f"oobguard_faultinject: swa evict at decode {step}: token {token} (rid {rids[token]}) full slot "
          f"{int(slots[0])}, its first page freed (pid {os.getpid()})", file=sys.stderr, flush=True)


_door: list[int] = []  # the token whose SWA id the next init_forward_metadata crosses (door)


def _door_fault(step: int, rids: list, batch, allocator) -> None:
    """door: this forward, token t's SWA id is token t + 1's (another request's SWA slot), in
    the ids the attention backend translated for the forward; its mapping is left alone."""
    used = {rid for _, rid, _ in _done}
    token = next((t for t in range(len(rids) - 1) if rids[t] not in used and rids[t + 1] not in used), None)
    if token is None:
        return
    ids = allocator.translate_loc_from_full_to_swa(batch.out_cache_loc[token:token + 2]).tolist()
    _done.append((step, rids[token], -1))
    _door.append(token)
    print(f"oobguard_faultinject: swa door at decode {step}: token {token} (rid {rids[token]}) full slot "
          f"{int(batch.out_cache_loc[token])}, SWA slot {ids[1]} (pid {os.getpid()}; owner rid {rids[token + 1]})",
          file=sys.stderr, flush=True)


def _metadata(wrapped, instance, args, kwargs):
    result = wrapped(*args, **kwargs)
    if _door and getattr(instance, "swa_out_cache_loc", None) is not None:
        token = _door.pop()
        crossed = instance.swa_out_cache_loc.clone()
        crossed[token] = crossed[token + 1]
        instance.swa_out_cache_loc = crossed
    return result


def patch_metadata(module) -> None:
    """For value=door: the backend's per-forward SWA ids, crossed after it computes them."""
    import wrapt

    wrapt.wrap_function_wrapper(module, "TorchNativeAttnBackend.init_forward_metadata", _metadata)
