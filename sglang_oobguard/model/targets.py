"""Targets: which KV write methods carry slot ids, where, and against which bound.

One table of rules drives install, uninstall and the coverage report. The classes
themselves are not listed: `discover` finds them by walking the installed sglang's
`KVCache` subclasses, and a rule here says how to guard a method it finds:

- `CONTRACT` rules hold for a method name on every pool class: these methods belong
  to the KVCache interface (or the primary pools) and take ids in the pool's own
  slot space, which is why upstream checks them all against `size + page_size`;
- `OWN` rules hold for one (class, method) pair: the index and K-only writes, whose
  id space was read from each class's source;
- `LABELS` name the sites upstream's own probe names, with upstream's text, so that
  its duplicate check can be recognised and skipped.

A write method that no rule covers is not guarded and is named with the reason.
"""

from __future__ import annotations

import enum
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from .dsv4targets import dsv4_slots
from .maptargets import WRITE_MAP_MEASURED

# Supported versions, declared up front: the releases the CI matrix runs, oldest to newest. What
# a release lacks is skipped and named in a log line; outside the range the guard installs what fits.
SUPPORTED = ((0, 4, 10), (0, 5, 23))
TESTED = ("0.4.10.post2", "0.5.10", "0.5.12", "0.5.23")

MEMORY_POOL = "sglang.srt.mem_cache.memory_pool"
BASE_CLASS = "KVCache"  # every KV pool derives from memory_pool.KVCache
# sglang 0.5.13+'s in-source probe, as memory_pool binds it; its calls under our
# labels, made inside a method we guard, duplicate our probe and are skipped.
UPSTREAM_PROBE = "maybe_detect_oob"

# What discovery calls a KV write method: upstream's names across 0.4.6..0.5.23
# (set_kv_buffer, set_index_k_scale_buffer, set_key_buffer_fused, set_index_fp4,
# set_kv_buffer_prefix_valid, move_kv_cache, ...). Private helpers sit behind these.
WRITE_METHOD = re.compile(r"^(set_\w*(buffer|fused|fp4|index_k)\w*|move_kv_cache)$")


@dataclass(frozen=True)
class Bound:
    """The exclusive upper bound of a parameter's ids (the lower one is 0)."""

    rule: str  # how the bound is computed, for logs and `doctor`
    high: Callable[[Any], int]
    slots: bool = False  # the pool's own token slots: what its allocator hands out (the liveness shadow)


def _token_slots(pool: Any) -> int:
    return pool.size + pool.page_size


def _dcp_token_slots(pool: Any) -> int:
    # 0.5.19+: under decode context parallelism the MLA write loc is logical,
    # one stored row per `_write_loc_dcp_span` ids; upstream widens its bound so.
    try:
        span = getattr(pool, "_write_loc_dcp_span", 1)  # a property that reads sglang's runtime context
    except Exception:  # a context that never set the DCP width: no DCP
        span = 1
    return (pool.size + pool.page_size) * span


def _npu_index_slots(pool: Any) -> int:
    # Upstream's own bound for the NPU indexer's raw virtual loc (0.5.23).
    return pool.index_size + pool.index_page_size * pool.index_page_padding


TOKEN_SLOTS = Bound("size + page_size", _token_slots, slots=True)
DCP_TOKEN_SLOTS = Bound("(size + page_size) * _write_loc_dcp_span", _dcp_token_slots, slots=True)
# The one bound of a pool's write ids, used by every check that is not a method's own
# (the forward step's out_cache_loc): the widest form, which is size + page_size
# wherever decode context parallelism is off (upstream's fix of the same false positive: #33432).
POOL_IDS = DCP_TOKEN_SLOTS
NPU_INDEX_SLOTS = Bound("index_size + index_page_size * index_page_padding", _npu_index_slots)
DSV4_SLOTS = Bound("ceil((size + global_page_size) / page_size) * page_size", dsv4_slots)


@dataclass(frozen=True)
class Ids:
    """One parameter that holds slot ids: its position after self, the names it has
    gone by (checked against the signature, so a changed method is not misread)."""

    position: int
    names: tuple[str, ...]
    bound: Bound = TOKEN_SLOTS
    suffix: str = ""  # set when a method has two id parameters (move_kv_cache)


@dataclass(frozen=True)
class Rule:
    ids: tuple[Ids, ...]
    layer: Optional[int] = 0  # position of the layer (RadixAttention, or an int id); None: no layer
    lens: Optional[int] = None  # position of per-row valid lengths: only a prefix of each row is written


LOC = Ids(1, ("loc", "loc_info"))
WRITE = Rule((LOC,))

CONTRACT: dict[str, Rule] = {
    "set_kv_buffer": WRITE,
    "set_mla_kv_buffer": WRITE,
    "move_kv_cache": Rule((Ids(0, ("tgt_loc",), suffix=" tgt_loc"), Ids(1, ("src_loc",), suffix=" src_loc")),
                          layer=None),
    # Row i writes loc_2d[i, :commit_lens[i]]; the rest of the row is never read.
    "set_kv_buffer_prefix_valid": Rule((Ids(1, ("loc_2d",)),), lens=2),
}

OWN: dict[tuple[str, str], Rule] = {
    # upstream widens only this MLA write under DCP (0.5.19+)
    ("MLATokenToKVPool", "set_mla_kv_buffer"): Rule((Ids(1, ("loc", "loc_info"), DCP_TOKEN_SLOTS),)),
    # index K of NSA/DSA models: token ids, paged inside (page = loc // page_size)
    ("NSATokenToKVPool", "set_index_k_scale_buffer"): WRITE,
    ("NSATokenToKVPool", "set_index_k_and_scale_buffer"): WRITE,  # its name in 0.5.3 - 0.5.7
    # 0.5.3 - 0.5.7's NPU MLA pool: index_k_buffer holds size // page_size + 1 pages of token rows
    ("AscendMLAPagedTokenToKVPool", "set_index_k_buffer"): WRITE,
    ("DSATokenToKVPool", "set_index_k_scale_buffer"): WRITE,
    ("LayerSplitDSATokenToKVPool", "set_index_k_scale_buffer"): WRITE,
    ("HybridLinearKVPool", "set_index_k_scale_buffer"): WRITE,  # full-pool ids, passed on as they are
    ("NPUMLATokenToKVPool", "set_index_k_buffer"): Rule((Ids(1, ("loc",), NPU_INDEX_SLOTS),)),
    # K-only pools and the MiniMax sparse pools: token ids of the pool (of its main pool)
    ("MHATokenToKOnlyPool", "set_k_buffer"): WRITE,
    ("NPUMHATokenToKOnlyPool", "set_k_buffer"): WRITE,
    ("MiniMaxSparseKVPool", "set_index_kv_buffer"): WRITE,
    ("MiniMaxSparseKVPool", "set_index_k_buffer"): WRITE,
    ("MiniMaxSparseKVPool", "set_fused_kv_index_buffer"): WRITE,
    ("MiniMaxM3Nvfp4KVPool", "set_index_k_buffer"): WRITE,
    ("MiniMaxM3Nvfp4KVPool", "set_fused_kv_index_buffer"): WRITE,
    ("MiniMaxM3Nvfp4IndexKPool", "set_k_buffer"): WRITE,
    ("MiniMaxM3Nvfp4IndexKPool", "set_quantized_k_buffer"): WRITE,
    ("MiniMaxM3Nvfp4MainKVPool", "set_quantized_kv_buffer"): WRITE,
    # DeepSeek-V4's leaf pools: token ids into pages of rows (deepseek_v4_memory_pool.py)
    **{(cls, method): Rule((Ids(1, ("loc",), DSV4_SLOTS),)) for cls, method in (
        ("DeepSeekV4SingleKVPool", "set_key_buffer"), ("DeepSeekV4SingleKVPool", "set_key_buffer_fused"),
        ("DeepSeekV4UniformFP8KVPool", "set_key_buffer_fused"), ("DeepSeekV4IndexerPool", "set_index_k_scale_buffer"),
        ("DeepSeekV4IndexerPool", "set_index_fused"), ("DeepSeekV4IndexerPool", "set_index_fp4"))},
}

# Upstream's labels for the sites its own probe checks (0.5.13+); other sites are
# labelled "method (Class)".
LABELS: dict[tuple[str, str], str] = {
    ("MHATokenToKVPool", "set_kv_buffer"): "set_kv_buffer (MHA)",
    ("MHATokenToKVPoolFP4", "set_kv_buffer"): "set_kv_buffer (MHA-FP4)",
    ("MHATokenToKVPoolMXFP8", "set_kv_buffer"): "set_kv_buffer (MHA-MXFP8)",
    ("MLATokenToKVPool", "set_kv_buffer"): "set_kv_buffer (MLA)",
    ("MLATokenToKVPool", "set_mla_kv_buffer"): "set_mla_kv_buffer (MLA)",
    ("MLATokenToKVPoolFP4", "set_kv_buffer"): "set_kv_buffer (MLA-FP4)",
    ("MLATokenToKVPoolFP4", "set_mla_kv_buffer"): "set_mla_kv_buffer (MLA-FP4)",
    ("LayerSplitDSATokenToKVPool", "set_kv_buffer"): "set_kv_buffer (MLA)",
    ("LayerSplitDSATokenToKVPool", "set_mla_kv_buffer"): "set_mla_kv_buffer (MLA)",
    ("MiniMaxM3Nvfp4MainKVPool", "set_kv_buffer"): "set_kv_buffer (MiniMax MSA-v1 NVFP4)",
    ("MiniMaxM3Nvfp4KVPool", "set_fused_kv_index_buffer"): "set_fused_kv_index_buffer (MiniMax MSA-v1 NVFP4)",
    ("NPUMLATokenToKVPool", "set_index_k_buffer"): "set_index_k_buffer (NPU MLA, raw virtual loc)",
}


# -- outside the pool classes: the forward step and the fused writers -------------


@dataclass(frozen=True)
class StepHook:
    """The method every forward pass runs through: `method(self, forward_batch, ...)`;
    the runner's `pool_attr` is the pool its out_cache_loc indexes."""

    module: str
    owner: str
    method: str
    pool_attr: str


# Where the write map was measured (write-map.md; older releases: WRITE_MAP_MEASURED): elsewhere a layout the
# guard does not know could fail a healthy server in strict mode, so the step check keeps bounds and liveness.
WRITE_MAP_SINCE = (0, 5, 23)


def write_map_off() -> Optional[str]:
    """Why the write map is off on the installed sglang, or None when it is on."""
    version = version_of_sglang()
    if version in WRITE_MAP_MEASURED or (release_of(version) or ()) >= WRITE_MAP_SINCE:
        return None
    return f"sglang {version}: the write map was measured on " + ", ".join([*WRITE_MAP_MEASURED, ".".join(
        map(str, WRITE_MAP_SINCE)) + "+"]) + " only"


def write_map_unmeasured() -> tuple[tuple[str, str], ...]:
    """(what, why) of each forward the write map's checks leave out on the installed sglang, an
    older release measured without them (`WRITE_MAP_MEASURED`); empty on 0.5.23+."""
    version = version_of_sglang()
    return tuple((what, f"not measured on sglang {version}") for what in WRITE_MAP_MEASURED.get(version, ()))


STEP_HOOK = StepHook("sglang.srt.model_executor.model_runner", "ModelRunner", "forward", "token_to_kv_pool")


@dataclass(frozen=True)
class IdleHook:
    """Where sglang's scheduler idles: the first of `methods` (newest release first) its owner
    has through its bases. The guard files its counts there: schedulers are killed, never exited."""
    module: str
    owner: str
    methods: tuple[str, ...]


IDLE_HOOK = IdleHook("sglang.srt.managers.scheduler", "Scheduler", ("on_idle", "self_check_during_idle"))


@dataclass(frozen=True)
class Writer:
    """A KV writer outside the pool classes: a module function that writes K/V rows at
    ids it takes itself. Looked up by sglang at call time in `module` (its callers
    reach it through that module's globals), so it is wrapped there."""

    modules: tuple[str, ...]  # where sglang looks it up, newest release first
    function: str
    ids: Ids  # position among the function's arguments
    rows: tuple[int, str]  # the argument whose rows the ids index: the bound is its shape[0] ...
    label: str
    per_row: Optional[tuple[int, str]] = None  # ... times this argument (ids per row: a page's tokens)

    @property
    def bound(self) -> str:
        rows = f"{self.rows[1]}.shape[0]"
        return rows if self.per_row is None else f"{rows} * {self.per_row[1]}"


_DSA_INDEXER = ("sglang.srt.layers.attention.dsa.dsa_indexer", "sglang.srt.layers.attention.nsa.nsa_indexer")
_TRTLLM_MLA = ("sglang.srt.layers.attention.trtllm_mla_backend",)

FUSED_WRITERS = (
    # The fused RoPE + KV store (Qwen3-MoE, bailing/Ling, LLaDA2, SDAR, ... with bf16 KV on
    # CUDA): the attention backend then runs with save_kv_cache=False, no pool method writes.
    Writer(("sglang.kernels.ops.attention.rope", "sglang.jit_kernel.rope"), "apply_rope_inplace_with_kvcache",
           Ids(7, ("out_loc",)), (3, "k_cache"), "apply_rope_inplace_with_kvcache (fused RoPE + KV store)"),
    # trtllm_mha with FP8 KV (the SM100 default then): imported inside the backend's method,
    # so looked up in its own module at every call.
    Writer(("sglang.kernels.ops.kvcache.fused_fp8_qkv_kv_cache",), "fused_fp8_qkv_kv_cache",
           Ids(5, ("cache_loc",)), (3, "k_cache"), "fused_fp8_qkv_kv_cache (trtllm_mha FP8 K/V store)"),
    Writer(("sglang.srt.layers.attention.trtllm_mha_backend",), "fused_fp8_set_kv_buffer",  # its 0.5.10 - 0.5.12 form
           Ids(4, ("cache_loc",)), (2, "k_cache"), "fused_fp8_set_kv_buffer (trtllm_mha FP8 K/V store)"),
    # The DSA (NSA before 0.5.13) indexer's index-K store, every DeepSeek-V3.2 / GLM-5 layer:
    # token ids into a buffer of pages.
    Writer(_DSA_INDEXER, "fused_store_index_k_cache", Ids(2, ("out_cache_loc",)), (1, "index_k_with_scale"),
           "fused_store_index_k_cache (DSA indexer K store)", per_row=(3, "page_size")),
    Writer(_DSA_INDEXER, "fused_k_indexer_norm_rope_store", Ids(2, ("out_cache_loc",)), (1, "cache"),
           "fused_k_indexer_norm_rope_store (DSA indexer K norm + RoPE + store)", per_row=(8, "page_size")),
    # trtllm_mla's decode: the KV row scatter fused with the q concat (DeepSeek-V3/R1, Kimi-K2
    # on SM100). Under decode context parallelism the fp8 one takes virtual ids, row * ranks.
    Writer(_TRTLLM_MLA, "set_mla_kv_concat_q", Ids(1, ("loc",)), (0, "kv_buffer"),
           "set_mla_kv_concat_q (trtllm_mla fused KV scatter)"),
    Writer(_TRTLLM_MLA, "set_mla_kv_concat_q_fp8", Ids(1, ("loc",)), (0, "kv_buffer"),
           "set_mla_kv_concat_q_fp8 (trtllm_mla fused FP8 KV scatter)", per_row=(7, "dcp_world_size")),
)


def rule_for(class_name: str, method: str) -> Optional[Rule]:
    return OWN.get((class_name, method)) or CONTRACT.get(method)


def label_for(class_name: str, method: str, ids: Ids) -> str:
    if method == "move_kv_cache":  # upstream's text, the same in every pool
        return f"move_kv_cache{ids.suffix}"
    return LABELS.get((class_name, method), f"{method} ({class_name})")


# -- liveness (SGLANG_OOBGUARD_LIVENESS): the allocators that hand slots out --------

ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator"  # a module in older releases, a package by 0.5.16
ALLOCATOR_BASE = "BaseTokenToKVPoolAllocator"
POOL_OF_ALLOCATOR = "_kvcache"  # sglang's own wiring: the allocator holds its KV pool


class Role(str, enum.Enum):
    """What an allocator method does to the liveness of its pool's slots."""

    ALLOC = "hands out the token ids it returns"
    FREE = "takes token ids back (at once, or when its free group ends)"
    FREE_PAGES = "takes page ids back (at once, or when its free group ends)"
    FREE_SEGMENT = "takes the pages of its token ids back itself (0.5.17-0.5.19's paged allocator only)"
    GROUP_END = "takes back the page ids its free group held"
    CLEAR = "takes everything back (its constructor calls it: the shadow starts here)"
    BACKUP = "saves the free lists (speculative decoding)"
    RESTORE = "puts saved free lists back"


# Allocators whose every hand-out and take-back path is known on every release of
# the matrix (0.4.10 .. 0.5.23). The check is exact-type: a subclass may hand slots
# out another way, so its pool (and any other allocator's) gets the bound check only,
# and is named in the activation log line.
TRACKED_ALLOCATORS = ("TokenToKVPoolAllocator", "PagedTokenToKVPoolAllocator")
ALLOCATOR_METHODS: dict[str, Role] = {
    "alloc": Role.ALLOC,
    "alloc_extend": Role.ALLOC,
    "alloc_decode": Role.ALLOC,
    "free": Role.FREE,  # free_full, free_segment(s) of the token allocator call it
    "free_page_ids": Role.FREE_PAGES,  # 0.5.20+; the paged free_segment calls it
    "free_segment": Role.FREE_SEGMENT,  # where it releases pages itself: a class of its own, no free_page_ids
    "free_group_end": Role.GROUP_END,
    "clear": Role.CLEAR,  # resize() calls it too
    "backup_state": Role.BACKUP,  # before 0.5.17
    "restore_state": Role.RESTORE,
}


def module_file(module: str) -> Optional[str]:
    """Where sglang keeps `module` (a.b.c -> .../a/b/c.py), found without importing it."""
    from importlib.util import find_spec
    from pathlib import Path

    top, _, rest = module.partition(".")
    spec = find_spec(top)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        base = Path(root, *rest.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return str(path)
    return None


@functools.lru_cache(maxsize=1)
def version_of_sglang() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def release_of(version: str) -> Optional[tuple[int, ...]]:
    """A version's release numbers (0.5.23+cu130, 0.5.23.post1: (0, 5, 23)); None: not a version."""
    from packaging.version import InvalidVersion, Version

    try:
        return Version(version).release[:3]
    except InvalidVersion:
        return None


def is_supported(version: str) -> bool:
    """Whether this release lies in the declared range: its release numbers, so a
    local build (0.5.23+cu130), a post or a pre-release of a release in range count."""
    release = release_of(version)
    return release is not None and SUPPORTED[0] <= release <= SUPPORTED[1]
