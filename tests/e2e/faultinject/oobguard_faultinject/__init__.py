"""Test-only sglang plugin: a stale slot id, injected where a real bug would put it.

Loaded by sglang's own `load_plugins()` like any plugin. With `OOBGUARD_FAULT`
unset it does nothing. With `OOBGUARD_FAULT=step=3,token=1,value=high+3` (step may
be a range, `3-6`; value `high+K` means the pool's size + page_size + K, or a literal
such as `-1`) it wraps `ModelRunner.forward`, counts the forwards that write KV, and
on each chosen one replaces `out_cache_loc[token]` in a clone handed to that forward
only: the allocator and req_to_token keep the true slot, as with a real stale id
between the allocator and the attention backend's write.

`value=freed` injects the other kind of stale id: on the chosen forward it gives
`out_cache_loc[token]` back to the allocator (`token_to_kv_pool_allocator.free`)
while its request still runs, then lets the forward write there: a use after free.
"""

from __future__ import annotations

import os
import sys

_count = 0


def _spec() -> dict[str, str]:
    return dict(part.split("=", 1) for part in os.environ["OOBGUARD_FAULT"].split(","))


def _steps(text: str) -> range:
    first, _, last = text.partition("-")
    return range(int(first), int(last or first) + 1)


def _forward(wrapped, instance, args, kwargs):
    global _count
    batch = args[0] if args else kwargs["forward_batch"]
    loc = getattr(batch, "out_cache_loc", None)
    if loc is not None and loc.numel():
        spec = _spec()
        token = int(spec["token"])
        if _count in _steps(spec["step"]) and token < loc.numel():
            raw = spec["value"]
            if raw == "freed":
                instance.token_to_kv_pool_allocator.free(loc[token:token + 1].clone())
                print(f"oobguard_faultinject: step {_count} token {token} of {loc.numel()}: out_cache_loc "
                      f"{int(loc[token])} freed (pid {os.getpid()})", file=sys.stderr, flush=True)
            else:
                pool = instance.token_to_kv_pool
                value = pool.size + pool.page_size + int(raw[5:]) if raw.startswith("high+") else int(raw)
                bad = loc.clone()
                before = int(bad[token])
                bad[token] = value
                batch.out_cache_loc = bad
                print(f"oobguard_faultinject: step {_count} token {token} of {loc.numel()}: out_cache_loc {before} -> "
                      f"{value} (pid {os.getpid()})", file=sys.stderr, flush=True)
        _count += 1
    return wrapped(*args, **kwargs)


def _patch(module) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module, "ModelRunner.forward", _forward)


def load() -> None:
    if not os.environ.get("OOBGUARD_FAULT"):
        return
    import wrapt

    wrapt.register_post_import_hook(_patch, "sglang.srt.model_executor.model_runner")
