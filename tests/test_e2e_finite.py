"""End to end: SGLANG_OOBGUARD_FINITE in the real sglang 0.5.23 Engine on the CPU (tiny
2-layer Llama, torch_native attention, four concurrent prompts, greedy), the guard loaded
by sglang's own plugin loader. The fault plugin (tests/e2e/faultinject) makes one decode
token's K non-finite at layer 1 only, inside RadixAttention, a place the guard does not
wrap: the K/V write of that layer must be reported, naming the request and the token."""

from __future__ import annotations

import re

import pytest

from e2e.harness import run_engine
from sglang_oobguard.report import summary

pytestmark = pytest.mark.e2e

FINITE = {"SGLANG_OOBGUARD_FINITE": "1"}
INJECTED = re.compile(r"oobguard_faultinject: step 3 token 1 of 4: K at layer 1 -> nan, slot (\d+) "
                      r"\(pid \d+; mode decode rid (\w+) token (\d+)\)")


def test_a_nan_k_at_one_layer_is_reported_at_that_layer_naming_request_and_token_and_warn_serves_all(model, clean,
                                                                                                   tmp_path):
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "3600", **FINITE,
                             "OOBGUARD_FAULT": "step=3,token=1,value=nan,layer=1",
                             "SGLANG_OOBGUARD_REPORT_DIR": str(tmp_path)})
    (fault,) = INJECTED.findall(run.log) or [None]
    assert fault, run.log[-3000:]
    slot, rid, token = fault
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    outputs = run.result["outputs"]
    assert all(len(tokens) == 16 for tokens in outputs)  # warn: every request served to the end
    assert [i for i, (got, want) in enumerate(zip(outputs, clean)) if got != want] in ([], [1])
    warnings = [line for line in run.log.splitlines() if "sglang_oobguard: non-finite KV values" in line]
    assert len(warnings) == 1, warnings
    assert (f"set_kv_buffer (MHA) layer 1: cache_k of loc[1] (slot {slot}) head 0 is nan, not finite "
            f"(1 non-finite values written) (pool MHATokenToKVPool); step ") in warnings[0], warnings[0]
    assert f"(decode, batch 4); request {rid} token {token}; tp 0, pp 0" in warnings[0], warnings[0]
    report = summary.read(str(tmp_path))
    assert {(g.label, g.pool, g.layer) for g in report.groups} == {("set_kv_buffer (MHA)", "MHATokenToKVPool", 1)}
    first = report.groups[0].first["violation"]
    assert (first["kind"], first["part"], first["head"], first["element"], first["padding"], first["request"],
            first["token"], first["value"]) == ("nonfinite", "cache_k", 0, "nan", False, rid, int(token), int(slot))
    assert report.exit_code == summary.VIOLATIONS and not run.leftovers
