"""End to end: HiCache (`enable_hierarchical_cache`, io_backend "direct", layer_first) in the real
sglang Engine on the CPU, through the test-only shim tests/hicache_shim.py (loaded in the engine's
processes by the fault plugin, OOBGUARD_HICACHE_SHIM=1; its docstring says which CUDA-only parts it
stands in for). A 400-token prompt is evicted from the 768-slot device pool by four more and asked
again: loaded back from the host pool (`cached_tokens` 359 of 360)."""

from __future__ import annotations

import pytest

from e2e.harness import run_engine
from helpers import needs

pytestmark = pytest.mark.e2e

SHIM = {"OOBGUARD_HICACHE_SHIM": "1"}
STRICT = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1", **SHIM}


@pytest.fixture(autouse=True)
def _hicache():
    needs("MHATokenToKVPoolHost.load_to_device_per_layer")


def test_backup_eviction_and_load_back_are_clean_and_unchanged_under_strict_liveness(model):
    reference = run_engine(model, SHIM, workload="hicache")
    assert reference.returncode == 0 and "outputs" in reference.result, reference.log[-3000:]
    assert reference.result["cached"][-1] == reference.result["prompt"][-1] - 1  # the first prompt, from the host
    run = run_engine(model, STRICT, workload="hicache")
    assert run.returncode == 0 and run.result == reference.result, run.log[-3000:]
    assert "sglang_oobguard active" in run.log and "KVOutOfBoundsError" not in run.log and not run.leftovers


def test_a_load_into_a_slot_past_the_pool_is_reported_at_the_load(model):
    run = run_engine(model, {**STRICT, "OOBGUARD_HICACHE_FAULT": "high"}, workload="hicache")
    assert "oobguard_faultinject: HiCache load device_indices[1] -> 772" in run.log, run.log[-3000:]
    assert ("KVOutOfBoundsError: load_to_device_per_layer (HiCache host->device load) device_indices layer 1: "
            "1 of 358 slot ids outside [0, 769): loc[1] = 772 (pool MHATokenToKVPool)") in run.log, run.log[-3000:]
    assert "out of bounds for dimension" not in run.log  # stopped before torch's copy
    assert run.result is None and run.returncode != 0 and not run.leftovers
