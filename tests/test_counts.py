"""Every check counts what it did (the trust issue): per process, the steps, writes, frees
and hand-outs each check looked at and the reports it made, filed in the report folder
(when sglang's scheduler idles, and a final record at exit), summed by `report DIR`, and
said in one log line at exit. A check that is on and never ran shows as a zero."""

from __future__ import annotations

import json

import pytest
import torch

import sglang_oobguard
from helpers import GUARDED_WRITE, mha, run_python, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.violation import CHECK_OF, Kind
from test_report_dir import report


def test_every_kind_of_report_belongs_to_a_check():
    from sglang_oobguard.model.switches import NAMES

    assert {kind.name.lower() for kind in Kind} == set(CHECK_OF)
    assert set(CHECK_OF.values()) <= set(NAMES)


def test_writes_frees_hand_outs_and_reports_are_counted_per_check(mp, guard):
    from sglang.srt.mem_cache import allocator
    from helpers import Layer

    guard("strict", liveness=True)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    counts = sglang_oobguard.activate.instrument._active.guard.counts
    slots = alloc.alloc(4)
    k = torch.ones(4, 2, 4)
    pool.set_kv_buffer(Layer(0), slots, k, k)
    alloc.free(slots[:2])
    try:
        alloc.free(slots[:1])  # a double free: reported by liveness
    except KVOutOfBoundsError:
        pass
    got = counts.snapshot(("bounds", "map", "reads"))
    assert got["liveness"] == {"writes": 1, "frees": 2, "allocs": 1, "reports": 1}, got
    assert got["bounds"] == {"writes": 1} and got["history"] == {"events": 3}
    assert got["map"] == {} and got["reads"] == {}  # on, never ran here: listed as zeros


ENGINE_LIKE = GUARDED_WRITE + """
from sglang.srt.managers import scheduler
from sglang_oobguard.model.discover import defining
from sglang_oobguard.model.targets import IDLE_HOOK
owner, method = defining(scheduler.Scheduler, IDLE_HOOK.methods)
owner.__dict__[method]._self_wrapper(lambda: None, None, (), dict())  # the installed hook, over an idle that does nothing
print("IDLE", owner.__name__, method)
import os
os._exit(0) if {killed} else None
"""


def test_counts_are_filed_when_the_scheduler_idles_and_at_exit(tmp_path):
    """A killed scheduler (sglang's shutdown) leaves its idle record; an exit adds the final one."""
    try:
        import sglang.srt.managers.scheduler  # noqa: F401
    except Exception as exc:  # the older cells' venvs hold the pools' dependencies, not the scheduler's
        pytest.skip(f"sglang's scheduler does not import here: {type(exc).__name__}: {exc}")
    for killed in (True, False):
        folder = tmp_path / f"killed-{killed}"
        done = run_python(ENGINE_LIKE.format(ids=[5, 6], killed=killed),
                          {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_REPORT_DIR": str(folder)})
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.startswith("IDLE "), done.stdout  # the hook ran, on whichever class defines the idle
        (path,) = folder.iterdir()
        filed = [json.loads(line) for line in path.read_text().splitlines() if '"counts"' in line]
        assert [record["final"] for record in filed] == ([False] if killed else [False, True]), filed
        assert filed[-1]["counts"]["bounds"] == {"writes": 1}
        assert ("checked in this process" in done.stderr) is not killed
        summary = report(folder)
        assert "checked (all processes): bounds: 0 steps" not in summary.stdout
        assert "checked (all processes): bounds: 1 writes" in summary.stdout, summary.stdout


def test_while_steps_run_counts_are_filed_at_most_once_a_second(mp, guard, monkeypatch, tmp_path):
    """A scheduler that sglang kills right after its last step keeps what it counted up to its
    last filing: at a step's end, once COUNTS_EVERY_S has passed and something changed."""
    from sglang_oobguard.checks import flush

    monkeypatch.setenv("SGLANG_OOBGUARD_REPORT_DIR", str(tmp_path))
    guard("strict")
    active = sglang_oobguard.activate.instrument._active.guard
    pool = mha(mp, 64)
    k = torch.ones(1, 2, 4)
    from helpers import Layer

    filed = lambda: [json.loads(line) for path in tmp_path.iterdir() for line in path.read_text().splitlines()
                     if '"counts"' in line]
    for _ in range(3):  # three step ends within a second: one filing
        pool.set_kv_buffer(Layer(0), torch.tensor([5]), k, k)
        flush.file_counts_while_busy(active)
    assert [record["counts"]["bounds"] for record in filed()] == [{"writes": 1}]
    active.counts.due = 0.0  # a second later
    flush.file_counts_while_busy(active)
    assert [record["counts"]["bounds"] for record in filed()] == [{"writes": 1}, {"writes": 3}]
