"""The clean matrix (the trust issue): every check on (strict + liveness + finite) over a
correct sglang on the CPU, in the configurations users run. Each row runs guard off and
guarded: the guarded run must report nothing, serve the unguarded run's tokens, and every
check that applies there must have counted work (the report folder's `counts` records,
summed by `report DIR`): a check that silently never ran fails its row.

Rows: page size 1 / 4 / 16 (in warn mode, where a false report would be contained: a
correct write sent to padding slot 0) / 64, radix cache on and off, the overlap scheduler on and off,
chunked prefill (and mixed with decodes), retraction (sglang's own test mode, and a pool
too small for what it admits), a sliding-window model at page 1 and 4, EAGLE and NGRAM,
two tensor-parallel ranks, PD disaggregation's decode side, HiCache; prompts on shared
prefixes whose lengths leave pages half filled. The PD pair over mooncake is
tests/test_e2e_pd_pair.py (two servers). Then a seeded random workload, over three seeds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from importlib.metadata import version
from typing import Callable

import pytest
from packaging.version import Version

from sglang_oobguard.checks.registry import UNITS

from e2e.harness import RETRACTED, Run, assert_radix_reused, reference_run, run_engine
from helpers import ROOT, has
from sglang_oobguard.report.summary import read

pytestmark = [pytest.mark.e2e, pytest.mark.matrix]

INSTALLED = {"OOBGUARD_SITE_DIR": str(ROOT)}  # the guard as a regular install arms it: its .pth (e2e/siteinstall)
EVERY = {"SGLANG_OOBGUARD_MODE": "strict", "SGLANG_OOBGUARD_LIVENESS": "1", "SGLANG_OOBGUARD_FINITE": "1",
         **({} if has("plugin loader") else INSTALLED)}  # before sglang's plugin loader (0.5.11): the .pth
CORE = ("bounds", "map", "owners", "liveness", "history", "reads", "ownids", "positions", "finite", "rows", "leaks")
if Version(version("sglang")).release[:3] < (0, 5, 23):  # a reach-back measurement (measure-map's sitecustomize)
    # ownids counts only writes whose ids are not the step's out_cache_loc; the older releases' torch_native
    # layers write with that tensor itself (0.5.12's runs counted none, 2026-12-07): nothing to count there
    CORE = tuple(check for check in CORE if check != "ownids")
SILENT = ("KVOutOfBoundsError", "bad KV slot ids", "internal error", "read check skipped", "write map not checked",
          "not finite", "freed while", "the owner check and the read check are off", "Traceback")
TIMEOUT = 300


def retracted(run: Run) -> None:
    assert sum(int(n) for n in RETRACTED.findall(run.log)) > 0, run.log[-3000:]


def swa_retracted(run: Run) -> None:
    assert "retract" in run.log.lower()  # the small pool made sglang retract, and evict SWA from the tree


def speculative(run: Run) -> None:
    assert run.result["spec_verify_ct"] > 0  # decoding was speculative


def moved(run: Run) -> None:
    """NGRAM moves the accepted drafts' KV (move_kv_cache, guarded); EAGLE topk 1 finds it in place."""
    assert run.tally(rank=0)["moves"] > 0, run.counts


def mixed(run: Run) -> None:
    assert re.search(r"Prefill batch[^\n]*#running-req: [1-9]", run.log), run.log[-3000:]  # chunks beside decodes


def two_ranks(run: Run, folder) -> None:
    ranks = sorted(p.activation["ranks"].get("tp_rank") for p in read(str(folder)).processes
                   if p.activation.get("role") == "run_scheduler_process" and p.counts.get("map", {}).get("steps"))
    assert ranks == [0, 1], ranks  # both schedulers checked steps


@dataclass(frozen=True)
class Row:
    id: str
    workload: str
    options: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)  # both runs' (a shim, sglang's test mode)
    model: str = "model"  # the session fixture: model (tiny Llama) or mellum (sliding window)
    checks: tuple[str, ...] = CORE  # each must count work in the guarded run
    expect: tuple[Callable[..., None], ...] = ()  # the row's own proof that its configuration happened
    mode: str = "strict"  # warn: a false report would be contained (a correct write sent to slot 0), and filed


SWA = {"OOBGUARD_SWA_READS": "1"}  # test-only: torch_native's SWA reads (tests/e2e/faultinject, swa.py)
MATRIX = [
    Row("page1-radix", "radix", expect=(assert_radix_reused,)),
    Row("page4-radix", "radix", ("page=4",), expect=(assert_radix_reused,)),
    Row("page16-radix-off-warn", "radix", ("page=16", "radix=off"), mode="warn"),
    Row("page64-overlap-off", "radix", ("page=64", "chunk=64", "pool=1024", "overlap=off")),
    Row("mixed-chunks", "mixed", ("page=4",), expect=(mixed,)),
    Row("retract-test-mode", "radix", ("page=4",), env={"SGLANG_TEST_RETRACT": "1"}, expect=(retracted,)),
    Row("retract-full-pool", "retract"),
    Row("swa-page1", "swa", ("page=1",), SWA, "mellum", (*CORE, "swa"), (swa_retracted,)),
    Row("swa-page4", "swa", ("page=4",), SWA, "mellum", (*CORE, "swa"), (swa_retracted,)),
    Row("eagle-radix", "radix", ("eagle",), expect=(speculative,)),
    Row("ngram-radix", "radix", ("ngram",), expect=(speculative, moved)),
    Row("tp2", "batch", ("tp=2",), expect=(two_ranks,)),
    Row("eagle-tp2", "batch", ("eagle", "tp=2"), expect=(speculative, two_ranks)),
    # PD decode keeps its rows in DecodeReqToTokenPool, which the row check does not track
    Row("pd-decode", "decode", checks=(*(check for check in CORE if check != "rows"), "pd")),
    Row("hicache", "hicache", env={"OOBGUARD_HICACHE_SHIM": "1"}, checks=(*CORE, "hicache")),
]


def tokens(workload: str, result: dict):
    """What must not change: the tokens (by rid where requests are keyed so)."""
    if workload == "hicache":
        return result
    return result["by_rid"] if "by_rid" in result else result["outputs"]


def guarded_clean(run: Run, folder, checks: tuple[str, ...], what: str) -> dict:
    """The guarded run served, reported nothing, and every check of `checks` counted work;
    returns the checks' totals."""
    assert run.returncode == 0 and run.result and not run.result.get("error"), f"{what}\n{run.log[-3000:]}"
    assert not run.result.get("errors"), (what, run.result["errors"])
    assert "sglang_oobguard active" in run.log, what
    said = [line for line in run.log.splitlines() if any(word in line for word in SILENT)]
    assert not said, (what, said[:5])
    assert not run.leftovers, what
    return counted(folder, checks, what)


def counted(folder, checks: tuple[str, ...], what: str) -> dict:
    """The report folder holds no violation, and every check of `checks` counted work there."""
    summary = read(str(folder))
    assert summary.exit_code == 0 and not summary.groups, (what, [g.first for g in summary.groups])
    totals = summary.totals()
    idle = [check for check in checks if not any(n for unit, n in totals.get(check, {}).items() if unit != "reports")]
    assert not idle, f"{what}: checks that never ran: {idle}; counted: {totals}"
    assert "leaks" not in checks or totals["leaks"].get("accounted"), (what, totals["leaks"])  # release completeness
    declared = {unit.name: {*unit.counts, "reports"} for unit in UNITS}  # what doctor says each check counts
    assert all(set(units) <= declared[check] for check, units in totals.items()), (what, totals)
    return totals


@pytest.mark.parametrize("row", MATRIX, ids=[row.id for row in MATRIX])
def test_every_check_on_a_correct_sglang_reports_nothing_and_changes_no_token(row, request, tmp_path):
    model = request.getfixturevalue(row.model)
    reference = reference_run(model, row.workload, row.options, row.env)
    assert "sglang_oobguard active" not in reference.log  # the guard-off control
    folder = tmp_path / "reports"
    run = run_engine(model, {**row.env, **EVERY, "SGLANG_OOBGUARD_MODE": row.mode,
                             "SGLANG_OOBGUARD_REPORT_DIR": str(folder)},
                     workload=row.workload, options=row.options, timeout=TIMEOUT, count=True)
    guarded_clean(run, folder, row.checks, row.id)
    assert tokens(row.workload, run.result) == tokens(row.workload, reference.result), row.id
    for expect in row.expect:
        expect(run, folder) if expect is two_ranks else expect(run)


@pytest.mark.parametrize("seed,env", [(1, {}), (2, {}), (3, {"SGLANG_TEST_RETRACT": "1"})], ids=["1", "2", "3-retract"])
def test_a_seeded_random_workload_is_clean_and_unchanged(model, seed, env, tmp_path):
    """tests/e2e/random_load.py: shared prefixes, random lengths and max_new_tokens, aborts in
    flight, a small pool. Every request that ran to its length in both runs has the same tokens."""
    how = f"seed {seed}: reproduce with `python tests/e2e/engine_run.py MODEL random {seed}`" + \
        (f" and {env}" if env else "")
    reference = reference_run(model, "random", (str(seed),), env)
    folder = tmp_path / "reports"
    run = run_engine(model, {**env, **EVERY, "SGLANG_OOBGUARD_REPORT_DIR": str(folder)}, workload="random",
                     options=(str(seed),), timeout=TIMEOUT)
    guarded_clean(run, folder, CORE, how)
    ours, theirs = run.result["by_rid"], reference.result["by_rid"]
    both = sorted(set(ours) & set(theirs))
    assert len(both) >= 12, (how, sorted(ours), sorted(theirs))
    assert {rid: ours[rid] for rid in both} == {rid: theirs[rid] for rid in both}, how
    if env:
        retracted(run)
