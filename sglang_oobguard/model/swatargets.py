"""SWA targets: the sliding-window pools' two id spaces, and what the SWA allocators do to them.

The SWA family's own table beside `targets`: sglang serves sliding-window models
(gpt-oss, Llama 4, Gemma, MiMo-V2, Mellum, Laguna, ...) from `SWAKVPool`, a full
sub-pool and an SWA sub-pool, with `SWATokenToKVPoolAllocator` driving one tracked
sub-allocator per id space and a full -> SWA mapping (`full_to_swa_index_mapping`).
The sub-allocators keep the two shadows; the SWA allocator's own methods are checked
in the full id space against that mapping (`checks.swa`), as upstream's invariants
`swa.peer_mapped` and `swa.peer_released` state them (allocator/swa.py).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

# The pool method every SWA allocator calls as it is built (its mapping goes in):
# where the guard names the sub-pools' id spaces and their model layers.
SWA_POOL_HOOK = "register_mapping"
SWA_POOL_BASE = "BaseSWAKVPool"
FULL_SUBPOOL, SWA_SUBPOOL = "full_kv_pool", "swa_kv_pool"
MAPPING = "full_to_swa_index_mapping"
SWA_ALLOCATOR_MODULE = "sglang.srt.mem_cache.allocator.swa"  # loads after the plugin: tracked when it does

# SWA pool writes whose SWA ids (KVWriteLoc.swa_loc) are checked at the door against the
# step's full slots, and the site label of that check.
SWA_DOORS = {("SWAKVPool", method): f"{method} (SWAKVPool) swa_loc" for method in ("set_kv_buffer", "set_mla_kv_buffer")}

# The SWA allocator families: checked (the pair of id spaces and the mapping), or only
# named (one id space, no mapping: its sub-allocator is the whole story).
SWA_CHECKED = ("SWATokenToKVPoolAllocator",)
SWA_NAMED_ONLY = ("PureSWATokenToKVPoolAllocator",)  # all layers sliding: the mapping is the identity
FULL_ALLOCATOR = "full_attn_allocator"  # an SWA allocator's sub-allocator of the ids req_to_token holds


def full_space(allocator: object) -> object:
    """The allocator of the ids req_to_token, out_cache_loc and PD's transfers name: an SWA
    allocator's full sub-allocator (its alloc methods return the full ids; the SWA ids are
    their mapping's), a pure-SWA allocator's one; any other allocator itself."""
    if type(allocator).__name__ not in SWA_CHECKED + SWA_NAMED_ONLY:
        return allocator
    sub = getattr(allocator, "__dict__", {}).get(FULL_ALLOCATOR)
    return allocator if sub is None else sub


# What the PD transfer checks leave out on an SWA model (said once in the log at the first send; doctor).
SWA_STATE_PAGES = ("not checked: a PD transfer's SWA destination pages (its SWA state indices, in the SWA id space), "
                   "only its full pages")

# What liveness tracks, per allocator family: doctor's lines, the activation line's summary.
FAMILIES = (
    ("TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator", "one shadow per pool, per slot or per page"),
    ("SWATokenToKVPoolAllocator", "both id spaces: its two sub-allocators' shadows, and its frees checked against "
                                  "the full -> SWA mapping (host ids; on a GPU the sub-allocators' checks only); the "
                                  "step's owner check, the read check and the PD transfer checks on the full "
                                  "sub-allocator's shadow (req_to_token holds full ids); " + SWA_STATE_PAGES),
    ("PureSWATokenToKVPoolAllocator", "its one (SWA) id space, through its sub-allocator's shadow (the step's owner "
                                      "and read checks too)"),
)
FAMILIES_SHORT = "token, paged, SWA (both id spaces) and pure-SWA allocators"
# SWA allocator families liveness does not track, with why (doctor prints it). They construct on the
# CPU (sglang 0.5.23's init_unified_swa_pools), but their ids are not an allocator's fixed id space.
_UNIFIED = ("unified memory pool: its sub-allocators (MultiEndedAllocator) hand out virtual page ids bound to "
            "physical pages of one shared UnifiedKVPool buffer, which compaction moves; a shadow would have to follow "
            "that binding (not read yet). Upstream's eager free asserts a double free itself (virtual_to_physical "
            "== -1); writes to freed slots and live pages handed out again are not caught")
UNTRACKED_WHY = {name: _UNIFIED for name in ("UnifiedSWAAllocatorBase", "UnifiedSWATokenToKVPoolAllocator",
                                              "UnifiedMambaSWATokenToKVPoolAllocator", "MultiEndedAllocator",
                                              "FloatMultiEndedAllocator")}


class SwaRole(str, enum.Enum):
    """What an SWA allocator method does to the pair of id spaces."""

    FREE_PAIRED = "takes full ids back with their SWA peers (full ids live; page 1: every peer mapped)"
    FREE_SEGMENT = "takes a page-aligned segment back with its SWA peers (each page's peer mapped)"
    FREE_FULL = "takes full ids back whose SWA peers went already (each peer released)"


@dataclass(frozen=True)
class SwaMethod:
    role: SwaRole
    full: bool = True  # the full ids go back too, so must be live (free_swa: only the SWA peers leave)
    segment: bool = False  # a kv-row segment from a page-aligned start: warn mode passes whole good pages on


SWA_METHODS: dict[str, SwaMethod] = {
    "free": SwaMethod(SwaRole.FREE_PAIRED),
    "free_swa": SwaMethod(SwaRole.FREE_PAIRED, full=False),  # SWA slots leaving the window
    "free_segment": SwaMethod(SwaRole.FREE_SEGMENT, segment=True),
    "free_swa_segment": SwaMethod(SwaRole.FREE_SEGMENT, full=False, segment=True),
    "free_full": SwaMethod(SwaRole.FREE_FULL),
    "free_full_segment": SwaMethod(SwaRole.FREE_FULL, segment=True),
}


# From 0.5.20 the SWA allocator's free() at page size 1 reads every full id's SWA peer
# (`_free_swa_pages`): a full id whose peer is gone already is a double free there. Before, its
# free_swa drops the zeros (a peer that left the window) and such a free is sglang's own: the
# guard said "SWA double free" on 0.5.19's correct engine at page 1 (2026-12-07, ci/reach-back.sh).
PEERS_READ_SINCE = (0, 5, 20)


def space_name(pool_class: str, sub: Optional[str]) -> str:
    """A pool's name in reports: the SWA pool, the sub-pool and its id space."""
    if sub is None:
        return f"{pool_class} (full ids)"
    return f"{pool_class}.{sub} ({'SWA' if sub == SWA_SUBPOOL else 'full'} ids)"


# SWA pool write methods that take no ids of their own to bound, with why (doctor names them so).
SWA_FORWARDED: dict[tuple[str, str], str] = {
    ("SWAKVPool", "set_index_k_scale_buffer"):
        "full ids passed on as they are to full_kv_pool.set_index_k_scale_buffer, guarded there",
}
