"""End to end where slot ids move fastest: speculative decoding and two tensor-parallel
ranks, in sglang 0.5.23's real Engine on the CPU (the tiny Llama, greedy), the guard
loaded by sglang's plugin loader in every process, strict mode with liveness on.

Speculative decoding hands out draft slots, frees the rejected ones and moves the
accepted ones' KV (`move_kv_cache`), so a liveness false positive would show here.
EAGLE (topk 1, the tiny model as its own draft) and NGRAM run on the `intel_amx`
attention backend with the test-only stand-ins of its CPU ops (tests/standins/
sgl_kernel; tests/test_standins.py). Their attention makes the same SDPA call as the
plain runs' torch_native backend, so a speculative run must give exactly the plain,
unguarded run's tokens. The fault plugin (tests/e2e/faultinject) counts the calls of
the guarded methods in each process, so that a clean run is not a vacuous one.
"""

from __future__ import annotations

import re

import pytest

from e2e.harness import Run, assert_radix_reused, run_engine

pytestmark = pytest.mark.e2e

STRICT_LIVE = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1"}
ACTIVE = re.compile(r"sglang_oobguard active \(pid (\d+)\): mode=strict, .*liveness=on")
VIOLATION = ("KVOutOfBoundsError", "bad KV slot ids", "not allocated", "sglang_oobguard: writes contained")


def assert_clean(run: Run, reference: list) -> None:
    """Served, the reference's tokens, nothing reported, nothing left running."""
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    assert run.result["outputs"] == reference
    assert not [word for word in VIOLATION if word in run.log], run.log[-3000:]
    assert not run.leftovers


@pytest.mark.parametrize("algorithm", ["eagle", "ngram"])
def test_speculative_decoding_over_the_radix_workload_is_clean_and_counted(model, radix_clean, algorithm):
    """44 requests, radix cache, 32-token chunks, slots evicted and handed out again,
    and every decode step a draft-verify round: the plain run's tokens, no violation."""
    run = run_engine(model, STRICT_LIVE, workload="radix", options=(algorithm,), count=True)
    assert_clean(run, radix_clean)
    assert run.result["spec_verify_ct"] > 0  # decoding was speculative
    assert_radix_reused(run)
    assert ACTIVE.search(run.log)
    tally = run.tally(rank=0)
    assert tally["writes"] > 0 and tally["frees"] > 0, tally
    if algorithm == "ngram":  # NGRAM moves the accepted drafts' KV; EAGLE topk 1 finds it in place
        assert tally["moves"] > 0, tally
