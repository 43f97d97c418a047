"""Test-only sglang plugin: a stale slot id, injected where a real bug would put it,
and a tally of the KV writes, moves and frees the engine made.

Loaded by sglang's own `load_plugins()` like any plugin. With none of the variables
below set (OOBGUARD_FAULT, OOBGUARD_COUNT; OOBGUARD_TRANSFER, OOBGUARD_HICACHE_SHIM,
OOBGUARD_HICACHE_FAULT at the end; OOBGUARD_PD_SHIM: tests/pd_shim.py; OOBGUARD_POSITIONS:
`oobguard_faultinject.positions`) it does nothing.

`OOBGUARD_FAULT=step=3,token=1,value=high+3` (step may be a range, `3-6`; value
`high+K` means the pool's size + page_size + K, or a literal such as `-1`) wraps
`ModelRunner.forward`, counts the forwards that write KV, and on each chosen one
replaces `out_cache_loc[token]` in a clone handed to that forward only: the
allocator and req_to_token keep the true slot, as with a real stale id between the
allocator and the attention backend's write. Optional selectors narrow what is
counted: `forward=target_verify` (a ForwardMode name, lower case), `runner=draft`
or `runner=target` (EAGLE's two model runners), `rank=1` (one tensor-parallel rank).

`value=freed` injects the other kind of stale id: on the chosen forward it gives
`out_cache_loc[token]` back to the allocator (`token_to_kv_pool_allocator.free`)
while its request still runs, then lets the forward write there: a use after free.

`value=cross` (three requests, decode): token 0's `out_cache_loc` gets the slot that
holds the first token (position 0) of the next running request (token 1's request),
read from req_to_token. `value=dup`: token 1 gets token 0's slot. `value=twin`: as
cross, and the faulted request's req_to_token entry is rewritten to match before the
forward and restored after it, so the tables agree (one slot held by two running
requests) while sglang's own books (frees, its leak check) stay balanced.

`value=nan,layer=L` (SGLANG_OOBGUARD_FINITE's fault): on the chosen forward, the K that
layer L's attention (`RadixAttention.forward`) hands on for `token` gets a NaN in its
first element (head 0), as an overflow upstream of the KV write would leave it; the
out_cache_loc is left as it is. That token's K/V write at layer L carries the NaN.

`value=evict` (decode): after the chosen forward, the first EVICTED slots of token's
request (its prompt's, read at every step) are given back to the allocator
(`token_to_kv_pool_allocator.free`, as an eviction under a running request would)
and put near the head of its free list, after token + 1 other slots, so the next
decode step's allocations (one slot per request, in batch order) hand them to the
requests after it while the faulted one still reads them.

`site=move` counts `move_kv_cache` calls instead (speculative decoding's move of the
accepted tokens' KV) and, on the chosen one, frees `tgt_loc[token]` first
(`value=freed` is the only value there): a move into a slot already given back. Its
wrapper goes on at the first forward, outside the guard's.

`site=swa` (sliding-window models) and `OOBGUARD_SWA_READS=1`, the test-only patch of
torch_native's SWA reads: see `oobguard_faultinject.swa`. `site=leak` (a release run twice, a
release that frees nothing, a row freed under its request): see `oobguard_faultinject.leaks`.

`OOBGUARD_COUNT=DIR`: at each counted call, each process writes DIR/<pid>.json with
its tensor-parallel rank and the calls so far of `MHATokenToKVPool.set_kv_buffer`
(writes), `MHATokenToKVPool.move_kv_cache` (moves) and
`TokenToKVPoolAllocator.free` with ids (frees), the methods the guard wraps with
liveness on (with the guard active, every call counted went through its wrapper), the
guard's own write probes (`sglang_oobguard.probes.hostscan.scan_host` and `kernels.launch`: probes) and
the forwards that write KV (steps).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from . import leaks, outermost, positions, swa

_count = 0
_moves = 0
_tally = {"writes": 0, "moves": 0, "frees": 0, "probes": 0, "steps": 0}
_rank = {"rank": None}
_allocators: dict[int, object] = {}  # id(KV pool) -> its model runner's allocator
_move_wrapped = []
_poison: list[tuple[int, int]] = []  # value=nan: (layer, token) while the chosen forward runs
_outer: list[bool] = []  # `_forward` is on, outermost


def _spec() -> dict[str, str]:
    return dict(part.split("=", 1) for part in os.environ.get("OOBGUARD_FAULT", "").split(",") if part)


def _steps(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def _tp_rank(runner) -> int:
    """The runner's tensor-parallel rank (0.5.2x keeps it in the runtime context)."""
    if hasattr(runner, "tp_rank"):
        return runner.tp_rank
    from sglang.srt.runtime_context import get_parallel

    return get_parallel().tp_rank


def _selected(spec: dict[str, str], runner, batch) -> bool:
    """Whether this forward is one the fault's selectors count."""
    if "rank" in spec and int(spec["rank"]) != _tp_rank(runner):
        return False
    if "runner" in spec and spec["runner"] != ("draft" if runner.is_draft_worker else "target"):
        return False
    return "forward" not in spec or batch.forward_mode.name.lower() == spec["forward"]


def _whose(batch, token: int) -> str:
    """The request a decode token belongs to, as the test reads it back from the report."""
    rids = getattr(batch, "rids", None)
    mode = batch.forward_mode.name.lower()
    seq_lens = getattr(batch, "seq_lens_cpu", None)
    index = int(seq_lens[token]) - 1 if mode == "decode" and seq_lens is not None else None
    return f"mode {mode} rid {rids[token] if rids else None} token {index}"


def _free_one(allocator, loc, token: int, what: str, step: int) -> None:
    allocator.free(loc[token:token + 1].clone())
    print(f"oobguard_faultinject: step {step} token {token} of {loc.numel()}: {what} {int(loc[token])} freed "
          f"(pid {os.getpid()})", file=sys.stderr, flush=True)


def _forward(wrapped, instance, args, kwargs):
    global _count
    batch = args[0] if args else kwargs["forward_batch"]
    loc = getattr(batch, "out_cache_loc", None)
    spec = _spec()
    if spec.get("site") == "swa":
        swa.fault(spec, instance, batch)
    if "step" in spec and spec.get("site", "write") == "write" and loc is not None and loc.numel() \
            and _selected(spec, instance, batch):
        token = int(spec["token"])
        if _count in _steps(spec["step"]) and token < loc.numel():
            raw = spec["value"]
            if raw == "freed":
                _free_one(instance.token_to_kv_pool_allocator, loc, token, "out_cache_loc", _count)
            elif raw == "nan":
                return _nan_fault(wrapped, instance, args, kwargs, batch, loc, token, int(spec["layer"]))
            elif raw == "evict":
                _count += 1
                _tally["steps"] += 1
                try:
                    return wrapped(*args, **kwargs)
                finally:
                    _evict(instance, batch, token, _count - 1)
            elif raw in ("cross", "dup", "twin"):
                return _ownership_fault(wrapped, instance, args, kwargs, batch, loc, token, raw)
            else:
                pool = instance.token_to_kv_pool
                value = pool.size + pool.page_size + int(raw[5:]) if raw.startswith("high+") else int(raw)
                bad = loc.clone()
                before = int(bad[token])
                bad[token] = value
                batch.out_cache_loc = bad
                print(f"oobguard_faultinject: step {_count} token {token} of {loc.numel()}: out_cache_loc {before} -> "
                      f"{value} (pid {os.getpid()}; {_whose(batch, token)})", file=sys.stderr, flush=True)
        _count += 1
    if loc is not None and loc.numel():
        _tally["steps"] += 1
    _rank["rank"] = _tp_rank(instance)
    _allocators[id(instance.token_to_kv_pool)] = instance.token_to_kv_pool_allocator
    if spec.get("site") == "move" and not _move_wrapped:
        # wrapped now, over the guard's wrapper (installed when the process started), so
        # the slot is given back before the guard looks at the move
        import wrapt

        wrapt.wrap_function_wrapper("sglang.srt.mem_cache.memory_pool", "MHATokenToKVPool.move_kv_cache", _move)
        _move_wrapped.append(True)
    return wrapped(*args, **kwargs)


def _nan_fault(wrapped, instance, args, kwargs, batch, loc, token: int, layer: int):
    """value=nan on this forward: layer `layer`'s K of `token` becomes NaN (`_attention`)."""
    global _count
    print(f"oobguard_faultinject: step {_count} token {token} of {loc.numel()}: K at layer {layer} -> nan, slot "
          f"{int(loc[token])} (pid {os.getpid()}; {_whose(batch, token)})", file=sys.stderr, flush=True)
    _count += 1
    _tally["steps"] += 1
    _poison.append((layer, token))
    try:
        return wrapped(*args, **kwargs)
    finally:
        _poison.clear()


def _attention(wrapped, instance, args, kwargs):
    """RadixAttention.forward(q, k, v, forward_batch, ...): while `_poison` names this
    layer, the K it writes carries a NaN at the token's first element (a copy: the
    model's own tensor is left alone)."""
    if _poison and _poison[0][0] == instance.layer_id and len(args) > 1 and args[1] is not None:
        token = _poison[0][1]
        k = args[1].clone()
        k.view(k.shape[0], -1)[token, 0] = float("nan")
        args = (args[0], k, *args[2:])
    return wrapped(*args, **kwargs)


EVICTED = 4


def _evict(runner, batch, token: int, step: int) -> None:
    """value=evict: give back the first slots of token's request and hand them out next."""
    import torch

    allocator = runner.token_to_kv_pool_allocator
    row = int(batch.req_pool_indices[token])
    slots = runner.req_to_token_pool.req_to_token[row, :EVICTED].to(torch.int64).clone()
    allocator.free(slots)
    if allocator.need_sort:
        allocator.merge_and_sort_free()
    first = torch.isin(allocator.free_pages, slots)
    others = allocator.free_pages[~first]
    allocator.free_pages = torch.cat((others[:token + 1], allocator.free_pages[first], others[token + 1:]))
    print(f"oobguard_faultinject: step {step} token {token}: evicted {slots.tolist()} of request "
          f"{batch.rids[token]} (pid {os.getpid()})", file=sys.stderr, flush=True)


def _ownership_fault(wrapped, instance, args, kwargs, batch, loc, token: int, raw: str):
    """cross / dup / twin on this forward (a decode: token i is request i's new token)."""
    global _count
    table = instance.req_to_token_pool.req_to_token
    rows = batch.req_pool_indices
    bad = loc.clone()
    before = int(bad[token])
    restore = None
    if raw == "dup":
        value = int(loc[0])
    else:  # the slot of the next request's first token
        value = int(table[int(rows[token + 1]), 0])
        if raw == "twin":  # the faulted request's own entry names the same slot, for this forward
            position = int(batch.seq_lens[token]) - 1
            cell = (int(rows[token]), position)
            restore = (cell, int(table[cell]))
            table[cell] = value
    bad[token] = value
    batch.out_cache_loc = bad
    rids = getattr(batch, "rids", None)
    owner = (rids[0] if raw == "dup" else rids[token + 1]) if rids else None
    print(f"oobguard_faultinject: step {_count} token {token} of {loc.numel()}: out_cache_loc {before} -> "
          f"{value} (pid {os.getpid()}; {_whose(batch, token)}; {raw}; owner rid {owner})", file=sys.stderr, flush=True)
    _count += 1
    _tally["steps"] += 1
    try:
        return wrapped(*args, **kwargs)
    finally:
        if restore is not None:
            table[restore[0]] = restore[1]


def _dump() -> None:
    folder = os.environ.get("OOBGUARD_COUNT")
    if folder:
        path = Path(folder) / f"{os.getpid()}.json"
        path.with_suffix(".tmp").write_text(json.dumps({**_rank, **_tally}))
        path.with_suffix(".tmp").replace(path)


def _counter(kind: str):
    def count(wrapped, instance, args, kwargs):
        ids = args[0] if args else next(iter(kwargs.values()), None)
        if kind != "frees" or getattr(ids, "numel", lambda: 0)():
            _tally[kind] += 1
            _dump()
        return wrapped(*args, **kwargs)

    return count


def _move(wrapped, instance, args, kwargs):
    """site=move: on the chosen move_kv_cache call, give tgt_loc[token] back first."""
    global _moves
    spec = _spec()
    tgt = args[0] if args else kwargs["tgt_loc"]
    token = int(spec["token"])
    if _moves in _steps(spec["step"]) and token < tgt.numel():
        _free_one(_allocators[id(instance)], tgt, token, "move_kv_cache tgt_loc", _moves)
    _moves += 1
    return wrapped(*args, **kwargs)


def _patch_runner(module) -> None:
    """ModelRunner.forward with the fault's wrapper outermost (`outermost`)."""
    outermost.wrap_forward(module, _forward, _outer)


def _patch_pool(module) -> None:
    import wrapt

    if os.environ.get("OOBGUARD_COUNT"):
        wrapt.wrap_function_wrapper(module, "MHATokenToKVPool.set_kv_buffer", _counter("writes"))
        wrapt.wrap_function_wrapper(module, "MHATokenToKVPool.move_kv_cache", _counter("moves"))


def _patch_probe(module) -> None:
    """Count the guard's write probes (host scans and kernel launches) as it calls them."""
    import wrapt

    for name in ("scan_host", "launch"):
        if name in vars(module):
            wrapt.wrap_function_wrapper(module, name, _counter("probes"))


def _patch_allocator(module) -> None:
    import wrapt

    if os.environ.get("OOBGUARD_COUNT"):
        wrapt.wrap_function_wrapper(module, "TokenToKVPoolAllocator.free", _counter("frees"))


def load() -> None:
    import wrapt

    if os.environ.get("OOBGUARD_HICACHE_SHIM"):  # tests/hicache_shim.py, for this process
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        wrapt.register_post_import_hook(lambda module: __import__("hicache_shim").install(),
                                        "sglang.srt.mem_cache.pool_host.mla")
    if os.environ.get("OOBGUARD_PD_SHIM"):  # tests/pd_shim.py: mooncake's prefill send on a CPU
        sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
        wrapt.register_post_import_hook(lambda module: __import__("pd_shim").install(),
                                        "sglang.srt.disaggregation.mooncake.conn")
    if os.environ.get("OOBGUARD_HICACHE_FAULT"):
        wrapt.register_post_import_hook(_patch_load, "sglang.srt.mem_cache.pool_host.mha")
        if "held" in _faults():
            wrapt.register_post_import_hook(_record_decode, "sglang.srt.model_executor.model_runner")
    if os.environ.get("OOBGUARD_TRANSFER"):
        wrapt.register_post_import_hook(_patch_fake, "sglang.srt.disaggregation.fake.conn")
        wrapt.register_post_import_hook(_patch_alloc, "sglang.srt.mem_cache.allocator.token")
    if os.environ.get("OOBGUARD_POSITIONS"):
        wrapt.register_post_import_hook(positions.patch_runner, "sglang.srt.model_executor.model_runner")
        wrapt.register_post_import_hook(positions.patch_batch, "sglang.srt.model_executor.forward_batch_info")
    if os.environ.get("OOBGUARD_SWA_READS"):
        wrapt.register_post_import_hook(swa.patch_reads, "sglang.srt.layers.attention.torch_native_backend")
    if _spec().get("site") == "swa" and "door" in _spec().get("value", "").split("+"):
        wrapt.register_post_import_hook(swa.patch_metadata, "sglang.srt.layers.attention.torch_native_backend")
    if not (os.environ.get("OOBGUARD_FAULT") or os.environ.get("OOBGUARD_COUNT")):
        return

    wrapt.register_post_import_hook(_patch_runner, "sglang.srt.model_executor.model_runner")
    if _spec().get("site") == "leak":
        wrapt.register_post_import_hook(leaks.patch_release, leaks.MODULE)
        wrapt.register_post_import_hook(leaks.patch_rows, "sglang.srt.mem_cache.memory_pool")
    wrapt.register_post_import_hook(_patch_pool, "sglang.srt.mem_cache.memory_pool")
    wrapt.register_post_import_hook(_patch_allocator, "sglang.srt.mem_cache.allocator.token")
    if _spec().get("value") == "nan":
        wrapt.register_post_import_hook(
            lambda m: wrapt.wrap_function_wrapper(m, "RadixAttention.forward", _attention),
            "sglang.srt.layers.radix_attention")
    if os.environ.get("OOBGUARD_COUNT"):
        wrapt.register_post_import_hook(_patch_probe, "sglang_oobguard.probes.hostscan")
        wrapt.register_post_import_hook(_patch_probe, "sglang_oobguard.probes.kernels")
        # the step's write-map check probes out_cache_loc instead of scan_host / launch: a plain decode step's
        # fast check, else (or after it, when that does not find the step clean) the full one
        for name in ("check_decode", "check_host"):
            wrapt.register_post_import_hook(lambda m, name=name: wrapt.wrap_function_wrapper(m, name, _counter("probes")),
                                            "sglang_oobguard.probes.hostmap")
        wrapt.register_post_import_hook(lambda m: wrapt.wrap_function_wrapper(m, "launch", _counter("probes")),
                                        "sglang_oobguard.probes.stepkernel")


# -- OOBGUARD_TRANSFER=hold=S: a KV transfer that takes S seconds, on the fake backend --------
# The fake receiver concludes at the first poll after send_metadata; here each transfer is held at
# Transferring for S seconds after its send (unless aborted first), as a real RDMA write would be,
# and the fake manager gets a drain signal (`is_abort_release_safe`: the simulated write into the
# room's pages has ended), as mooncake / nixl / mori's have; `,drain=none` leaves it without one, as
# the fake backend is (or a real one with sglang's deferred release off). Each alloc of the tracked allocators
# is compared with the pages still being written: a page handed out again while its transfer is in
# flight is printed ("handed out while in flight").
_inflight: dict[int, tuple[float, set]] = {}  # bootstrap room -> (the simulated write's end, its pages)


def _transfer() -> dict[str, str]:
    return dict(part.split("=", 1) for part in os.environ["OOBGUARD_TRANSFER"].split(","))


def _hold() -> float:
    return float(_transfer()["hold"])


def _receiver_init(wrapped, instance, args, kwargs):
    wrapped(*args, **kwargs)
    instance.__dict__["_fi_room"] = kwargs.get("bootstrap_room", args[2] if len(args) > 2 else None)


def _send_metadata(wrapped, instance, args, kwargs):
    import time

    pages = args[0] if args else kwargs["kv_indices"]
    _inflight[instance.__dict__["_fi_room"]] = (time.monotonic() + _hold(), {int(p) for p in pages})
    return wrapped(*args, **kwargs)


def _poll(wrapped, instance, args, kwargs):
    import time

    from sglang.srt.disaggregation.base.conn import KVPoll

    sent = _inflight.get(instance.__dict__.get("_fi_room"))
    if instance.conclude_state is None and instance.has_sent_metadata and sent and time.monotonic() < sent[0]:
        return KVPoll.Transferring
    return wrapped(*args, **kwargs)


def _drained(self, room, required_acks) -> bool:
    import time

    sent = _inflight.get(room)
    return sent is None or time.monotonic() >= sent[0]


def _alloc(wrapped, instance, args, kwargs):
    import time

    result = wrapped(*args, **kwargs)
    if result is not None and instance.page_size == 1:
        now = time.monotonic()
        ids = {int(i) for i in result.tolist()}
        for room, (end, pages) in _inflight.items():
            if now < end and ids & pages:
                print(f"oobguard_faultinject: pages {sorted(ids & pages)[:8]} handed out while in flight "
                      f"(room {room}, {end - now:.1f} s of its transfer left)", file=sys.stderr, flush=True)
    return result


def _patch_fake(module) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module, "FakeKVReceiver.__init__", _receiver_init)
    wrapt.wrap_function_wrapper(module, "FakeKVReceiver.send_metadata", _send_metadata)
    wrapt.wrap_function_wrapper(module, "FakeKVReceiver.poll", _poll)
    if _transfer().get("drain") != "none":  # drain=none: the fake backend as it is, with no drain signal
        module.FakeKVManager.enable_deferred_decode_kv_release = True
        module.FakeKVManager.is_abort_release_safe = _drained


def _patch_alloc(module) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module, "TokenToKVPoolAllocator.alloc", _alloc)



# -- OOBGUARD_HICACHE_FAULT=high,held: stale device slots in HiCache's first host -> device load ----------------
# On its call for layer 1 (the first call wraps the fault outermost, so that the guard's wrapper sees the bad
# ids as a bug upstream of the load would hand them): `high` sets device_indices[1] past the pool (size +
# page_size + 3); `held` sets device_indices[2] to the slot a running request wrote at the last decode step
# (the request of the last decode batch's first token, read from req_to_token), so that the load would
# overwrite that request's KV.
_load_wrapped: list[bool] = []
_decoded: list = []  # the last decode forward: (req_to_token, its req_pool_indices, seq_lens, rids)


def _faults() -> set:
    return set(os.environ.get("OOBGUARD_HICACHE_FAULT", "").split(","))


def _bad_load(wrapped, instance, args, kwargs):
    if args[3] == 1 and _load_wrapped[0]:
        _load_wrapped[0] = False  # the first load-back only
        pool, ids = args[0], args[2].clone()
        if "high" in _faults():
            ids[1] = pool.size + pool.page_size + 3
            print(f"oobguard_faultinject: HiCache load device_indices[1] -> {int(ids[1])} (layer 1)",
                  file=sys.stderr, flush=True)
        if "held" in _faults():
            table, rows, seq_lens, rids = _decoded[-1] if _decoded else (None, None, None, None)
            if table is None:
                print("oobguard_faultinject: HiCache held fault: no decode step yet", file=sys.stderr, flush=True)
            else:
                token = int(seq_lens[0]) - 1
                ids[2] = int(table[int(rows[0]), token])
                print(f"oobguard_faultinject: HiCache load device_indices[2] -> {int(ids[2])} (request "
                      f"{rids[0] if rids else None} token {token}, layer 1)", file=sys.stderr, flush=True)
        args = (*args[:2], ids, *args[3:])
    return wrapped(*args, **kwargs)


def _patch_load(module) -> None:
    import wrapt

    def first(wrapped, instance, args, kwargs):
        if not _load_wrapped:
            _load_wrapped.append(True)
            wrapt.wrap_function_wrapper(module, "MHATokenToKVPoolHost.load_to_device_per_layer", _bad_load)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "MHATokenToKVPoolHost.load_to_device_per_layer", first)


def _record_decode(module) -> None:
    import wrapt

    def forward(wrapped, instance, args, kwargs):
        batch = args[0] if args else kwargs["forward_batch"]
        if batch.forward_mode.name.lower() == "decode" and batch.batch_size:
            _decoded[:] = [(instance.req_to_token_pool.req_to_token, batch.req_pool_indices.clone(),
                            batch.seq_lens_cpu.clone(), list(batch.rids or []))]
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "ModelRunner.forward", forward)
