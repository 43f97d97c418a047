"""The step kernel (sglang_oobguard.probes.stepkernel) compiled for a real GPU target (sm_90)
with Triton's own compiler, which needs no GPU: the interpreter (the other tests) skips
codegen, so only this shows every family's variant builds for CUDA (vector atomic_cas
on the owner table, int64 atomic_max stamps), that strict carries its device assert and
the others do not; the position check rides in every variant (a runtime argument: no variant
of its own). A fresh interpreter: the test process runs Triton in interpreter mode."""

from __future__ import annotations

import json

import pytest

from helpers import run_python

COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_oobguard.probes import stepkernel
from sglang_oobguard.model.writemap import FAMILIES

SIGNATURE = {
    "ids_ptr": "*i64", "ids_stride": "i64", "virt_ptr": "*i64", "virt_stride": "i64", "n": "i32",
    "table_ptr": "*i32", "table_stride": "i64", "ncols": "i32", "nrows": "i32", "rows_ptr": "*i64", "batch": "i32",
    "seq_ptr": "*i64", "starts_ptr": "*i32", "counts_ptr": "*i32", "prefix_ptr": "*i32", "offset_ptr": "*i64",
    "pos_ptr": "*i64", "search": "i32", "width": "i32", "steps": "i32", "page": "i32",
    "draft_step": "i32", "pos_mode": "i32", "pos_site": "i32", "high": "i64", "site": "i32",
    "layer": "i32", "live_ptr": "*i32", "owner_ptr": "*i32", "live_page": "i32", "live_high": "i64", "slot_stamp_ptr": "*i64",
    "row_stamp_ptr": "*i64", "record_ptr": "*i64", "step_ptr": "*i64", "clean_ptr": "*i64"}
MESSAGE = "sglang_oobguard: out_cache_loc (forward step): write map"
out = {}
for family in FAMILIES:
    for live in (False, True):
        for strict in (False, True):
            constexprs = dict(FAMILY=FAMILIES.index(family), HAS_OFFSET=family == "decode", HAS_VIRT=False,
                              HAS_LIVE=live, HAS_OWNER=live, COPY=not strict, ASSERT=strict,
                              MESSAGE=MESSAGE if strict else "", BLOCK=stepkernel.STEP_BLOCK)
            signature = dict(SIGNATURE, **{name: "constexpr" for name in constexprs})
            kernel = triton.compile(ASTSource(fn=stepkernel._step_kernel, signature=signature, constexprs=constexprs),
                                    target=GPUTarget("cuda", 90, 32), options={"debug": strict})
            ptx = kernel.asm["ptx"]
            out[f"{family}{'-live' if live else ''}{'-strict' if strict else ''}"] = {
                "assert": "__assertfail" in ptx, "cas": ptx.count("atom.global.cas") + ptx.count(".cas."),
                "max": ptx.count(".max."), "cubin_bytes": len(kernel.asm["cubin"])}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    proc = run_python(COMPILE, {"TRITON_INTERPRET": None}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family", ["extend", "decode", "draft", "verify"])
def test_every_family_builds_for_sm90_with_its_stamps_and_owner_claims(compiled, family):
    plain, live = compiled[family], compiled[f"{family}-live"]
    assert plain["cubin_bytes"] > 0 and live["cubin_bytes"] > 0
    assert plain["max"] > 0 and live["max"] > 0  # the duplicate and shared-row stamps
    assert live["cas"] > 0 and plain["cas"] == 0  # the owner claim, only with liveness
    assert compiled[f"{family}-strict"]["assert"] and not plain["assert"]
