"""The read check (on with liveness), inside the forward step: sglang's ModelRunner.forward
with the guard's hook, its real ForwardBatch, ReqToTokenPool, KV pool and token
allocator, on the CPU. A slot a running request still reads that was freed, freed and
handed to another request, or whose req_to_token entry was repointed, is reported at
the first step that reads it, naming the reader, the position, the new holder and the
slot's history; shared prefixes, a row's new request and a request's own slot given
back and handed to it again (spec decoding's rolled-back positions) raise nothing."""

from __future__ import annotations

import pytest
import torch

import sglang_oobguard
from helpers import mha, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.targets import write_map_off

from test_stepmap import decode, step_runner

# the read check and the own-ids check run where the write map does (the step layouts it was measured on)
pytestmark = pytest.mark.skipif(write_map_off() is not None, reason=str(write_map_off()))


@pytest.fixture
def runner(mp, monkeypatch):
    """test_stepmap's runner: sglang's ModelRunner with the guard's hook over a stand-in model loop."""
    return step_runner(mp, monkeypatch)

@pytest.fixture(params=["auto", "triton"])
def engine(mp, guard, runner, request):
    """Strict, liveness on; a runner over a real pool and its real allocator, the table empty.
    auto: the host path; triton: the read kernel (and the step kernel), in Triton's interpreter."""
    from sglang.srt.mem_cache import allocator

    guard("strict", request.param, liveness=True)
    pool = mha(mp, 64)
    alloc = token_allocator(allocator, pool)
    run, _ = runner(pool)
    run.req_to_token_pool.req_to_token.zero_()
    return run, alloc


def admit(run, alloc, row: int, n: int, prefix: torch.Tensor = None) -> torch.Tensor:
    """A request on `row`: `prefix` (shared slots) then n new slots, as sglang's prefill maps them."""
    table = run.req_to_token_pool.req_to_token
    new = alloc.alloc(n)
    slots = new if prefix is None else torch.cat([prefix, new])
    table[row, :slots.numel()] = slots.to(table.dtype)
    return slots


def step(run, alloc, lens: dict, rids: dict = None):
    """One decode step: each row (row -> its seq_len after this step) gets a new slot."""
    table = run.req_to_token_pool.req_to_token
    for row, n in lens.items():
        table[row, n - 1] = int(alloc.alloc(1)[0])
    batch = decode(run, rows=tuple(lens), seq_lens=tuple(lens.values()))
    if rids:
        batch.rids = [rids.get(row, f"r{row}") for row in lens]
    return run.forward(batch)


def hand_out(alloc, wanted: torch.Tensor) -> torch.Tensor:
    """The allocator hands out `wanted` (freed slots) again: everything free is taken, the rest given back."""
    every = alloc.alloc(alloc.available_size())
    keep = torch.isin(every, wanted.long())
    alloc.free(every[~keep])
    return every[keep]


def line_of(function, text: str) -> int:
    """The line of `function` that holds `text` (the call site a report must name)."""
    import inspect

    lines, first = inspect.getsourcelines(function)
    return first + next(i for i, line in enumerate(lines) if text in line)


def evict(alloc, slots):
    """Stands for a radix eviction under a running request: the frame the report must name."""
    alloc.free(slots)


def test_shared_prefixes_new_holders_and_a_requests_own_slot_again_raise_nothing(engine, caplog):
    run, alloc = engine
    prefix = admit(run, alloc, 1, 4)
    admit(run, alloc, 2, 2, prefix[:3])  # row 2 reads row 1's first 3 slots
    for n in range(5, 8):
        step(run, alloc, {1: n, 2: n})
    table = run.req_to_token_pool.req_to_token
    # a rolled-back position: row 1's last slot given back and handed to it again
    last = table[1, 6:7].long()
    alloc.free(last)
    again = hand_out(alloc, last)
    table[1, 6] = again.to(table.dtype)
    run.forward(decode(run, rows=(1, 2), seq_lens=(7, 7)))  # row 1 rewrites position 6 (its own, new generation)
    # the radix cache's dedup: row 2's own copy of position 3 freed, row 2 repointed to row 1's
    alloc.free(table[2, 3:4].long())
    table[2, 3] = table[1, 3]
    step(run, alloc, {1: 8, 2: 8})
    # row 2 finishes; its row holds a new request with the same prefix slots and fresh ones
    alloc.free(table[2, 4:8].long())
    admit(run, alloc, 2, 3, prefix[:3])
    step(run, alloc, {1: 9, 2: 7}, rids={2: "next"})
    sglang_oobguard.check()  # the kernel's record: nothing
    assert "internal error" not in caplog.text and "read check skipped" not in caplog.text


def test_a_prefix_slot_freed_and_handed_to_another_request_is_read_at_the_next_step(engine):
    run, alloc = engine
    prefix = admit(run, alloc, 1, 4)
    step(run, alloc, {1: 5})
    evict(alloc, prefix[:2])  # the fault: row 1 still reads them
    taken = hand_out(alloc, prefix[:2])  # another request is handed them
    run.req_to_token_pool.req_to_token[3, :2] = taken.to(torch.int32)
    run.forward(_extend(run, 3, taken))  # the new holder writes them: it owns them now
    with pytest.raises(KVOutOfBoundsError) as info:
        step(run, alloc, {1: 6, 3: 3})
        sglang_oobguard.check()  # the kernel's record (the host path raised already)
    v = info.value.violation
    assert (v.kind, v.request, v.owner, v.label) == ("read_reused", "r1", "r3", "req_to_token (read check)")
    assert v.token in (0, 1) and v.value == int(prefix[v.token]) and v.owner_token is not None
    freed_at = line_of(evict, "alloc.free")
    assert v.freed_by.endswith(f"> evict (test_reads.py:{freed_at}) > TokenToKVPoolAllocator.free"), v.freed_by
    assert v.allocated_by.endswith(f"> hand_out (test_reads.py:{line_of(hand_out, 'alloc.alloc')}) > "
                                   "TokenToKVPoolAllocator.alloc"), v.allocated_by and v.read_generation < v.generation
    text = str(info.value)
    assert f"slot {v.value} at position {v.token} is read by its running request but was given back and handed " \
           "out again" in text and "slot %d is held by request r3" % v.value in text
    assert "; request r1 token" in text and "last freed at step" in text


def test_a_slot_freed_under_its_reader_is_read_freed(engine):
    run, alloc = engine
    prefix = admit(run, alloc, 1, 4)
    step(run, alloc, {1: 5})
    evict(alloc, prefix[2:3])
    with pytest.raises(KVOutOfBoundsError) as info:
        step(run, alloc, {1: 6})
        sglang_oobguard.check()
    v = info.value.violation
    assert (v.kind, v.request, v.token, v.value, v.owner) == ("read_freed", "r1", 2, int(prefix[2]), None)
    assert "evict (test_reads.py:" in v.freed_by


def test_a_repointed_entry_is_caught(engine):
    """upstream's req_to_token perturbation: a live entry repointed to another request's slot."""
    run, alloc = engine
    admit(run, alloc, 1, 4)
    other = admit(run, alloc, 2, 4)
    step(run, alloc, {1: 5, 2: 5})
    run.req_to_token_pool.req_to_token[1, 1] = int(other[3])
    with pytest.raises(KVOutOfBoundsError) as info:
        step(run, alloc, {1: 6, 2: 6})
        sglang_oobguard.check()
    v = info.value.violation
    assert (v.kind, v.request, v.token, v.value, v.owner, v.owner_token) == ("repointed", "r1", 1, int(other[3]),
                                                                             "r2", 3)


def _extend(run, row: int, slots: torch.Tensor):
    """An extend of `slots` as row's whole prompt (prefix 0)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    n = slots.numel()
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(n, dtype=torch.int64),
                         req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([n]), out_cache_loc=slots.long(),
                         seq_lens_sum=n, extend_seq_lens=torch.tensor([n]), extend_prefix_lens=torch.tensor([0]),
                         extend_start_loc=torch.tensor([0]))
    batch.seq_lens_cpu, batch.rids = torch.tensor([n]), [f"r{row}"]
    batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu = [n], [0]
    return batch


def test_a_layer_writing_with_ids_of_its_own_gets_the_write_map_check(mp, guard, runner, monkeypatch):
    """Item 4: a writer that computes its own ids (not the step's out_cache_loc) and targets
    another running request's slot at layer 1 is caught at that write, the holder named;
    the same values in a tensor of its own pass. (Layer 1 writes only the first two
    tokens: ids not of the step's shape are checked for membership, `not_step`.)"""
    from helpers import Layer, model_runner_class

    guard("strict")
    pool = mha(mp)
    run, _ = runner(pool)
    target = int(run.req_to_token_pool.req_to_token[2, 0])  # r2's first token's slot
    hooked = model_runner_class().__dict__["forward"]
    layers_seen = []

    def layers(self, batch, *args, **kwargs):
        k = torch.ones(batch.out_cache_loc.numel(), 2, 4)
        for layer in range(2):
            own = batch.out_cache_loc.clone()  # ids of the writer's own: the same values
            if layer == 1 and batch.batch_size == 3:
                own = own[:2].clone()
                own[0] = target
            self.token_to_kv_pool.set_kv_buffer(Layer(layer), own, k[:own.numel()], k[:own.numel()])
            layers_seen.append(layer)
        return "output"

    monkeypatch.setattr(hooked, "__wrapped__", layers)
    run.forward(decode(run, rows=(1,), seq_lens=(5,)))  # clean: its own copy of the step's slots
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode(run))
    v = info.value.violation
    assert (v.kind, v.layer, v.value, v.owner, v.owner_token) == ("not_step", 1, target, "r2", 0)
    assert "is not a slot this forward step's tokens write" in str(info.value)
    assert layers_seen == [0, 1, 0]  # the bad write never ran


@pytest.mark.parametrize("many", [False, True])
def test_a_layer_writing_a_permutation_of_the_steps_slots_is_caught(mp, guard, runner, monkeypatch, many):
    """Trust issue: a layer whose ids are the step's own slots in another order
    (`out_cache_loc.roll(1)`) writes each token into another running request's slot;
    each id is a slot of the step, so a membership test passes it. Ids of the step's
    shape are compared token by token: token 0 (r1 token 4) writes r3 token 2's slot.
    many: the comparison for a step of more than a few ids (numpy), forced by FEW = 1."""
    from helpers import Layer, model_runner_class
    from sglang_oobguard.checks import ownids

    if many:
        monkeypatch.setattr(ownids, "FEW", 1)
    guard("strict")
    run, _ = runner(mha(mp))
    hooked = model_runner_class().__dict__["forward"]
    written = []

    def layers(self, batch, *args, **kwargs):
        k = torch.ones(batch.out_cache_loc.numel(), 2, 4)
        for layer in range(2):
            self.token_to_kv_pool.set_kv_buffer(Layer(layer), batch.out_cache_loc.roll(1), k, k)
            written.append(layer)
        return "output"

    monkeypatch.setattr(hooked, "__wrapped__", layers)
    batch = decode(run)
    own = batch.out_cache_loc.tolist()
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(batch)
    v = info.value.violation
    assert (v.kind, v.layer, v.pos, v.value, v.expected, v.bad) == ("other_request", 0, 0, own[2], own[0], 3)
    assert (v.request, v.token, v.owner, v.owner_token) == ("r1", 4, "r3", 2)
    assert f"loc[0] = {own[2]} is not this token's slot (req_to_token holds {own[0]}); slot {own[2]} is held " \
           f"by request r3 token 2" in str(info.value)
    assert written == []  # the bad write never ran


def test_an_mla_pool_is_read_checked_alike(mp, guard, runner, monkeypatch):
    """DeepSeek's pool kind: the read check reads req_to_token and the allocator's shadow,
    never the pool's layout. (The model loop writes nothing here: the MLA buffers' shapes
    are not the stand-in loop's.)"""
    from helpers import model_runner_class
    from sglang.srt.mem_cache import allocator

    guard("strict", liveness=True)
    pool = mp.MLATokenToKVPool(64, 1, torch.bfloat16, 16, 16, 2, "cpu", False)
    alloc = token_allocator(allocator, pool)
    run, _ = runner(pool)
    monkeypatch.setattr(model_runner_class().__dict__["forward"], "__wrapped__", lambda self, batch, *a, **k: "output")
    run.req_to_token_pool.req_to_token.zero_()
    prefix = admit(run, alloc, 1, 4)
    step(run, alloc, {1: 5})
    evict(alloc, prefix[:1])
    taken = hand_out(alloc, prefix[:1])
    run.req_to_token_pool.req_to_token[3, :1] = taken.to(torch.int32)
    run.forward(_extend(run, 3, taken))
    with pytest.raises(KVOutOfBoundsError) as info:
        step(run, alloc, {1: 6, 3: 2})
    v = info.value.violation
    assert (v.kind, v.pool, v.request, v.token, v.owner) == ("read_reused", "MLATokenToKVPool", "r1", 0, "r3")


def test_a_slot_handed_back_to_its_own_reader_at_another_position_is_caught(engine):
    """Its own row owns the slot again, but at the position it writes now, not the one it
    read: two positions, one slot (the older read sees the new token's KV)."""
    run, alloc = engine
    prefix = admit(run, alloc, 1, 4)
    step(run, alloc, {1: 5})
    evict(alloc, prefix[1:2])
    again = hand_out(alloc, prefix[1:2])
    table = run.req_to_token_pool.req_to_token
    table[1, 5] = again.to(table.dtype)
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode(run, rows=(1,), seq_lens=(6,)))  # writes position 5 with that slot
        sglang_oobguard.check()
    v = info.value.violation
    assert (v.kind, v.request, v.token, v.value, v.owner, v.owner_token) == ("read_reused", "r1", 1, int(prefix[1]),
                                                                             "r1", 5)


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_a_decode_that_continues_its_half_filled_page_reads_its_own_slots(mp, guard, runner, backend):
    """Page size 4 (trust issue): sglang's paged allocator continues a request's half-filled
    last page at decode; the earlier slots of that page are still the request's own, at the
    same generation and owner. With 5 prompt tokens (page 2 half full), three decode steps
    continue page 2 and a fourth opens page 3: nothing is reported, and the opened page gets
    a new generation while the continued one keeps its own."""
    from helpers import paged_allocator
    from sglang.srt.mem_cache import allocator
    from sglang_oobguard.probes.pools import STATE_ATTR
    from sglang_oobguard.probes.shadow import GEN

    guard("strict", backend, liveness=True)
    pool = mha(mp, 64, page_size=4)
    alloc = paged_allocator(allocator, pool)
    run, _ = runner(pool)
    table = run.req_to_token_pool.req_to_token
    table.zero_()
    rows, n = (1, 2), 5
    zeros, lens = torch.zeros(2, dtype=torch.int64), torch.full((2,), n, dtype=torch.int64)
    slots = alloc.alloc_extend(zeros, zeros, lens, lens, torch.full((2,), -1, dtype=torch.int64), 2 * n)
    for i, row in enumerate(rows):
        table[row, :n] = slots[i * n:(i + 1) * n].to(table.dtype)
    run.forward(_extend_rows(run, rows, n, slots))
    history = pool.__dict__[STATE_ATTR].live.history
    generation = int(history[GEN, int(table[1, 4]) // 4])
    for seq in range(n + 1, n + 5):
        last = table[list(rows), seq - 2].long()
        new = alloc.alloc_decode(torch.full((2,), seq), torch.full((2,), seq), last)
        for i, row in enumerate(rows):
            table[row, seq - 1] = int(new[i])
        run.forward(decode(run, rows=rows, seq_lens=(seq, seq)))
        sglang_oobguard.check()  # the kernel's record: nothing
    assert int(history[GEN, int(table[1, 4]) // 4]) == generation  # continued three times, never reopened
    assert int(history[GEN, int(table[1, 8]) // 4]) > generation  # page 3, opened by the last decode


def _extend_rows(run, rows, n: int, slots: torch.Tensor):
    """One extend of n prompt tokens for each row (prefix 0), at `slots` in row order."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    size = len(rows)
    batch = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=size,
                         input_ids=torch.zeros(size * n, dtype=torch.int64), req_pool_indices=torch.tensor(rows),
                         seq_lens=torch.full((size,), n), out_cache_loc=slots.long(), seq_lens_sum=size * n,
                         extend_seq_lens=torch.full((size,), n), extend_prefix_lens=torch.zeros(size, dtype=torch.int64),
                         extend_start_loc=torch.arange(size) * n)
    batch.seq_lens_cpu, batch.rids = torch.full((size,), n), [f"r{row}" for row in rows]
    batch.extend_seq_lens_cpu, batch.extend_prefix_lens_cpu = [n] * size, [0] * size
    return batch


@pytest.mark.parametrize("kind", ["pd-decode", "target-verify", "speculative-server"])
def test_an_older_releases_unmeasured_steps_keep_bounds_and_liveness_only(engine, monkeypatch, caplog, kind):
    """On a release measured without speculative and PD decode forwards (sglang 0.5.12; its
    entry put in place elsewhere), such a step skips the write map, the owner check, the
    position check and the read check, each said once by name; its bounds and liveness are
    still checked (counted). The slot freed under its reader is reported once the runner is a
    plain one again."""
    import logging
    from types import SimpleNamespace

    import sglang_oobguard.activate.instrument as instrument
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang_oobguard.report.counts import slot
    from test_writemap import older_release

    older_release(monkeypatch)
    run, alloc = engine
    run.server_args = SimpleNamespace(disaggregation_mode="decode" if kind == "pd-decode" else "null",
                                      speculative_algorithm="EAGLE" if kind == "speculative-server" else None)
    prefix = admit(run, alloc, 1, 4)
    table = run.req_to_token_pool.req_to_token
    table[1, 4] = int(alloc.alloc(1)[0])
    evict(alloc, prefix[2:3])  # the fault: row 1 still reads it
    batch = decode(run, rows=(1,), seq_lens=(5,))
    batch.positions = batch.seq_lens + 3  # and a position the check would report
    if kind == "target-verify":  # one draft token per row, at the decode's slot (not verify's place: unmapped)
        batch.forward_mode, batch.spec_info = ForwardMode.TARGET_VERIFY, SimpleNamespace(draft_token_num=1)
    counts = instrument._active.guard.counts.n
    before = {name: counts[slot(*name)] for name in (("bounds", "steps"), ("liveness", "steps"), ("map", "steps"),
                                                       ("owners", "steps"), ("reads", "steps"), ("positions", "steps"))}
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        assert run.forward(batch) == "output"
        sglang_oobguard.check()  # the kernel's record: nothing
    assert sglang_oobguard.violations() == []
    after = {name: counts[slot(*name)] - n for name, n in before.items()}
    assert after == {("bounds", "steps"): 1, ("liveness", "steps"): 1, ("map", "steps"): 0, ("owners", "steps"): 0,
                     ("reads", "steps"): 0, ("positions", "steps"): 0}, after
    what = "PD disaggregation's decode side" if kind == "pd-decode" else "speculative decoding's forwards"
    for said in ("write map not checked for ", "read check skipped for "):
        assert f"{said}{what}" in caplog.text and "not measured on sglang 0.5.12" in caplog.text, caplog.text
    run.server_args = SimpleNamespace(disaggregation_mode="null", speculative_algorithm=None)
    batch.forward_mode, batch.positions = ForwardMode.DECODE, batch.seq_lens - 1
    with pytest.raises(KVOutOfBoundsError) as info:  # a plain runner: the same step is read-checked
        run.forward(batch)
        sglang_oobguard.check()
    v = info.value.violation
    assert (v.kind, v.request, v.token, v.value) == ("read_freed", "r1", 2, int(prefix[2])), v
