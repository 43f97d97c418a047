"""Map targets: the forwards the step check's write map leaves to bounds and liveness, by name.

Two tables, for the write map (`writemap`), doctor and the activation line: the forwards it
does not check on any release (`UNMAPPED`), and the older releases whose engine ran the
write map's checks (map, owners, reads, ownids, positions) with what was not measured there
(`WRITE_MAP_MEASURED`). The gate itself, and the installed release's entries, are read by
`targets.write_map_off` and `targets.write_map_unmeasured`.
"""

from __future__ import annotations

# What the write map does not check, by name (a short name, and why).
UNMAPPED = (
    ("prebuilt, split_prefill, dllm_extend forwards", "no mapping measured: bounds and liveness only"),
    ("draft steps on translated pools", "out_cache_loc_virtual spans every draft step: bounds and liveness only"),
    ("EAGLE draft decode and draft extend under CUDA graphs",
     "EAGLEDraftCudaGraphRunner / EAGLEDraftExtendCudaGraphRunner.execute replay without ModelRunner.forward: "
     "no step check; their layers' captured probes still check bounds and liveness at every replay"),
)

# The forwards a release may have been measured without (`writemap.unmeasured` tells them from
# the runner's and the batch's attributes). Speculative decoding: every forward of a server that
# runs it (the draft runner's, target verify, draft extend, and the target's own extends), so
# that its steps never mix checked and unchecked owner claims. PD: every forward of a decode server.
# HiCache and sliding-window servers: every forward, where their rows did not run (before 0.5.16
# `ci/reach-back.sh` leaves them out).
SPECULATIVE = "speculative decoding's forwards (EAGLE, NGRAM: draft, verify and the target's own)"
PD_DECODE = "PD disaggregation's decode side"
HICACHE = "a HiCache server's forwards (enable_hierarchical_cache)"
SLIDING = "a sliding-window model's forwards (SWAKVPool)"

# Older releases whose CPU engine ran the clean matrix silent with the write map's checks on
# (docs/checks.md, 2026-12-07, issue #43, `ci/reach-back.sh`: page size 1/4/16/64, mixed chunks,
# retraction, TP=2, seeded random workloads; from 0.5.16 the SWA rows and, where it runs on a
# CPU, HiCache's), by exact version: what was not measured there, left to bounds and liveness.
# A post release (x.post1) is listed as its base where its wheel differs from the base's only in
# files no forward layout comes from (docs/checks.md names them, 2026-12-08) and the release
# sweep's engine smoke run (every check on) is clean there. Releases not listed: the map is off.
WRITE_MAP_MEASURED = {
    "0.5.10": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.10.post1": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),  # as 0.5.10 (a flashinfer version string)
    "0.5.11": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.12": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.12.post1": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),  # as 0.5.12 (DeepSeek-V4, SWA pool)
    "0.5.13": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.13.post1": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),  # as 0.5.13 (speculative v2 workers)
    "0.5.14": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.15": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),
    "0.5.15.post1": (SPECULATIVE, PD_DECODE, HICACHE, SLIDING),  # as 0.5.15 (DSA top-k metadata)
    "0.5.16": (SPECULATIVE, PD_DECODE, HICACHE),  # its HiCache row needs CUDA in create_tree_cache
    "0.5.17": (SPECULATIVE, PD_DECODE, HICACHE),  # likewise
    "0.5.18": (SPECULATIVE, PD_DECODE, HICACHE),  # likewise
    "0.5.19": (SPECULATIVE, PD_DECODE, HICACHE),  # likewise
    "0.5.20": (SPECULATIVE, PD_DECODE, HICACHE),  # likewise
    "0.5.21": (SPECULATIVE, PD_DECODE, HICACHE),  # likewise
    "0.5.22": (SPECULATIVE, PD_DECODE),
}
