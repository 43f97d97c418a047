"""End to end: the real sglang 0.5.23 Engine on the CPU (tiny Llama, torch_native
attention), the guard loaded by sglang's own plugin loader in every process, and a
real stale slot id injected by a second plugin (tests/e2e/faultinject) on chosen
decode steps, between the allocator and the attention backend's KV write.

Four prompts run concurrently with greedy sampling, so a fault hits one request of
a batch of four: token 1 of the decode batch."""

from __future__ import annotations

import re

import pytest

from e2e.harness import run_engine, run_once
from sglang_oobguard.report import summary

pytestmark = pytest.mark.e2e

POOL_HIGH = 2049  # max_total_tokens 2048 + page_size 1
ACTIVE = re.compile(r"sglang_oobguard active \(pid (\d+)\): mode=(\w+)")


def injected(run) -> list[str]:
    return [line for line in run.log.splitlines() if line.startswith("oobguard_faultinject: step")]


def test_guard_on_without_fault_changes_nothing_and_activates_in_the_scheduler(model, clean):
    run = run_engine(model, {"SGLANG_ENABLE_ASYNC_ASSERT": "1"})
    assert run.returncode == 0 and run.result["outputs"] == clean, run.log[-3000:]
    pids = {int(pid) for pid, mode in ACTIVE.findall(run.log) if mode == "strict"}
    assert len(pids) >= 2, run.log[-3000:]  # the engine's process and its scheduler (and detokenizer)
    assert "bad KV slot ids" not in run.log and not run.leftovers


def test_baseline_unguarded_too_high_id_crashes_the_engine_far_from_its_cause(model):
    run = run_engine(model, {"OOBGUARD_FAULT": "step=3,token=1,value=high+3"})
    assert len(injected(run)) == 1, run.log[-3000:]
    assert run.result is None and run.returncode != 0  # sglang kills the whole process tree
    assert f"IndexError: index {POOL_HIGH + 3} is out of bounds for dimension 0 with size {POOL_HIGH}" in run.log
    assert "sglang_oobguard" not in run.log and not run.leftovers


def test_baseline_unguarded_minus_one_is_silent_corruption(model, clean):
    run = run_engine(model, {"OOBGUARD_FAULT": "step=3,token=1,value=-1"})
    assert len(injected(run)) == 1
    assert run.returncode == 0 and "outputs" in run.result, run.log[-3000:]  # no error anywhere
    assert "Error" not in run.log.split(injected(run)[0])[1]
    outputs = run.result["outputs"]
    # request 1's token went to the pool's last row; its own slot kept stale KV
    assert [i for i, (got, want) in enumerate(zip(outputs, clean)) if got != want] == [1]


@pytest.mark.parametrize("mode,value", [("strict", "high+3"), ("raise", "-1")])
def test_strict_and_raise_fail_the_engine_with_the_full_report(model, mode, value):
    run = run_once(model, {"SGLANG_OOBGUARD_MODE": mode, "OOBGUARD_FAULT": f"step=3,token=1,value={value}"})
    assert len(injected(run)) == 1, run.log[-3000:]
    bad = POOL_HIGH + 3 if value == "high+3" else -1
    report = (f"KVOutOfBoundsError: out_cache_loc (forward step): 1 of 4 slot ids outside [0, {POOL_HIGH}): "
              f"loc[1] = {bad} (pool MHATokenToKVPool)")  # the step's check, before any layer
    assert report in run.log, run.log[-3000:]
    assert run.result is None and run.returncode != 0  # reported, not hung
    assert "out of bounds for dimension" not in run.log  # stopped before torch's write
    assert not run.leftovers


def test_warn_serves_every_request_keeps_the_others_intact_and_rate_limits(model, clean, tmp_path):
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "3600",
                             "OOBGUARD_FAULT": "step=3-6,token=1,value=high+3",
                             "SGLANG_OOBGUARD_REPORT_DIR": str(tmp_path)})
    assert len(injected(run)) == 4, run.log[-3000:]
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    outputs = run.result["outputs"]
    assert all(len(tokens) == 16 for tokens in outputs)
    differ = [i for i, (got, want) in enumerate(zip(outputs, clean)) if got != want]
    assert differ in ([], [1]), (outputs, clean)  # only the faulted request may differ
    warnings = [line for line in run.log.splitlines() if "sglang_oobguard: bad KV slot ids" in line]
    assert len(warnings) == 1, warnings  # four faulted steps, one line: rate-limited
    assert f"out_cache_loc (forward step): 1 of 4 slot ids outside [0, {POOL_HIGH}): loc[1] = {POOL_HIGH + 3}" \
        in warnings[0]
    assert not run.leftovers
    # the report folder: every process of the engine filed its activation, the scheduler each fault
    report = summary.read(str(tmp_path))
    roles = {p.activation["role"]: p for p in report.processes}
    assert {None, "run_scheduler_process", "run_detokenizer_process"} <= roles.keys(), roles.keys()
    scheduler = roles["run_scheduler_process"]
    # one report per faulted step, the step's check of out_cache_loc: its cleaned ids are what the
    # forward's layers write with (sglang copies the batch's ids into a buffer of its own before they run)
    assert scheduler.activation["ranks"] == {"tp_rank": 0, "pp_rank": 0} and scheduler.reports == 4
    assert [p for p in report.processes if p.reports] == [scheduler]
    assert {(g.label, g.pool, g.layer, g.reports) for g in report.groups} == {
        ("out_cache_loc (forward step)", "MHATokenToKVPool", -1, 4)}
    assert all(g.first["violation"]["value"] == POOL_HIGH + 3 for g in report.groups)
    assert report.exit_code == summary.VIOLATIONS


def test_http_server_generates_with_the_guard_on_and_shuts_down_cleanly(model, tmp_path):
    from e2e.harness import serve_once

    run = serve_once(model, {"SGLANG_ENABLE_ASYNC_ASSERT": "1"}, tmp_path / "server.log")
    assert run.result and len(run.result["output_ids"]) == 8, run.log[-3000:]
    assert run.returncode == 0  # a clean shutdown, not sglang's crash path
    assert len({pid for pid, _ in ACTIVE.findall(run.log)}) >= 2, run.log[-3000:]
    assert "bad KV slot ids" not in run.log
    assert not run.leftovers


LIVE = {"SGLANG_OOBGUARD_LIVENESS": "1"}


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_liveness_catches_a_slot_freed_while_its_request_decodes(model, mode):
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0", **LIVE,
                             "OOBGUARD_FAULT": "step=3,token=1,value=freed"})
    (line,) = injected(run)
    slot = int(re.search(r"out_cache_loc (\d+) freed", line).group(1))
    report = f"out_cache_loc (forward step): loc[1] = {slot} is not allocated (freed) (pool MHATokenToKVPool)"
    # the report names where the slot was freed: the fault's free, before this step began
    history = re.search(rf"{re.escape(report)}; step (\d+) [^\n]*; slot {slot} last freed at step (\d+) by [^\n]*"
                        r"> _free_one \(__init__\.py:\d+\) > TokenToKVPoolAllocator\.free, last allocated at step "
                        r"\d+ by [^\n]*alloc_for_decode[^\n]*TokenToKVPoolAllocator\.alloc \(generation \d+\)", run.log)
    assert history and int(history.group(2)) == int(history.group(1)) - 1, run.log[-3000:]
    if mode == "warn":  # served; the write contained; the request's own free later is a double free
        assert run.returncode == 0 and run.result and len(run.result["outputs"]) == 4, run.log[-3000:]
        assert f"write contained (the write got a copy with those ids sent to padding slot 0): {report}" in run.log
        # the request's own free of the slot, when it came before the engine shut down (the result is streamed
        # first: under load the shutdown can win), is a double free
        frees = re.findall(rf"free \(TokenToKVPoolAllocator\): free_index\[\d+\] = {slot} is not allocated \((\w+ ?\w*)\)",
                           run.log)
        assert set(frees) <= {"double free"}, run.log[-3000:]
        assert "memory leak" not in run.log  # the double free was contained: sglang's own pool census holds
    else:
        assert f"KVOutOfBoundsError: {report}" in run.log, run.log[-3000:]
        assert run.result is None and run.returncode != 0
    assert not run.leftovers


FAULTED = re.compile(r"oobguard_faultinject: step (\d+) token (\d+) of (\d+): out_cache_loc \d+ -> (-?\d+) "
                     r"\(pid \d+; mode (\w+) rid (\S+) token (\d+)\)")


@pytest.mark.parametrize("mode", ["strict", "warn"])
def test_the_report_names_the_request_its_token_the_forward_mode_and_the_step(model, mode):
    """The injector corrupts out_cache_loc at decode step 3 and says whose token it was;
    the guard's report, read from the forward step's layout, names the same."""
    run = run_once(model, {"SGLANG_OOBGUARD_MODE": mode, "OOBGUARD_FAULT": "step=3,token=1,value=high+3"})
    (fault,) = FAULTED.findall(run.log)
    step, token, size, value, forward, rid, index = fault
    assert (step, token, forward) == ("3", "1", "decode")
    where = f"step {step} ({forward}, batch {size}); request {rid} token {index}; tp 0"
    reports = [line for line in run.log.splitlines() if f"loc[1] = {value}" in line and "(pool MHATokenToKVPool)" in line]
    assert reports and all(where in line for line in reports), run.log[-3000:]
    if mode == "strict":
        assert run.result is None and run.returncode != 0
    else:
        assert run.returncode == 0 and run.result and len(run.result["outputs"]) == 4
    assert not run.leftovers


def test_each_ids_tensor_is_probed_once_per_forward_step_not_once_per_layer(tmp_path_factory):
    """A 6-layer model: every layer writes its K/V through set_kv_buffer. The guard
    probes out_cache_loc once at the step's start; the ids the layers write with (sglang
    0.5.23's CPU path hands the backend a copy of out_cache_loc in a persistent buffer,
    another tensor) are the step's slots, so the step check answers for them
    (`ownids.covers`): 1 probe per step, where the layers made 6 writes."""
    from e2e.tiny_model import build_tiny_llama

    deep = build_tiny_llama(tmp_path_factory.mktemp("tiny-llama-6"), layers=6)
    run = run_engine(deep, {"SGLANG_OOBGUARD_MODE": "strict"}, count=True)
    assert run.returncode == 0 and run.result and "outputs" in run.result, run.log[-3000:]
    tally = run.tally(rank=0)
    assert tally["steps"] > 10 and tally["writes"] == 6 * tally["steps"], tally
    assert tally["probes"] == tally["steps"], tally  # 2 per step without covers, 7 without the memo
    assert not run.leftovers


def test_intel_amx_decode_writes_kv_inside_attention_and_the_step_check_sees_it(model):
    """On intel_amx, decode writes K/V inside its attention op, never through a pool
    method: only the forward step's check of out_cache_loc sees those ids."""
    clean = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict"}, options=("amx",), count=True)
    assert clean.returncode == 0 and clean.result and "outputs" in clean.result, clean.log[-3000:]
    tally = clean.tally(rank=0)
    # decode steps wrote no pool method (the prefill step's 2 layers did), yet every step was probed
    assert tally["writes"] == 2 and tally["probes"] >= tally["steps"] > 10, tally
    run = run_engine(model, {"SGLANG_OOBGUARD_MODE": "strict", "OOBGUARD_FAULT": "step=3,token=1,value=high+3"},
                     options=("amx",))
    assert len(injected(run)) == 1, run.log[-3000:]
    assert (f"KVOutOfBoundsError: out_cache_loc (forward step): 1 of 4 slot ids outside [0, {POOL_HIGH}): "
            f"loc[1] = {POOL_HIGH + 3} (pool MHATokenToKVPool); step 3 (decode, batch 4)") in run.log, run.log[-3000:]
    assert run.result is None and run.returncode != 0 and not run.leftovers
