"""The write map inside the forward step (sglang's ModelRunner.forward with the guard's
hook, its real ForwardBatch, ReqToTokenPool and KV pool, on the CPU): both paths (the host
check; the step kernel, forced, in Triton's interpreter) report both sides of a write to
another request's slot, and every layer of that forward writes the cleaned ids."""

from __future__ import annotations

import logging

import pytest
import torch

import sglang_oobguard
from helpers import Layer, as_write_loc, mha, model_runner_class
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.model.targets import write_map_off

pytestmark = pytest.mark.skipif(write_map_off() is not None, reason=str(write_map_off()))

LAYERS, HIGH = 2, 65


@pytest.fixture
def runner(mp, monkeypatch):
    return step_runner(mp, monkeypatch)


def step_runner(mp, monkeypatch):
    """sglang's ModelRunner with the guard's hook; the model replaced (test-only) by a loop
    writing every layer's KV at the batch's out_cache_loc through the real pool. (The
    read check's tests build theirs with it too.)"""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    ModelRunner = model_runner_class()

    def make(pool):
        run = ModelRunner.__new__(ModelRunner)
        run.token_to_kv_pool, run.tp_rank, run.pp_rank, run.dp_rank = pool, 0, 0, 0
        run.is_draft_worker = False
        run.req_to_token_pool = ReqToTokenPool(size=4, max_context_len=16, device="cpu", enable_memory_saver=False)
        table = run.req_to_token_pool.req_to_token
        table.copy_(torch.arange(1, 1 + table.numel(), dtype=torch.int32).view(table.shape) % (HIGH - 1) + 1)
        hooked = ModelRunner.__dict__["forward"]
        seen = []

        def layers(self, batch, *args, **kwargs):
            k = torch.ones(batch.out_cache_loc.numel(), 2, 4)
            seen.append(batch.out_cache_loc.tolist())
            for layer in range(LAYERS):
                self.token_to_kv_pool.set_kv_buffer(Layer(layer), as_write_loc(mp, batch.out_cache_loc), k, k)
            return "output"

        monkeypatch.setattr(hooked, "__wrapped__", layers)
        return run, seen

    return make


def decode(run, loc=None, rows=(1, 2, 3), seq_lens=(5, 9, 3)):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    rpi, seq = torch.tensor(rows), torch.tensor(seq_lens)
    own = run.req_to_token_pool.req_to_token[rpi, seq - 1].long()
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=len(rows), input_ids=torch.zeros(len(rows), dtype=torch.int64),
                         req_pool_indices=rpi, seq_lens=seq, out_cache_loc=own if loc is None else loc(own),
                         seq_lens_sum=sum(seq_lens))
    batch.seq_lens_cpu, batch.rids = seq.clone(), [f"r{r}" for r in rows]
    return batch


def cross(run):
    """Token 0 gets the slot of row 2's first token (r2 token 0)."""
    slot = int(run.req_to_token_pool.req_to_token[2, 0])
    return slot, lambda own: torch.tensor([slot, *own[1:].tolist()])


def test_strict_host_path_names_the_slot_the_writer_and_the_owner(mp, guard, runner):
    guard("strict")
    run, seen = runner(mha(mp))
    assert run.forward(decode(run)) == "output"
    slot, fault = cross(run)
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode(run, fault))
    v = info.value.violation
    assert (v.kind, v.pos, v.value, v.request, v.token, v.owner, v.owner_token) == (
        "other_request", 0, slot, "r1", 4, "r2", 0)
    assert v.expected == int(run.req_to_token_pool.req_to_token[1, 4])
    assert str(info.value).startswith(f"out_cache_loc (forward step): loc[0] = {slot} is not this token's slot "
                                      f"(req_to_token holds {v.expected}); slot {slot} is held by "
                                      f"request r2 token 0 (pool MHATokenToKVPool); step 1 (decode, batch 3); "
                                      f"request r1 token 4")
    assert len(seen) == 1  # the faulted forward never ran


@pytest.mark.parametrize("kind", ["other_request", "bounds", "shared_row"])
def test_a_clean_decode_step_is_answered_by_the_fast_check_alone_and_a_bad_one_by_the_full_check(
        mp, guard, runner, monkeypatch, kind):
    """The step's fast check of a plain decode (`hostmap.check_decode`) only ever finds a
    step clean: anything it does not pass goes to the full check, which reports it. The
    layers of a clean step (their ids passed as the release passes them: a KVWriteLoc on
    0.5.2x) are each served by the step's hot entry, never by a write check of their own."""
    from sglang_oobguard.checks import writes
    from sglang_oobguard.probes import hostmap

    guard("strict")
    run, seen = runner(mha(mp))
    asked = []
    fast, full, write_check = hostmap.check_decode, hostmap.check_host, writes.check_write
    monkeypatch.setattr(hostmap, "check_decode", lambda *a: asked.append(("fast", fast(*a))) or asked[-1][1])
    monkeypatch.setattr(hostmap, "check_host", lambda *a: asked.append(("full", None)) or full(*a))
    monkeypatch.setattr(writes, "check_write", lambda *a, **k: asked.append(("write", None)) or write_check(*a, **k))
    clean = decode(run)
    assert run.forward(clean) == "output"
    assert asked == [("fast", clean.out_cache_loc.tolist())]  # no full check for a clean decode step, nor its layers
    asked.clear()
    bad = {"other_request": lambda: decode(run, cross(run)[1]),
           "bounds": lambda: decode(run, lambda own: torch.tensor([int(own[0]), HIGH + 3, int(own[2])])),
           "shared_row": lambda: decode(run, rows=(1, 1, 3))}[kind]()
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(bad)
    assert asked == [("fast", None), ("full", None)] and info.value.violation.kind == kind
    assert len(seen) == 1  # the bad forward never ran


@pytest.mark.parametrize("backend", ["auto", "triton"])
def test_warn_every_layer_writes_the_cleaned_ids_and_the_batch_keeps_its_own(mp, guard, runner, backend, caplog,
                                                                            monkeypatch):
    guard("warn", backend)
    pool = mha(mp)
    run, _ = runner(pool)
    wrapper = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]  # our wrapper around sglang's method
    original, seen = wrapper.__wrapped__, []

    def spy(self, layer, loc_info, *rest, **kwargs):  # what sglang's own method receives
        seen.append(getattr(loc_info, "loc", loc_info).tolist())
        return original(self, layer, loc_info, *rest, **kwargs)

    monkeypatch.setattr(wrapper, "__wrapped__", spy)
    slot, fault = cross(run)
    owner_kv = pool.k_buffer[0][slot].clone()
    batch = decode(run, fault)
    given = batch.out_cache_loc
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        run.forward(batch)
        run.forward(decode(run))  # the next step's boundary reads the kernel's record
    assert batch.out_cache_loc is given and given[0] == slot  # sglang's tensor, untouched
    assert seen[:LAYERS] == [[0, *given[1:].tolist()]] * LAYERS  # every layer wrote with the cleaned copy
    for layer in range(LAYERS):
        assert torch.equal(pool.k_buffer[layer][slot], owner_kv)  # the owner's KV survived
    (v,) = sglang_oobguard.violations()
    assert (v.kind, v.value, v.request, v.owner, v.owner_token, v.step) == ("other_request", slot, "r1", "r2", 0, 0)
    assert f"loc[0] = {slot} is not this token's slot" in caplog.text


def test_owner_check_catches_a_twin_the_tables_agree_on(mp, guard, runner):
    """Row 1's entry is rewritten to row 2's slot: the write map passes, the owner check
    (liveness on; the shadow marks what the allocator hands out) does not."""
    guard("strict", liveness=True)
    pool = mha(mp)
    run, seen = runner(pool)
    from sglang_oobguard.probes import shadow
    from sglang_oobguard.probes.pools import STATE_ATTR

    state = pool.__dict__[STATE_ATTR]
    state.live = shadow.new_live(HIGH, 1, torch.device("cpu"))
    shadow.mark(state.live, torch.arange(1, HIGH))  # test-only: every slot handed out (no allocator here)
    table = run.req_to_token_pool.req_to_token
    run.forward(decode(run, rows=(2,), seq_lens=(1,)))  # r2 writes its token 0: it owns the slot
    slot = int(table[2, 0])
    table[1, 4] = slot
    with pytest.raises(KVOutOfBoundsError) as info:
        run.forward(decode(run, rows=(1, 2), seq_lens=(5, 2)))
    v = info.value.violation
    assert (v.kind, v.value, v.request, v.owner, v.owner_token) == ("owned", slot, "r1", "r2", 0)
    assert "is owned by another running request; slot" in str(v)


def test_a_decode_step_with_fewer_seq_lens_than_tokens_is_not_passed_by_the_fast_check(mp, guard, runner):
    """Every token the fast check passes met its row and length: a batch whose seq_lens is
    shorter than its tokens (a token the lists cannot map) is not found clean there (the
    step then takes the full check); the same batch with all its lengths is."""
    from sglang_oobguard.probes import hostmap

    guard("strict")
    run, _ = runner(mha(mp))
    batch = decode(run)
    assert hostmap.check_decode(batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens[:2],
                                run.req_to_token_pool.req_to_token, HIGH, None, hostmap.TableView()) is None
    assert hostmap.check_decode(batch.out_cache_loc, batch.req_pool_indices, batch.seq_lens,
                                run.req_to_token_pool.req_to_token, HIGH, None,
                                hostmap.TableView()) == batch.out_cache_loc.tolist()


@pytest.mark.parametrize("uninstalled", [False, True])
def test_the_step_checks_view_of_req_to_token_lives_no_longer_than_its_pool(mp, guard, runner, uninstalled):
    """The guard keeps req_to_token's numpy view between steps (making it costs more than
    the rest of a decode step's check) on the pool's state, and the last steps' runners
    weakly (for a late report): an engine shut down inside a process (a test suite's, a
    notebook's) leaves neither its KV pool nor its table alive; nor does uninstall, which
    keeps the pool states for the graphs that may still replay their probes."""
    import gc
    import weakref

    guard("strict")
    run, _ = runner(mha(mp))
    for _ in range(2):
        run.forward(decode(run))
    if uninstalled:
        sglang_oobguard.uninstall()
    table = weakref.ref(run.req_to_token_pool.req_to_token)
    pool = weakref.ref(run.token_to_kv_pool)
    del run
    gc.collect()
    assert pool() is None and table() is None


def test_a_step_pool_no_liveness_shadow_holds_says_once_that_its_owner_and_read_checks_are_off(mp, guard, runner,
                                                                                               caplog):
    """Liveness on, but no tracked allocator keeps this pool's shadow: said once, by name."""
    guard("strict", liveness=True)
    pool = mha(mp)
    run, _ = runner(pool)
    for n in (1, 2):
        run.forward(decode(run, rows=(2,), seq_lens=(n,)))
    assert caplog.text.count(f"the owner check and the read check are off for {type(pool).__name__}: no liveness "
                             "shadow holds its ids") == 1


def test_the_activation_line_names_the_forwards_an_older_release_was_not_measured_on(guard, caplog):
    """On an older release measured with the engine (0.5.12, ...: but for its speculative and PD decode forwards)
    the write map is on and the line says what it leaves out and why; on 0.5.23 it names none."""
    from sglang_oobguard.model.maptargets import PD_DECODE, SPECULATIVE, WRITE_MAP_MEASURED
    from sglang_oobguard.model.targets import version_of_sglang

    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        guard("warn", liveness=True)
    line = next(r.getMessage() for r in caplog.records if "sglang_oobguard active" in r.getMessage())
    assert "write map on (not for: prebuilt" in line, line
    older = version_of_sglang() in WRITE_MAP_MEASURED
    for what in (SPECULATIVE, PD_DECODE):
        assert (f"{what} (not measured on sglang {version_of_sglang()})" in line) == older, line
    assert ("not measured" in line) == older, line
