"""The read kernel (sglang_oobguard.probes.readkernel) compiled for a real GPU target (sm_90)
with Triton's own compiler, which needs no GPU (the interpreter, in test_reads, skips
codegen): it builds for CUDA in sglang's dtypes (int32 req_to_token, int64
req_pool_indices and seq_lens), with its record fold (atomics) and no device assert.
A fresh interpreter: the test process runs Triton in interpreter mode."""

from __future__ import annotations

import json

from helpers import run_python

COMPILE = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_oobguard.probes import readkernel

SIGNATURE = {
    "table_ptr": "*i32", "table_stride": "i64", "ncols": "i32", "rows_ptr": "*i64", "seq_ptr": "*i64", "prefix_ptr": "*i32", "written": "i32", "batch": "i32",
    "extend": "i32", "live_ptr": "*i32", "owner_ptr": "*i32", "gen_ptr": "*i64", "live_page": "i32",
    "live_high": "i64", "seen_slot_ptr": "*i32", "seen_gen_ptr": "*i32", "checked_ptr": "*i64", "found_ptr": "*i64", "scratch_ptr": "*i64",
    "record_ptr": "*i64", "step_ptr": "*i64", "site": "i32", "high": "i64", "BLOCK": "constexpr"}
kernel = triton.compile(ASTSource(fn=readkernel._read_kernel, signature=SIGNATURE,
                                  constexprs={"BLOCK": readkernel.READ_BLOCK}),
                        target=GPUTarget("cuda", 90, 32), options={"debug": False})
ptx = kernel.asm["ptx"]
print(json.dumps({"assert": "__assertfail" in ptx, "atom": ptx.count("atom."), "cubin_bytes": len(kernel.asm["cubin"])}))
"""


def test_the_read_kernel_builds_for_sm90_with_its_record_atomics():
    proc = run_python(COMPILE, {"TRITON_INTERPRET": None}, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["cubin_bytes"] > 0 and out["atom"] >= 2 and not out["assert"], out
