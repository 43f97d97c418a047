"""End to end: HiCache (`enable_hierarchical_cache`, io_backend "direct", layer_first) in the real
sglang Engine on the CPU, through the test-only shim tests/hicache_shim.py (loaded in the engine's
processes by the fault plugin, OOBGUARD_HICACHE_SHIM=1; its docstring says which CUDA-only parts it
stands in for). A 400-token prompt is evicted from the 768-slot device pool by four more and asked
again while another request decodes: loaded back from the host pool (`cached_tokens` 359 of 360)
beside a running request."""

from __future__ import annotations

import re

import pytest

from e2e.harness import reference_run, run_engine
from helpers import needs

pytestmark = pytest.mark.e2e

SHIM = {"OOBGUARD_HICACHE_SHIM": "1"}
STRICT = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1", **SHIM}
WARN = {**STRICT, "SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0"}
HELD = re.compile(r"oobguard_faultinject: HiCache load device_indices\[2\] -> (\d+) \(request runner token (\d+)")
# the guard's report of the held slot: what the load is for, the holder, the slot's history
HELD_REPORT = (r"load_to_device_per_layer \(HiCache host->device load\) device_indices layer 1: loc\[2\] = {slot}: a "
               r"HiCache load for tree node \d+ \(request again\) into a slot another running request holds; slot "
               r"{slot} is held by request runner token {token} \(pool MHATokenToKVPool\); request again; slot {slot} "
               r"last freed (?:at step \d+|before any forward step) by [^;]+, last allocated at step \d+ by ")


@pytest.fixture(autouse=True)
def _hicache():
    needs("MHATokenToKVPoolHost.load_to_device_per_layer")


@pytest.fixture(scope="module")
def reference(model):
    """The workload unguarded, through the shim (the clean matrix's run, tests/test_e2e_clean.py)."""
    run = reference_run(model, "hicache", (), SHIM)
    assert run.result["cached"][-1] == run.result["prompt"][-1] - 1  # the first prompt, loaded back from the host
    return run


def test_loads_into_a_slot_past_the_pool_and_into_a_running_requests_slot_are_reported_and_contained(model, reference):
    """One load-back, two stale device ids (the fault plugin's OOBGUARD_HICACHE_FAULT=high,held, at layer 1):
    one past the pool, one the slot the running request wrote at its last decode step. Warn mode reports
    both at the load, naming the tree node and request it loads for and the holder, and contains them:
    no torch error, and the running request's KV is kept (its tokens as without the faults)."""
    run = run_engine(model, {**WARN, "OOBGUARD_HICACHE_FAULT": "high,held"}, workload="hicache")
    assert "oobguard_faultinject: HiCache load device_indices[1] -> 772" in run.log, run.log[-3000:]
    held = HELD.search(run.log)
    assert held, run.log[-3000:]
    slot, token = held.groups()
    assert ("load_to_device_per_layer (HiCache host->device load) device_indices layer 1: 1 of 358 slot ids "
            "outside [0, 769): loc[1] = 772 (pool MHATokenToKVPool)") in run.log, run.log[-3000:]
    report = re.search(HELD_REPORT.format(slot=slot, token=token), run.log)
    assert report, run.log[-3000:]
    assert "out of bounds for dimension" not in run.log  # contained before torch's copy
    assert run.returncode == 0 and run.result["runner"] == reference.result["runner"], run.log[-3000:]
    assert run.result["runner_finish"] == reference.result["runner_finish"] and not run.leftovers
