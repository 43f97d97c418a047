"""The write map and owner check (sglang_oobguard.model.writemap, .stepkernel) on sglang's real
ReqToTokenPool and ForwardBatch: the host check and the step kernel (Triton's interpreter
here) against an oracle, for random batches of each forward mode with injected faults;
EAGLE's draft lanes for topk > 1 against the source's own kernel; the owner lookup."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from helpers import model_runner_class
from sglang_oobguard.probes import hostmap, shadow, stepkernel
from sglang_oobguard.checks import owners
from sglang_oobguard.model import writemap
from sglang_oobguard.probes.record import RECORD_LEN, Kind, Record
from sglang_oobguard.model.maptargets import HICACHE, PD_DECODE, SLIDING, SPECULATIVE, WRITE_MAP_MEASURED
from sglang_oobguard.model.targets import write_map_off

pytestmark = pytest.mark.skipif(write_map_off() is not None, reason=str(write_map_off()))
# An older release measured without speculative forwards (0.5.12): the map leaves them out, and
# the draft and verify layouts below (and draft extend v2's) are facts of 0.5.23, the release measured.
SPEC_UNMEASURED = writemap.UNMEASURED.get(SPECULATIVE)
speculative = pytest.mark.skipif(SPEC_UNMEASURED is not None, reason=f"the write map's speculative layouts were "
                                 f"measured on sglang 0.5.23 only: {SPECULATIVE}, {SPEC_UNMEASURED}")

ROWS, COLS, HIGH = 12, 48, 1200


def req_pool(rng: random.Random):
    """sglang's ReqToTokenPool, every (row, position) a distinct slot in [1, HIGH)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    pool = ReqToTokenPool(size=ROWS - 1, max_context_len=COLS, device="cpu", enable_memory_saver=False)
    if pool.req_to_token.shape[0] < ROWS:  # an older release (0.5.10): `size` rows, no padding row after them
        pool = ReqToTokenPool(size=ROWS, max_context_len=COLS, device="cpu", enable_memory_saver=False)
    slots = list(range(1, HIGH))
    rng.shuffle(slots)
    pool.req_to_token.copy_(torch.tensor(slots[:ROWS * COLS], dtype=torch.int32).view(ROWS, COLS))
    return pool


def model_runner(pool, draft=False, topk=1, steps=3, page=1):
    """sglang's ModelRunner, not loaded: only what the write map reads (server_args: the two
    speculative settings, a namespace)."""
    ModelRunner = model_runner_class()

    runner = ModelRunner.__new__(ModelRunner)
    runner.req_to_token_pool, runner.is_draft_worker, runner.page_size = pool, draft, page
    runner.server_args = SimpleNamespace(speculative_eagle_topk=topk, speculative_num_steps=steps)
    return runner


def forward_batch(mode, rows, seq_lens, loc, **extra):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    size = len(rows)
    batch = ForwardBatch(forward_mode=getattr(ForwardMode, mode), batch_size=size,
                         input_ids=torch.zeros(loc.numel(), dtype=torch.int64),
                         req_pool_indices=torch.tensor(rows, dtype=torch.int64),
                         seq_lens=torch.tensor(seq_lens, dtype=torch.int64), out_cache_loc=loc,
                         seq_lens_sum=sum(seq_lens))
    for name, value in extra.items():
        setattr(batch, name, value)
    batch.rids = [f"rid{r}" for r in rows]
    return batch


def oracle_positions(family, rows, seq_lens, extend=None, width=1, steps=3):
    """(row index, position) per token, written out from write-map.md."""
    out = []
    if family == "extend":
        for r, (prefix, count) in enumerate(extend):
            out += [(r, prefix + j) for j in range(count)]
    elif family == "decode":
        out = [(r, s - 1) for r, s in enumerate(seq_lens)]
    elif family == "verify":
        out = [(r, s + j) for r, s in enumerate(seq_lens) for j in range(width)]
    else:  # draft decode, page 1: lane k at seq_len + k * steps + s (s: the draft step)
        out = [(r, s + k * steps + extend) for r, s in enumerate(seq_lens) for k in range(width)]
    return out


def make_case(rng: random.Random, family: str):
    """A clean random batch of that family: (batch, runner, pool, positions)."""
    pool = req_pool(rng)
    size = rng.randint(1, 6)
    rows = rng.sample(range(1, ROWS), size)
    if family == "extend":
        extend = [(rng.randint(0, 20), rng.randint(0 if i else 1, 8)) for i in range(size)]
        seq_lens = [p + c for p, c in extend]
        pos = oracle_positions(family, rows, seq_lens, extend)
        counts = [c for _, c in extend]
        starts = np.concatenate([[0], np.cumsum(counts)[:-1]]).tolist()
        extra = dict(extend_prefix_lens=torch.tensor([p for p, _ in extend], dtype=torch.int32),
                     extend_seq_lens=torch.tensor(counts, dtype=torch.int32),
                     extend_start_loc=torch.tensor(starts, dtype=torch.int32))
        mode, runner = rng.choice(["EXTEND", "MIXED", "DRAFT_EXTEND_V2"]), model_runner(pool)
        if SPEC_UNMEASURED is not None and mode == "DRAFT_EXTEND_V2":  # the same draws: an extend instead
            mode = "EXTEND"
    elif family == "decode":
        seq_lens = [rng.randint(1, COLS) for _ in range(size)]
        pos, extra, mode, runner = oracle_positions(family, rows, seq_lens), {}, "DECODE", model_runner(pool)
    elif family == "verify":
        width = rng.randint(2, 6)
        seq_lens = [rng.randint(1, COLS - width) for _ in range(size)]
        pos = oracle_positions(family, rows, seq_lens, width=width)
        extra, mode, runner = dict(spec_info=SimpleNamespace(draft_token_num=width)), "TARGET_VERIFY", model_runner(pool)
    else:  # draft decode (topk 1 and > 1, page 1)
        topk, steps = rng.choice([1, 2, 4]), rng.randint(2, 4)
        step = rng.randint(0, steps - 2)
        seq_lens = [rng.randint(1, COLS - topk * steps) for _ in range(size)]
        pos = oracle_positions(family, rows, seq_lens, extend=step, width=topk, steps=steps)
        positions = torch.tensor([s + step for s in seq_lens for _ in range(topk)], dtype=torch.int64)
        extra, mode = dict(positions=positions), "DECODE"
        runner = model_runner(pool, draft=True, topk=topk, steps=steps)
    table = pool.req_to_token
    loc = torch.tensor([int(table[rows[r], p]) for r, p in pos], dtype=torch.int64)
    return forward_batch(mode, rows, seq_lens, loc, **extra), runner, pool, pos


FAULTS = ("none", "cross", "dup", "shared", "bounds", "owned", "freed")


def inject(rng, fault, batch, pool, pos, live):
    """One fault in a clean case; returns the token index it hit (or None)."""
    loc, n = batch.out_cache_loc, batch.out_cache_loc.numel()
    table = pool.req_to_token
    if not n or fault == "none":
        return None
    i = rng.randrange(n)
    if fault == "cross":  # another row's slot (a row not in the batch, or another request's)
        loc[i] = int(table[rng.choice([r for r in range(ROWS) if r != int(batch.req_pool_indices[pos[i][0]])]),
                           rng.randrange(COLS)])
    elif fault == "dup" and n > 1:  # two tokens, one slot, and sglang's table agrees (a twin in one step)
        j = rng.choice([j for j in range(n) if j != i])
        i, j = max(i, j), min(i, j)
        row, p = pos[i]
        table[int(batch.req_pool_indices[row]), p] = int(loc[j])
        loc[i] = loc[j]
    elif fault == "shared" and batch.batch_size > 1:
        r = rng.randrange(1, batch.batch_size)
        batch.req_pool_indices[r] = batch.req_pool_indices[rng.randrange(r)]
        table_rows = batch.req_pool_indices
        # the tokens keep sglang's table's slots for the shared row, so only the shared row is wrong
        for t, (row, p) in enumerate(pos):
            loc[t] = int(table[int(table_rows[row]), p])
    elif fault == "bounds":
        loc[i] = rng.choice([-1, HIGH, HIGH + 7])
    elif fault == "owned":  # another running row owns the token's page already
        live.owner[int(loc[i])] = ROWS + 3
    elif fault == "freed":
        live.flags[int(loc[i])] = 0
    return i


def run_both(batch, runner, live_host, live_kernel):
    rule = writemap.rule_of(batch, runner)
    assert not isinstance(rule, str), rule
    finding, cleaned, _ = hostmap.check_host(rule, HIGH, live_host)
    record = torch.zeros(RECORD_LEN, dtype=torch.int64)
    step = torch.tensor([7])
    tables = stepkernel.new_tables(HIGH, ROWS, torch.device("cpu"))
    tables.slot_stamps.fill_((5 << 32) + 3)  # an earlier step's stamps: never read as this step's
    tables.row_stamps.fill_((5 << 32) + 3)
    clean = torch.empty_like(rule.ids)
    stepkernel.launch(rule, HIGH, 3, -1, record, step, tables, live_kernel, clean, None)
    return finding, cleaned, Record(*record.tolist()), clean


def live_for(pool, batch, with_owner):
    live = shadow.new_live(HIGH, 1, torch.device("cpu"))
    live.flags[pool.req_to_token.reshape(-1).long()] = 1  # every slot of the table is handed out
    return live if with_owner else live._replace(owner=None)


@pytest.mark.parametrize("family", ["extend", "decode", pytest.param("verify", marks=speculative),
                                    pytest.param("draft", marks=speculative)])
def test_kernel_and_host_find_the_same_violation_and_clean_the_same(family):
    rng = random.Random(f"writemap-{family}")
    seen = set()
    for case in range(40):
        batch, runner, pool, pos = make_case(rng, family)
        fault = FAULTS[case % len(FAULTS)]
        liveness = fault in ("owned", "freed") or rng.random() < 0.5
        live_h = live_for(pool, batch, liveness) if liveness else None
        hit = inject(rng, fault, batch, pool, pos, live_h)
        live_k = None if live_h is None else shadow.Live(live_h.flags.clone(), 1, None,
                                                        None if live_h.owner is None else live_h.owner.clone())
        finding, cleaned, record, clean = run_both(batch, runner, live_h, live_k)
        loc = batch.out_cache_loc
        if hit is None or (fault == "dup" and loc.numel() < 2) or (fault == "shared" and batch.batch_size < 2):
            assert finding is None and record.calls == 0, (family, fault, finding, record)
            assert torch.equal(clean, loc)
            continue
        assert finding is not None, (family, fault)
        want = {"cross": Kind.OTHER_REQUEST, "dup": Kind.DUPLICATE, "shared": Kind.SHARED_ROW,
                "bounds": Kind.BOUNDS, "owned": Kind.OWNED, "freed": Kind.FREED}[fault]
        assert finding.kind == want, (family, fault, finding)
        seen.add(fault)
        # the kernel's record: the same first bad token, kind, row, expected and owner
        assert record.calls == 1 and record.step == 7
        assert (record.kind, record.bad, record.pos, record.value, record.row, record.expected, record.owner) == (
            finding.kind, finding.bad, finding.pos, finding.value, finding.row, finding.expected, finding.owner), \
            (family, fault, record, finding)
        assert torch.equal(clean, cleaned) and int(cleaned[finding.pos]) == 0
        if live_h is not None and live_h.owner is not None:  # both claimed the same pages for the same rows
            assert torch.equal(live_h.owner, live_k.owner)
    assert seen == {"cross", "dup", "shared", "bounds", "owned", "freed"}, seen


def test_owner_is_claimed_by_the_first_writer_and_a_second_row_is_owned():
    rng = random.Random(1)
    batch, runner, pool, pos = make_case(rng, "decode")
    live = live_for(pool, batch, True)
    rule = writemap.rule_of(batch, runner)
    assert hostmap.check_host(rule, HIGH, live)[0] is None
    rows = batch.req_pool_indices.tolist()
    assert [int(live.owner[int(s)]) for s in batch.out_cache_loc] == [r + 1 for r in rows]
    live.owner[int(batch.out_cache_loc[0])] = 0  # the free cleared it: the next writer claims it
    assert hostmap.check_host(rule, HIGH, live)[0] is None
    shadow.release(live, batch.out_cache_loc[:1])
    assert int(live.owner[int(batch.out_cache_loc[0])]) == 0 and int(live.flags[int(batch.out_cache_loc[0])]) == 0


@speculative
def test_draft_lanes_for_topk_above_one_follow_sglangs_own_cache_loc_kernel():
    """EAGLE's draft decode with topk > 1 (the CPU engine runs topk 1 only): out_cache_loc
    is built here by sglang's own Triton kernel (assign_draft_cache_locs_contiguous, in the
    interpreter) and sliced per step with sglang's per_step_draft_out_cache_loc, as
    EagleDraftWorker.draft_forward does; positions as prepare_for_draft sets them."""
    from sglang.kernels.ops.speculative.cache_locs import assign_draft_cache_locs_contiguous
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    rng = random.Random(2)
    pool = req_pool(rng)
    topk, steps, rows, seq_lens = 3, 4, [4, 9, 2], [5, 17, 30]
    rpi, seq = torch.tensor(rows), torch.tensor(seq_lens)
    whole = torch.empty(len(rows) * topk * steps, dtype=torch.int64)
    assign_draft_cache_locs_contiguous[(len(rows),)](rpi, pool.req_to_token, seq, whole, pool.req_to_token.shape[1],
                                                     topk, steps, BS=len(rows))
    per_step = per_step_draft_out_cache_loc(whole, len(rows), topk, steps)
    runner = model_runner(pool, draft=True, topk=topk, steps=steps)
    for s in range(steps - 1):
        positions = seq.repeat_interleave(topk) + s
        batch = forward_batch("DECODE", rows, seq_lens, per_step[s], positions=positions)
        rule = writemap.rule_of(batch, runner)
        assert rule.family == "draft" and rule.ids.stride(0) != 1 or topk == 1  # a strided view, as sglang's
        finding, _, _ = hostmap.check_host(rule, HIGH)
        assert finding is None, (s, finding)
        _, _, record, _ = run_both(batch, runner, None, None)
        assert record.calls == 0, (s, record)
        # the plain decode rule would fail on every token
        plain = writemap.rule_of(batch, model_runner(pool, draft=False))
        assert plain == f"decode: out_cache_loc has {topk * len(rows)} ids for a batch of {len(rows)}"


@speculative
def test_draft_lanes_with_pages_follow_prepare_for_drafts_paged_layout():
    """page > 1 with topk > 1: eagle_worker_common.prepare_for_draft's gather (the source,
    written out here: its torch code inline in that function): branch k of row r starts
    at seq + k * ceil((seq % page + steps) / page) * page."""
    rng = random.Random(3)
    pool = req_pool(rng)
    topk, steps, page, rows, seq_lens = 2, 3, 4, [3, 7], [5, 10]
    seq = torch.tensor(seq_lens)
    last_page = seq % page
    prefix_base = seq - last_page
    num_new_pages = (last_page + steps + page - 1) // page
    starts = prefix_base.view(-1, 1) + torch.arange(topk).view(1, topk) * (num_new_pages.view(-1, 1) * page) \
        + last_page.view(-1, 1)
    pos = (starts.view(len(rows), topk, 1) + torch.arange(steps).view(1, 1, steps)).reshape(len(rows), -1)
    whole = torch.gather(pool.req_to_token[torch.tensor(rows)].long(), 1, pos).reshape(-1).contiguous()
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    per_step = per_step_draft_out_cache_loc(whole, len(rows), topk, steps)
    runner = model_runner(pool, draft=True, topk=topk, steps=steps, page=page)
    for s in range(steps - 1):
        batch = forward_batch("DECODE", rows, seq_lens, per_step[s], positions=seq.repeat_interleave(topk) + s)
        assert hostmap.check_host(writemap.rule_of(batch, runner), HIGH)[0] is None
        assert run_both(batch, runner, None, None)[2].calls == 0


@speculative
def test_padding_is_exempt_by_count_and_row_zero_is_not_assumed_zero():
    rng = random.Random(4)
    batch, runner, pool, pos = make_case(rng, "verify")
    pool.req_to_token[0].fill_(5)  # row 0 (padding's row) holds ids: nothing may rely on it being 0
    width = batch.spec_info.draft_token_num
    real = batch.out_cache_loc.numel()
    rule = writemap.rule_of(batch, runner)
    padded = rule._replace(ids=torch.cat([rule.ids, torch.zeros(width, dtype=torch.int64)]),
                           rows=torch.cat([rule.rows, torch.zeros(1, dtype=torch.int64)]),
                           seq_lens=torch.cat([rule.seq_lens, torch.ones(1, dtype=torch.int64)]))
    padded = padded._replace(virtual=padded.ids)
    assert padded.ids.numel() == real + width
    assert hostmap.check_host(padded, HIGH)[0] is None
    record = torch.zeros(RECORD_LEN, dtype=torch.int64)
    tables = stepkernel.new_tables(HIGH, ROWS, torch.device("cpu"))
    stepkernel.launch(padded, HIGH, 0, -1, record, torch.tensor([1]), tables, None, None, None)
    assert record[1] == 0


def test_find_owner_names_the_batch_request_first_then_any_row():
    rng = random.Random(5)
    pool = req_pool(rng)
    table = pool.req_to_token
    slot = int(table[6, 3])
    assert owners.find_owner(table, torch.tensor([2, 6]), ["a", "b"], slot) == ("b", 3)
    assert owners.find_owner(table, torch.tensor([2]), ["a"], slot) == ("req_to_token row 6", 3)
    table[2, 9] = slot  # a twin: both hold it; the writer's own entry is skipped, the owner row preferred
    assert owners.find_owner(table, torch.tensor([2, 6]), ["a", "b"], slot, prefer=6, skip=(2, 9)) == ("b", 3)
    assert owners.find_owner(table, torch.tensor([2]), ["a"], HIGH + 5) is None


def test_modes_without_a_map_are_named():
    rng = random.Random(6)
    batch, runner, pool, pos = make_case(rng, "decode")
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    batch.forward_mode = ForwardMode.PREBUILT
    assert writemap.rule_of(batch, runner) == "prebuilt: the write map is not defined for this forward mode"


def older_release(monkeypatch):
    """sglang 0.5.12's entry of WRITE_MAP_MEASURED, put in place on any release (the same there)."""
    monkeypatch.setattr(writemap, "UNMEASURED", {what: "not measured on sglang 0.5.12" for what in
                                                 WRITE_MAP_MEASURED["0.5.12"]})
    assert set(writemap.UNMEASURED) == {SPECULATIVE, PD_DECODE, HICACHE, SLIDING}


def test_an_older_release_leaves_its_unmeasured_forwards_out_by_name(monkeypatch):
    """On a release measured without speculative, PD decode, HiCache and sliding-window forwards
    (0.5.12): a draft runner's decode, a target verify, a draft extend (v2), the target's own extend
    in a speculative server and any step of a PD decode, HiCache or SWA server get the reason, read
    from attributes alone; the plain decode's fast path gives them up too. A plain extend and decode
    still get their rules, and so do those kinds where the release's entry lacks them."""
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    older_release(monkeypatch)
    spec = f"{SPECULATIVE}: not measured on sglang 0.5.12"
    pd = f"{PD_DECODE}: not measured on sglang 0.5.12"
    rng = random.Random(7)
    batch, runner, pool, pos = make_case(rng, "decode")
    assert writemap.rule_of(batch, runner).family == "decode" and writemap.plain_decode(batch, runner) is not None
    runner.is_draft_worker = True
    assert writemap.rule_of(batch, runner, 0, positions=True) == spec and writemap.unmeasured(batch, runner) == spec
    assert writemap.plain_decode(batch, runner) is None
    runner.is_draft_worker = False
    modes = [name for name in ("TARGET_VERIFY", "DRAFT_EXTEND", "DRAFT_EXTEND_V2") if hasattr(ForwardMode, name)]
    for name in modes:
        batch.forward_mode = getattr(ForwardMode, name)
        assert writemap.rule_of(batch, runner) == spec, name
    batch.forward_mode = ForwardMode.DECODE
    runner.server_args.speculative_algorithm = "EAGLE"  # the target's own decode or extend in such a server
    assert writemap.rule_of(batch, runner) == spec and writemap.plain_decode(batch, runner) is None
    runner.server_args.speculative_algorithm = None
    runner.server_args.disaggregation_mode = "decode"
    assert writemap.rule_of(batch, runner) == pd and writemap.plain_decode(batch, runner) is None
    runner.server_args.disaggregation_mode = "prefill"
    assert writemap.rule_of(batch, runner).family == "decode"
    runner.token_to_kv_pool = SimpleNamespace(full_kv_pool=pool, swa_kv_pool=pool)  # an SWAKVPool's sub-pools
    assert writemap.rule_of(batch, runner) == f"{SLIDING}: not measured on sglang 0.5.12"
    assert writemap.plain_decode(batch, runner) is None
    del writemap.UNMEASURED[SLIDING]  # 0.5.16-0.5.22 ran the SWA rows: measured
    assert writemap.rule_of(batch, runner).family == "decode"
    runner.server_args.enable_hierarchical_cache = True
    assert writemap.rule_of(batch, runner) == f"{HICACHE}: not measured on sglang 0.5.12"
    assert writemap.plain_decode(batch, runner) is None
    del writemap.UNMEASURED[HICACHE]  # 0.5.22 ran HiCache's row: measured
    assert writemap.rule_of(batch, runner).family == "decode"
    extend, runner, _, _ = make_case(random.Random(8), "extend")
    assert writemap.rule_of(extend, runner).family == "extend"
