"""The position check (sglang_oobguard.checks.positions) on sglang's real ReqToTokenPool,
ForwardBatch and ModelRunner: the host check and the step kernel (Triton's interpreter here)
find the same first token at a wrong position in every forward mode the write map covers;
an EAGLE draft loop's steps are counted by its batch (sglang's own per-step slices); inside
the step hook a mismatch is reported before the layers write, not contained, and in raise
mode raised after the forward; the token check compares input_ids with the requests' tokens."""

from __future__ import annotations

import logging
import random
from types import SimpleNamespace

import pytest
import torch

import sglang_oobguard
from helpers import mha
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.checks import positions
from sglang_oobguard.model import poslayout, writemap
from sglang_oobguard.model.targets import write_map_off
from sglang_oobguard.probes import hostmap, hostpos
from sglang_oobguard.probes.record import Kind
from test_stepmap import decode, step_runner
from test_writemap import HIGH, forward_batch, make_case, model_runner, req_pool, speculative

pytestmark = pytest.mark.skipif(write_map_off() is not None, reason=str(write_map_off()))

FAMILIES = ("extend", "decode", "verify", "tree", "draft")


@pytest.fixture
def runner(mp, monkeypatch):
    return step_runner(mp, monkeypatch)


def case(rng: random.Random, family: str):
    """A clean batch of the family with sglang's positions (as ForwardBatch.init_new and the
    draft loop set them) and its rule with the position check on."""
    batch, runner, pool, pos = make_case(rng, "verify" if family == "tree" else family)
    if family == "tree":
        runner.server_args.speculative_eagle_topk = 2
        width = batch.spec_info.draft_token_num  # a depth for each token: the root 0, the others in [1, j]
        batch.positions = torch.tensor([s + (rng.randint(1, j) if j else 0) for s in batch.seq_lens.tolist()
                                        for j in range(width)], dtype=torch.int64)
    elif family != "draft":  # the draft case's positions are its draft step's
        batch.positions = torch.tensor([p for _, p in pos], dtype=torch.int64)
    step = int(batch.positions[0] - batch.seq_lens[0]) if family == "draft" else -1
    rule = writemap.rule_of(batch, runner, step, positions=True)
    assert rule.expect == (poslayout.TREE if family == "tree" else poslayout.EXACT), (family, rule)
    return batch, runner, rule


@pytest.mark.parametrize("family", [pytest.param(family, marks=speculative) if family in ("verify", "tree", "draft")
                                    else family for family in FAMILIES])
def test_kernel_and_host_find_the_same_token_at_a_wrong_position(family):
    rng = random.Random(f"positions-{family}")
    for n in range(24):
        batch, runner, rule = case(rng, family)
        assert hostpos.check_positions(rule) is None, (family, rule)
        assert run_both_rule(rule)[2].calls == 0
        i = rng.randrange(rule.ids.numel())
        if family == "tree":  # below its row's window, or past its own place in it
            j = i % rule.width
            rule.positions[i] = rule.seq_lens[i // rule.width] + rng.choice([-1, j + 1])
        else:
            rule.positions[i] += rng.choice([-1, 1, 3])
        finding = hostpos.check_positions(rule)
        assert finding is not None and finding.pos == i and finding.value == int(rule.positions[i]), (family, finding)
        _, _, record, clean = run_both_rule(rule)
        assert (record.kind, record.pos, record.value, record.expected, record.row, record.owner, record.head) == (
            Kind.POSITION, finding.pos, finding.value, finding.expected, finding.row, finding.draft_step,
            finding.lowest), (family, record, finding)
        assert record.calls == 1 and record.high == 0 and record.bad == finding.bad == 1
        assert torch.equal(clean, rule.ids)  # not contained: the slot is right
        assert hostmap.check_host(rule, HIGH)[0] is None  # nor a slot report: the map finds its slot from its step


def run_both_rule(rule):
    """The step kernel on `rule` itself (its positions check on)."""
    from sglang_oobguard.probes import stepkernel
    from sglang_oobguard.probes.record import RECORD_LEN, Record

    record = torch.zeros(RECORD_LEN, dtype=torch.int64)
    tables = stepkernel.new_tables(HIGH, rule.table.shape[0], torch.device("cpu"))
    clean = torch.empty_like(rule.ids)
    stepkernel.launch(rule, HIGH, 3, -1, record, torch.tensor([7]), tables, None, clean, None, 9)
    record = Record(*record.tolist())
    assert record.calls == 0 or record.step == 7 and record.site == (9 if record.kind == Kind.POSITION else 3)
    return None, None, record, clean


@speculative
def test_a_slot_report_wins_the_record_and_a_tree_root_must_be_exact():
    rng = random.Random("both")
    batch, runner, rule = case(rng, "tree")
    rule.positions[0] += 1  # the root of row 0: depth 0 exactly
    assert hostpos.check_positions(rule).pos == 0
    rule.ids[1] = HIGH + 2  # and a slot out of bounds: the record keeps the slot's
    _, _, record, clean = run_both_rule(rule)
    assert record.kind == Kind.BOUNDS and record.bad == 1 and record.total_bad == 2 and int(clean[1]) == 0


@speculative
def test_the_draft_loop_is_counted_by_its_batch_and_a_step_advanced_early_is_a_position_not_a_slot(mp, guard,
                                                                                                   runner):
    """sglang's own per-step slices of the draft's out_cache_loc (EagleDraftWorker.draft_forward),
    one batch through every step; sglang PR #25015's bug: positions advanced before each step."""
    from sglang.srt.speculative.eagle_utils import per_step_draft_out_cache_loc

    guard("warn")
    run, seen = runner(mha(mp))
    run.is_draft_worker, run.page_size = True, 1
    run.server_args = SimpleNamespace(speculative_eagle_topk=1, speculative_num_steps=4)
    table, rows, seq = run.req_to_token_pool.req_to_token, [1, 2], [3, 6]
    whole = torch.stack([table[r, s:s + 4] for r, s in zip(rows, seq)]).reshape(-1).long()
    per_step = per_step_draft_out_cache_loc(whole, 2, 1, 4)
    for early in (0, 1):
        batch = forward_batch("DECODE", rows, seq, per_step[0], positions=torch.tensor(seq) + early)
        for s in range(3):
            batch.out_cache_loc = per_step[s]
            run.forward(batch)
            batch.positions.add_(1)
    (v,) = sglang_oobguard.violations()  # the last: draft step 2
    assert (v.kind, v.label, v.pos, v.value, v.expected, v.draft_step, v.token, v.request, v.mode) == (
        "position", "positions (forward step)", 0, 6, 5, 2, 5, "rid1", "decode")
    assert v.calls == 3  # each step of the early loop, none of the clean one
    assert "positions[0] = 6 is not this token's position 5 at draft step 2: its K is rotated there (2 of 2 tokens)" \
        in v.described()
    assert seen[3] == per_step[0].tolist()  # not contained: the layers wrote the step's own slots


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_a_decode_token_at_a_wrong_position_is_reported_before_the_layers_write_and_not_contained(mp, guard, runner,
                                                                                                  mode, caplog):
    guard(mode)
    run, seen = runner(mha(mp))
    batch = decode(run)
    batch.positions = batch.seq_lens - 1
    run.forward(batch)  # clean: the plain decode's fast path
    batch = decode(run)
    batch.positions = batch.seq_lens - 1
    batch.positions[1] += 1
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        if mode == "warn":
            assert run.forward(batch) == "output"
        else:
            with pytest.raises(KVOutOfBoundsError, match=r"^positions \(forward step\): positions\[1\] = 9 is not "
                                                         r"this token's position 8: its K is rotated there"):
                run.forward(batch)
    assert len(seen) == (1 if mode == "strict" else 2)  # strict: before the layers; else the step ran on
    if mode != "strict":
        assert seen[1] == batch.out_cache_loc.tolist()  # with its own slots
    (v,) = sglang_oobguard.violations()
    assert (v.request, v.token, v.expected, v.value, v.step, v.mode) == ("r2", 8, 8, 9, 1, "decode")
    assert v.draft_step is None and v.lowest == -1
    if mode == "warn":
        assert "reported only (the slot is right, the position is not: the step runs on uncontained)" in caplog.text


def test_the_token_check_compares_the_requests_tokens_it_holds(mp, guard, runner):
    """Extend: input_ids against each request's prompt and outputs (the ScheduleBatch's reqs, as
    the hook on ForwardBatch.init_new keeps them); a decode's input the scheduler does not hold
    yet (the overlap scheduler's) is not compared."""
    guard("warn")
    run, _ = runner(mha(mp))
    table = run.req_to_token_pool.req_to_token
    reqs = [SimpleNamespace(rid="a", origin_input_ids=[11, 12, 13, 14], output_ids=[]),
            SimpleNamespace(rid="b", origin_input_ids=[21, 22], output_ids=[23, 24, 25])]
    batch = forward_batch("EXTEND", [1, 2], [4, 4], torch.cat([table[1, :4], table[2, 1:4]]).long(),
                          extend_prefix_lens=torch.tensor([0, 1], dtype=torch.int32),
                          extend_seq_lens=torch.tensor([4, 3], dtype=torch.int32),
                          extend_start_loc=torch.tensor([0, 4], dtype=torch.int32),
                          positions=torch.tensor([0, 1, 2, 3, 1, 2, 3]),
                          input_ids=torch.tensor([11, 12, 13, 14, 22, 23, 24]),
                          extend_seq_lens_cpu=[4, 3], extend_prefix_lens_cpu=[0, 1])
    batch.rids = ["a", "b"]
    batch.__dict__[positions.REQS_ATTR] = reqs
    run.forward(batch)
    assert sglang_oobguard.violations() == []
    batch.input_ids[[2, 5]] = batch.input_ids[[5, 2]]  # a token of each request swapped
    run.forward(batch)
    (v,) = sglang_oobguard.violations()
    assert (v.kind, v.label, v.pos, v.value, v.expected, v.request, v.token, v.bad) == (
        "token", "input_ids (forward step)", 2, 23, 13, "a", 2, 2)
    decoding = decode(run, rows=(1, 2), seq_lens=(5, 5))
    decoding.positions, decoding.input_ids = decoding.seq_lens - 1, torch.tensor([99, 25])
    decoding.rids = ["a", "b"]
    decoding.__dict__[positions.REQS_ATTR] = reqs  # a's token 4 is not held yet; b's is its output 25
    run.forward(decoding)
    assert len(sglang_oobguard.violations()) == 1 and sglang_oobguard.violations()[0].calls == 1
    decoding.input_ids[1] = 7
    run.forward(decoding)
    assert sglang_oobguard.violations()[0].calls == 2


def test_forwards_whose_positions_are_not_derived_are_skipped_by_name():
    rng = random.Random("skips")
    batch, runner, rule = case(rng, "decode")
    runner.model_config = SimpleNamespace(model_is_mrope=True)
    assert writemap.rule_of(batch, runner, -1, True).expect == 0
    assert poslayout.layout("decode", batch, runner, -1) == "mrope models"
    runner.model_config.model_is_mrope = False
    runner.server_args.speculative_algorithm = "DFLASH"
    assert poslayout.layout("extend", batch, runner, -1) == "other speculative algorithms"
    runner.server_args.speculative_algorithm = "EAGLE"
    assert poslayout.layout("draft", batch, runner, -1) == "an EAGLE draft step whose step is not known"
    batch.encoder_lens = torch.ones(batch.batch_size, dtype=torch.int64)
    assert poslayout.layout("decode", batch, runner, -1) == "encoder-decoder models"
    pool = req_pool(rng)
    plain = forward_batch("DECODE", [1], [3], pool.req_to_token[1, 2:3].long())
    assert writemap.rule_of(plain, model_runner(pool), -1, True).expect == 0  # no positions: nothing to compare


def test_the_kernel_path_reports_a_position_at_the_next_step_boundary_naming_the_same(mp, guard, runner):
    """The GPU path (the step kernel, forced on CPU tensors): the record is read at the next
    step's start, and names the request, the token and both positions as the host path does."""
    guard("warn", backend="triton", poll_every=10**6)
    run, seen = runner(mha(mp))
    batch = decode(run)
    batch.positions = batch.seq_lens - 1
    batch.positions[2] -= 1
    run.forward(batch)
    assert sglang_oobguard.violations() == [] and seen[0] == batch.out_cache_loc.tolist()  # not contained
    clean = decode(run)
    clean.positions = clean.seq_lens - 1
    run.forward(clean)
    (v,) = sglang_oobguard.violations()
    assert (v.kind, v.label, v.pos, v.value, v.expected, v.request, v.token, v.step, v.high, v.draft_step, v.lowest) == (
        "position", "positions (forward step)", 2, 1, 2, "r3", 2, 0, 0, None, -1)
