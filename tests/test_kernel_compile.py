"""The probe kernel compiled for a real GPU target (sm_90, H100/H200) with Triton's
own compiler, which needs no GPU. The interpreter skips codegen and makes
tl.device_assert a no-op, so only this shows the strict assert is really in the
binary, and absent from the other modes' variant. It runs in a fresh interpreter
because the test process runs Triton in interpreter mode.
"""

from __future__ import annotations

import json

import pytest

from helpers import run_python

COMPILE = """
import json, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from sglang_oobguard import probe
from sglang_oobguard.config import Config, Mode
from sglang_oobguard.guard import Guard
from sglang_oobguard.report import site_id

guard = Guard(Config(mode=Mode.STRICT))
longest = "set_unified_key_buffer_radix_fused_norm_rope (DeepSeekV4TokenToKVPool)"  # the longest label seen
message = guard._message(site_id(longest), 2**62)
out = {"message": message}
for loc_type, lens in (("i32", False), ("i64", False), ("i64", True)):
    for strict in (False, True):
        signature = {"loc_ptr": "*" + loc_type, "n": "i32", "stride": "i64", "lens_ptr": "*i32", "row_len": "i32",
                     "row_stride": "i64", "high": "i64", "site": "i32", "layer": "i32", "record_ptr": "*i64",
                     "HAS_LENS": "constexpr", "ASSERT": "constexpr", "MESSAGE": "constexpr", "BLOCK": "constexpr"}
        constexprs = {"HAS_LENS": lens, "ASSERT": strict, "MESSAGE": message if strict else "",
                      "BLOCK": probe.PROBE_BLOCK}
        source = ASTSource(fn=probe._oob_probe_kernel, signature=signature, constexprs=constexprs)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"debug": strict})
        out[loc_type + ("-lens" if lens else "") + ("-strict" if strict else "")] = {
            "assert": "__assertfail" in kernel.asm["ptx"],
            "message_in_cubin": message.encode()[:60] in kernel.asm["cubin"],
            "cubin_bytes": len(kernel.asm["cubin"]),
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    proc = run_python(COMPILE, {"TRITON_INTERPRET": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_assert_message_fits_cuda_limit_and_names_label_and_bound(compiled):
    message = compiled["message"]
    assert len(message.encode()) <= 255
    assert "(DeepSeekV4TokenToKVPool)" in message and "outside [0, 4611686018427387904)" in message


@pytest.mark.parametrize("loc_type", ["i32", "i64", "i64-lens"])
def test_strict_variant_carries_the_device_assert(compiled, loc_type):
    got = compiled[f"{loc_type}-strict"]
    assert got["assert"] and got["message_in_cubin"] and got["cubin_bytes"] > 0


@pytest.mark.parametrize("loc_type", ["i32", "i64", "i64-lens"])
def test_other_modes_compile_without_it(compiled, loc_type):
    got = compiled[loc_type]
    assert not got["assert"] and not got["message_in_cubin"] and got["cubin_bytes"] > 0
