"""Leak targets: where sglang hands out and takes back request rows and releases a request's KV.

Read from sglang's code on 0.4.10.post2, 0.5.10, 0.5.12 and 0.5.23:

- `ReqToTokenPool` (`mem_cache/memory_pool.py`) keeps the rows (`req_pool_idx`) in a
  list, `free_slots`. 0.4.x: `alloc(need_size)` returns rows, `free(int | list)` takes
  them back. 0.5.10+: `alloc(reqs)` gives each request without a row one (a chunked
  request keeps its own) and `free(req)` takes the request's back and clears it;
  0.5.23 does both through `alloc_rows(n)` and `free_rows(rows)`, which beam search also
  calls directly for its member rows (no request). `clear` (flush_cache) gives every row
  back. Nothing else touches `free_slots` of the exact class (subclasses and PD decode's
  `DecodeReqToTokenPool` keep rows their own way: not tracked).
- `release_kv_cache(req, tree_cache, ...)` (`mem_cache/common.py`, 0.5.10+) is every
  release of a request's KV (finished, aborted, retracted, PD's transfers done), imported
  by name into the modules below; a request holds a row until it (0.5.23: `req.kv.
  req_pool_idx`, before: `req.req_pool_idx`; set to None by the release). A release of a
  request that holds no row is allowed only by a mamba tree (sglang asserts it).
- The idle sweep runs where the scheduler idles (`targets.IDLE_HOOK`), when
  `Scheduler.is_fully_idle()` (0.5.10+) says no request holds anything.

Standard library only.
"""

from __future__ import annotations

ROWS_MODULE = "sglang.srt.mem_cache.memory_pool"
ROWS_CLASS = "ReqToTokenPool"
TRACKED_ROWS = ("ReqToTokenPool",)  # exact type: a subclass may keep its rows another way
# method -> role; each is wrapped where the class defines it
ROW_METHODS = {"alloc": "alloc", "alloc_rows": "alloc_rows", "free": "free", "free_rows": "free_rows",
               "clear": "clear"}

RELEASE_HOME = "sglang.srt.mem_cache.common"
RELEASE = "release_kv_cache"
RELEASE_SINCE = "0.5.10"
RELEASE_IMPORTERS = (  # modules that bind release_kv_cache by name (0.5.10 .. 0.5.23)
    "sglang.srt.managers.scheduler_components.batch_result_processor",
    "sglang.srt.managers.scheduler_components.dynamic_chunk_sizer",
    "sglang.srt.managers.scheduler_output_processor_mixin",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.schedule_batch",
    "sglang.srt.disaggregation.prefill",
    "sglang.srt.disaggregation.decode",
    "sglang.srt.dllm.mixin.scheduler",
)
# The release completeness check's site: a release that left slots of the request's row neither
# freed nor the tree's (`checks.leakrelease`; its report's text: `leaktext`).
RELEASE_LEAK_LABEL = f"{RELEASE} (slots the release neither freed nor left to the tree)"
IDLE_GATE = "is_fully_idle"  # Scheduler's: nothing runs, waits or transfers (0.5.10+)


def kv_of(req: object) -> object:
    """Where a request keeps its row and lengths (`req_pool_idx`, `kv_committed_len`,
    `cache_protected_len`): 0.5.23 in its KV record (`req.kv`), older releases on the request."""
    kv = getattr(req, "kv", None)
    return kv if kv is not None and hasattr(kv, "req_pool_idx") else req


def row_of(req: object) -> object:
    """A request's req_to_token row, or None (released, or never given one)."""
    return getattr(kv_of(req), "req_pool_idx", None)
