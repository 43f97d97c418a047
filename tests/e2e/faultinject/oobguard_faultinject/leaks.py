"""Test-only: the leak check's faults, where a real bug would put them.

`OOBGUARD_FAULT=site=leak,value=twice+skip+row[,step=N,token=T]` (any of the three, +-joined; each
once per process, on a different request):
- `twice`: the first request released (`release_kv_cache`, as the batch result processor calls it
  for a finished request) is released a second time at once (sglang #17797's pattern);
- `skip`: the next request released gives back none of its KV: its allocator frees are skipped
  for that one release (a free forgotten at finish), its row is given back as usual;
- `row`: at the Nth `ReqToTokenPool.alloc` that hands out new rows (`step=N`, default 3), the row of
  the newest request still running goes back first (`free_rows`, its `req_pool_idx` left alone),
  so that this hand-out gives it to a new request, and its own release later frees it again.
Each prints one line naming the request. The wrappers go on at the first call, outside the
guard's (installed when the module was imported), so the guard sees what they do.
"""

from __future__ import annotations

import os
import sys
import weakref

MODULE = "sglang.srt.managers.scheduler_components.batch_result_processor"
FREES = ("free", "free_segments", "free_full_segments")
_done: set[str] = set()
_wrapped: list[bool] = []
_rows_wrapped: list[bool] = []
_allocs = [0]
_admitted: list = []  # weak references to the requests given a row, in order


def _values(spec: dict[str, str]) -> set[str]:
    return set(spec.get("value", "").split("+"))


def _say(text: str) -> None:
    print(f"oobguard_faultinject: {text} (pid {os.getpid()})", file=sys.stderr, flush=True)


def _release(spec: dict[str, str]):
    values = _values(spec)

    def release(wrapped, instance, args, kwargs):
        req, tree = args[0], args[1]
        if "twice" in values and "twice" not in _done:
            _done.add("twice")
            wrapped(*args, **kwargs)
            _say(f"request {req.rid} released twice")
            return wrapped(*args, **kwargs)
        if "skip" in values and "skip" not in _done:
            _done.add("skip")
            allocator, row = tree.token_to_kv_pool_allocator, req.kv.req_pool_idx
            for name in FREES:
                setattr(allocator, name, lambda *a, **k: None)
            try:
                return wrapped(*args, **kwargs)
            finally:
                for name in FREES:
                    allocator.__dict__.pop(name, None)
                _say(f"request {req.rid} released without freeing its KV (row {row})")
        return wrapped(*args, **kwargs)

    return release


def patch_release(module) -> None:
    """site=leak: wrap release_kv_cache in the batch result processor, outermost from its first call on."""
    import wrapt

    spec = dict(part.split("=", 1) for part in os.environ.get("OOBGUARD_FAULT", "").split(",") if part)

    def first(wrapped, instance, args, kwargs):
        if not _wrapped:
            _wrapped.append(True)
            wrapt.wrap_function_wrapper(module, "release_kv_cache", _release(spec))
            return module.release_kv_cache(*args, **kwargs)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "release_kv_cache", first)


def _alloc(wrapped, instance, args, kwargs):
    """value=row: on the Nth hand-out of new rows (default 3), the row of the newest running request
    goes back first (`free_rows`), so that this very hand-out gives it to a new request."""
    spec = dict(part.split("=", 1) for part in os.environ.get("OOBGUARD_FAULT", "").split(",") if part)
    reqs = args[0] if args else kwargs["reqs"]
    new = [req for req in reqs if req.kv.req_pool_idx is None]
    if new and "row" not in _done:
        _allocs[0] += 1
        running = [req for ref in reversed(_admitted) for req in [ref()]
                   if req is not None and not req.finished() and req.kv.req_pool_idx is not None]
        if _allocs[0] >= int(spec.get("step", 3)) and running:
            _done.add("row")
            victim = running[0]
            instance.free_rows([victim.kv.req_pool_idx])
            _say(f"row {victim.kv.req_pool_idx} of request {victim.rid} freed while it runs, before the hand-out "
                 f"to {[req.rid for req in new]}")
    result = wrapped(*args, **kwargs)
    _admitted.extend(weakref.ref(req) for req in new)
    return result


def patch_rows(module) -> None:
    """value=row: wrap ReqToTokenPool.alloc, outermost from its first call on."""
    import wrapt

    def first(wrapped, instance, args, kwargs):
        if not _rows_wrapped:
            _rows_wrapped.append(True)
            wrapt.wrap_function_wrapper(module, "ReqToTokenPool.alloc", _alloc)
            return instance.alloc(*args, **kwargs)
        return wrapped(*args, **kwargs)

    wrapt.wrap_function_wrapper(module, "ReqToTokenPool.alloc", first)
