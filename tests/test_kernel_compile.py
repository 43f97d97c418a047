"""The probe kernels compiled for a real GPU target (sm_90, H100/H200) with Triton's
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
from sglang_oobguard.probes import kernels, valuekernel
from sglang_oobguard.model.violation import FINITE_ASSERT
from sglang_oobguard.model.config import Config, Mode
from sglang_oobguard.checks.guard import Guard
from sglang_oobguard.model.violation import site_id

guard = Guard(Config(mode=Mode.STRICT, liveness=True))
longest = "set_unified_key_buffer_radix_fused_norm_rope (DeepSeekV4TokenToKVPool)"  # the longest label seen
guard.bounds[site_id(longest)] = "(size + page_size) * _write_loc_dcp_span"  # the longest rule
message = guard.message(site_id(longest))
out = {"message": message}
def build(fn, signature, constexprs, strict):
    signature = dict(signature, **{name: "constexpr" for name in constexprs})
    source = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"debug": strict})

variants = {}
for loc_type, lens, live in (("i32", False, False), ("i64", False, False), ("i64", True, False), ("i64", False, True)):
    name = loc_type + ("-lens" if lens else "") + ("-live" if live else "")
    variants[name] = (kernels._oob_probe_kernel, {
        "loc_ptr": "*" + loc_type, "n": "i32", "stride": "i64", "lens_ptr": "*i32", "row_len": "i32",
        "row_stride": "i64", "high": "i64", "site": "i32", "layer": "i32", "record_ptr": "*i64",
        "scratch_ptr": "*i64", "step_ptr": "*i64", "live_ptr": "*i32", "live_page": "i32", "live_high": "i64",
        "clean_ptr": "*" + loc_type,
        "chunk": "i32"}, {"HAS_LENS": lens, "HAS_LIVE": live, "COPY": True}, message)
for exclusive in (False, True):
    variants["free" + ("-exclusive" if exclusive else "")] = (kernels._free_probe_kernel, {
        "ids_ptr": "*i64", "n": "i32", "stride": "i64", "high": "i64", "site": "i32", "layer": "i32",
        "record_ptr": "*i64", "step_ptr": "*i64", "live_ptr": "*i32", "live_page": "i32"}, {"EXCLUSIVE": exclusive},
        message)
for value_type in ("fp16", "bf16", "fp32"):  # the value check (SGLANG_OOBGUARD_FINITE): valuekernel.DTYPES
    for loc_type, per_token in (("i64", True), ("i32", True), ("i64", False)):
        variants[f"values-{value_type}-{loc_type}" + ("" if per_token else "-scale")] = (
            valuekernel._finite_probe_kernel, {
                "val_ptr": "*" + value_type, "n": "i32", "row_len": "i32", "row_stride": "i64", "head_len": "i32",
                "loc_ptr": "*" + loc_type, "loc_stride": "i64", "rows": "i32", "high": "i64", "site": "i32",
                "layer": "i32", "part": "i32", "record_ptr": "*i64", "scratch_ptr": "*i64", "step_ptr": "*i64",
                "chunk": "i32"}, {"PER_TOKEN": per_token}, FINITE_ASSERT)
for name, (fn, signature, extra, text) in variants.items():
    for strict in (False, True):
        constexprs = dict(extra, ASSERT=strict, MESSAGE=text if strict else "", BLOCK=kernels.PROBE_BLOCK)
        kernel = build(fn, signature, constexprs, strict)
        out[name + ("-strict" if strict else "")] = {
            "assert": "__assertfail" in kernel.asm["ptx"],
            "message_in_cubin": text.encode()[:60] in kernel.asm["cubin"],
            "nan_checks": kernel.asm["ptx"].count("setp.nan") + kernel.asm["ptx"].count("setp.neu"),
            "atomics": kernel.asm["ptx"].count("atom.global"),
            "cubin_bytes": len(kernel.asm["cubin"]),
            "flag_loads": kernel.asm["ptx"].count("ld.global.b32"),  # the shadow's flags are int32
            "exchanges": kernel.asm["ptx"].count("atom.global") and kernel.asm["ptx"].count(".exch"),
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled():
    proc = run_python(COMPILE, {"TRITON_INTERPRET": None})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_assert_message_fits_cuda_limit_and_names_label_and_bound(compiled):
    """A compile-time constant per site (not per pool size), so a pool's warm-up compiles it once."""
    message = compiled["message"]
    assert len(message.encode()) <= 255
    assert "(DeepSeekV4TokenToKVPool)" in message and "outside [0, (size + page_size) * _write_loc_dcp_span)" in message


# "-live": liveness; "free": the free probe; "values-": the value check (per token; "-scale": a scale tensor)
VALUES = [f"values-{v}-{loc}" for v in ("fp16", "bf16", "fp32") for loc in ("i64", "i32", "i64-scale")]
VARIANTS = ["i32", "i64", "i64-lens", "i64-live", "free", "free-exclusive", *VALUES]


@pytest.mark.parametrize("loc_type", VARIANTS)
def test_strict_variant_carries_the_device_assert(compiled, loc_type):
    got = compiled[f"{loc_type}-strict"]
    assert got["assert"] and got["message_in_cubin"] and got["cubin_bytes"] > 0


@pytest.mark.parametrize("loc_type", VARIANTS)
def test_other_modes_compile_without_it(compiled, loc_type):
    got = compiled[loc_type]
    assert not got["assert"] and not got["message_in_cubin"] and got["cubin_bytes"] > 0


def test_liveness_is_one_gather_in_the_same_kernel(compiled):
    """HAS_LIVE adds the shadow's flag loads to the write probe; without it, none."""
    assert compiled["i64-live"]["flag_loads"] > 0 and compiled["i64"]["flag_loads"] == 0
    assert compiled["free"]["flag_loads"] > 0


def test_the_exclusive_free_exchanges_each_flag_atomically(compiled):
    """Where each id owns its flag, the free reads and clears it in one atomic exchange
    (an id freed twice in one call finds 0 the second time); the paged token free does not."""
    assert compiled["free-exclusive"]["exchanges"] > 0 and not compiled["free"]["exchanges"]


@pytest.mark.parametrize("variant", VALUES)
def test_the_value_check_compiles_its_nan_test_and_folds_with_atomics(compiled, variant):
    """Every value variant a pool's warm-up asks for compiles for sm_90: it tests for NaN
    and folds its finding into the record with atomics (no host read)."""
    got = compiled[variant]
    assert got["nan_checks"] > 0 and got["atomics"] > 0, got
    assert compiled["i64"]["nan_checks"] == 0  # the id probe compares no float
