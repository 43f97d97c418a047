"""Transfer targets: where the KV transfer (PD disaggregation) and HiCache checks hook in.

Their own table beside `targets` (as `swatargets` is for the SWA family): the decode
and prefill queues' methods, the backends' drain signal, the HiCache host pools.
"""

from __future__ import annotations

# The KV transfer hooks (PD disaggregation, with liveness; `checks.transfer`).
TRANSFER_MODULES = ("sglang.srt.disaggregation.decode", "sglang.srt.disaggregation.prefill")
# (module, class, method, what the hook does: `checks.transfer.HOOK_ROLES` says it in words)
_DECODE, _PREFILL = TRANSFER_MODULES
TRANSFER_HOOKS = ((_DECODE, "DecodePreallocQueue", "_send_kv_metadata", "send"),
                  (_DECODE, "DecodeTransferQueue", "_poll_with_metadata_gate", "poll"),
                  (_DECODE, "DecodeTransferQueue", "_poll_with_staging", "poll"),
                  (_DECODE, "DecodeTransferQueue", "resolve_deferred_releases", "resolve"),
                  (_DECODE, "DecodeTransferQueue", "has_pending_deferred_releases", "pending"),
                  (_PREFILL, "SchedulerDisaggregationPrefillMixin", "_send_kv_chunk", "prefill"))
# The backends' drain signal after an abort or failure (CommonKVManager's), armed by sglang's
# deferred release; without it (the fake backend, or the release off) a failed transfer stays in flight.
DRAIN_SIGNAL, DRAIN_ARMED = "is_abort_release_safe", "enable_deferred_decode_kv_release"
# HiCache (`checks.hicache`): the host pools whose loads into and backups from device slots take
# the device pool's own token ids (other host pools' ids are virtual or paged: not checked).
HICACHE_POOLS = (("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost"),
                 ("sglang.srt.mem_cache.pool_host.mla", "MLATokenToKVPoolHost"))
HICACHE_METHODS = (("load_to_device_per_layer", "host->device load"), ("backup_from_device_all_layer", "device->host backup"))
# What a HiCache load is for (`checks.hiloads`): the load-backs a controller starts, the request that
# asked for a tree node's load-back, a retracted request's restore into its own row.
HICACHE_LOAD_HOOKS = (("sglang.srt.managers.cache_controller", "HiCacheController", "start_loading", "loads"),
                      ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "load_back", "asked"),
                      ("sglang.srt.mem_cache.unified_radix_cache", "UnifiedRadixCache", "restore_kv_cache", "restore"))
# The releases that have them (read from sglang's wheels): the send hooks (`_send_kv_metadata`,
# `_send_kv_chunk`) and the restore arrived in 0.5.21; `pool_host/mha.py` in 0.5.16 (the host pools
# lived in memory_pool_host.py before: not hooked). The holder check reads the owner table, which the
# write map's owner check keeps: where the write map runs (targets.WRITE_MAP_SINCE).
TRANSFER_SINCE, HICACHE_SINCE = "0.5.21", "0.5.16"
TRANSFER_ENTRIES = ((_DECODE, "DecodePreallocQueue", "_send_kv_metadata"),
                    (_PREFILL, "SchedulerDisaggregationPrefillMixin", "_send_kv_chunk"))
