"""The guard's GPU path on the CPU, under a model of the device's timing (tests/devmodel.py):
records read back late, a host steps ahead of the device, graphs that hold pointers,
two streams. The pools and allocators are sglang's real classes; the probe kernels run
in Triton's interpreter when the model runs them.

What only a device proves: the device-side assert's trap (the interpreter asserts
nothing: strict mode here shows the record and the absent copy, not the trap), real
concurrency between streams and inside a kernel (the model runs one op at a time, in
an order events and waits allow, adversarially), and timings."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

import sglang_oobguard
from devmodel import GraphError, Model
from helpers import SHIM, Layer, decode_batch, mha, run_python, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.checks import flush
from sglang_oobguard.probes import record

LAYERS, HIGH = 4, 65


@pytest.fixture(autouse=True)
def _first_write(sglang_first_write_made):
    """The graph tests see the guard's own references only."""


def first_report_step(run, model, bad_step: int, steps: int) -> int:
    """Run `steps` forward steps (the device `model.lag` steps behind), step `bad_step`
    with a bad id; the step at whose boundary the violation was first reported (-1: none)."""
    for step in range(steps):
        loc = torch.tensor([1, 2, HIGH + 5 if step == bad_step else 3])
        run.forward(decode_batch(loc))
        model.host_step()
        if sglang_oobguard.violations():
            return step
    return -1


# -- 1. reports under overlap -------------------------------------------------------


def bound(lag: int) -> int:
    """The worst-case delay in steps (record.PoolRecord): lag + 1 while the ring holds
    every copy in flight, plus the skipped copies' steps beyond."""
    return lag + 1 + max(0, lag + 1 - record.SLOTS)


@pytest.mark.parametrize("lag", [0, 1, 2, record.SLOTS - 1])
def test_a_violation_in_step_n_is_reported_at_step_n_plus_lag_plus_1(mp, guard, runner, lag):
    """The worst-case delay, proven: with the host `lag` steps ahead (sglang's overlap
    scheduler: 1), a violation recorded in step N is reported at step N + lag + 1's
    boundary, and not before (the copy that holds it has not landed)."""
    with Model(lag=lag) as model:
        guard("warn")
        pool = mha(mp)
        run = runner(pool)
        bad = 3
        reported = first_report_step(run, model, bad, bad + lag + 4)
        assert reported == bad + lag + 1 == bad + bound(lag), f"lag {lag}: reported at step {reported}"
        (v,) = sglang_oobguard.violations()
        assert (v.step, v.value, v.request) == (bad, HIGH + 5, "r2")
        assert pool._oobguard_state.record.skipped == 0


def test_raise_mode_raises_into_the_step_at_n_plus_lag_plus_1(mp, guard, runner):
    """The overlap scheduler (lag 1), raise mode: the forward of step N + 2 raises, from
    its step boundary, the violation of step N."""
    with Model(lag=1) as model:
        guard("raise")
        run = runner(mha(mp))
        raised = -1
        for step in range(6):
            try:
                run.forward(decode_batch(torch.tensor([1, 2, HIGH + 5 if step == 2 else 3])))
            except KVOutOfBoundsError as exc:
                raised = step
                assert exc.step == 2 and exc.value == HIGH + 5
                break
            finally:
                model.host_step()
        assert raised == 2 + 1 + 1


def test_reports_do_not_starve_over_many_steps(mp, guard, runner):
    """A violation every 4th step, the host one step ahead: each is read 2 steps later."""
    with Model(lag=1) as model:
        guard("warn")
        run = runner(mha(mp))
        state = run.token_to_kv_pool._oobguard_state
        seen = []
        for step in range(16):
            loc = torch.tensor([1, 2, HIGH + step if step % 4 == 1 else 3])
            run.forward(decode_batch(loc))
            model.host_step()
            seen.append(state.record.reported)
        assert seen == [0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3, 4], seen
        assert state.record.skipped == 0
        assert model.counts["event_syncs"] == 0 and model.counts["reads"] == 0  # the hot path never waits


def test_a_lag_beyond_the_ring_still_reports_within_the_bound(mp, guard, runner):
    """More steps in flight than slots: a copy is skipped while the ring is full, and
    a later one carries it (the record only grows). Every phase of the ring's cycle
    (lag + 1 steps) is tried: none is later than the bound, the worst one reaches it."""
    lag = record.SLOTS + 1
    with Model(lag=lag) as model:
        guard("warn")
        run = runner(mha(mp))
        state = run.token_to_kv_pool._oobguard_state
        delays = []
        for bad in range(lag + 1, 2 * lag + 2):  # past the start: the ring in its steady cycle
            model.synchronize()  # the last phase's copies land and are read: a fresh record
            state.record.poll(restart=False)
            state.record.reported = 0
            sglang_oobguard.activate.instrument._active.guard.reporter.latest.clear()
            state.record.tensor.zero_()
            for step in range(bad):  # clean steps up to the bad one
                run.forward(decode_batch(torch.tensor([1, 2, 3])))
                model.host_step()
            delays.append(first_report_step(run, model, 0, bound(lag) + 2))
        print(f"lag {lag}, {record.SLOTS} slots: delays {delays}, bound {bound(lag)}")
        assert max(delays) == bound(lag) and min(delays) >= lag + 1, delays
        assert state.record.skipped > 0


def test_idle_flush_reports_the_last_steps_violation(mp, guard, runner):
    """No step follows the bad one (an idle server): the idle flusher's looks read it,
    without a sync: the first look sees the steps stop, the next polls."""
    with Model(lag=1) as model:
        guard("warn")
        run = runner(mha(mp))
        for step in range(3):
            run.forward(decode_batch(torch.tensor([1, 2, HIGH + 1 if step == 2 else 3])))
            model.host_step()
        guard_obj = sglang_oobguard.activate.instrument._active.guard
        seen: dict = {}
        flush.idle_tick(guard_obj, seen)  # first look: steps ran since the last
        assert sglang_oobguard.violations() == []
        model.run()  # the device goes idle: the last step's copy lands
        flush.idle_tick(guard_obj, seen)
        (v,) = sglang_oobguard.violations()
        assert (v.step, v.value) == (2, HIGH + 1)
        assert model.counts["event_syncs"] == 0


@pytest.mark.parametrize("shutdown", [flush.at_exit, sglang_oobguard.uninstall], ids=["exit", "uninstall"])
def test_a_shutdown_waits_for_the_device_and_files_its_record(mp, guard, runner, caplog, shutdown):
    """Process exit and uninstall(): the record no step read yet is waited for and filed."""
    with Model(lag=2) as model:
        guard("warn")
        run = runner(mha(mp))
        run.forward(decode_batch(torch.tensor([1, HIGH + 2, 3])))
        model.host_step()
        assert sglang_oobguard.violations() == []
        with caplog.at_level(logging.WARNING, "sglang_oobguard"):
            shutdown()
        assert f"loc[1] = {HIGH + 2}" in caplog.text


WARN_EXIT = SHIM + """
import os, torch, sglang_oobguard
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
sglang_oobguard.install()
class Layer:
    layer_id = 1
pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu", False)
k = torch.ones(2, 2, 4)
pool.set_kv_buffer(Layer, torch.tensor([1, 2]), k, k)
pool.set_kv_buffer(Layer, torch.tensor([3, 70]), k, k)  # the last write: recorded on the device
print("exiting", flush=True)
"""


def test_warn_mode_on_the_kernel_path_reports_a_last_write_at_exit(tmp_path):
    """The user-visible defect: warn mode, the kernel path, a bad id in the last write,
    a normal exit: the warning is printed, the report file has its line, and
    `report` exits 1."""
    folder = tmp_path / "reports"
    proc = run_python(WARN_EXIT, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_BACKEND": "triton",
                                  "TRITON_INTERPRET": "1", "SGLANG_OOBGUARD_REPORT_DIR": str(folder)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "exiting" in proc.stdout
    print(proc.stderr[-1500:])
    assert "loc[1] = 70" in proc.stderr, proc.stderr[-2000:]
    lines = "".join(p.read_text() for p in folder.glob("oobguard-*.jsonl"))
    assert '"kind":"violation"' in lines.replace(" ", "")
    summary = run_python(f"import sys; from sglang_oobguard.__main__ import main; sys.exit(main(['report', {str(folder)!r}]))",
                         {})
    print(summary.stdout)
    assert summary.returncode == 1, summary.stdout


# -- 3. buffers a captured graph holds -----------------------------------------------


def capture_write(model, pool, loc, k, layer=0):
    """sglang's capture: the device synchronized, then one write captured."""
    model.synchronize()
    with model.graph() as graph:
        pool.set_kv_buffer(Layer(layer), loc, k, k)
    return graph


def test_the_model_graph_catches_a_freed_buffer():
    """The model's own check: a captured op's buffer freed, or resized, fails the replay."""
    from sglang_oobguard.probes import device

    with Model() as model:
        buf = torch.zeros(4)
        with model.graph() as graph:
            device.enqueue(buf.add_, 1)
        graph.replay()
        model.run()
        assert buf.tolist() == [1.0] * 4
        buf.untyped_storage().resize_(64)
        with pytest.raises(GraphError, match="resized"):
            graph.replay()
        del buf
        gc.collect()
        with pytest.raises(GraphError, match="freed"):
            graph.replay()


def test_the_model_orders_streams_by_waits_and_events_only():
    """The model itself: an unordered other stream runs first; a wait orders it; an
    event completes when the device reaches it; a mirror read early shows old contents."""
    from sglang_oobguard.probes import device

    with Model(lag=1) as model:
        a, b = model.new_stream("a"), model.new_stream("b")
        seen: list[str] = []
        with model.stream(a):
            device.enqueue(seen.append, "a1")
        with model.stream(b):
            device.enqueue(seen.append, "b1")
        model.synchronize()
        assert seen == ["b1", "a1"]  # no order between the streams: the adversary ran b first
        seen.clear()
        with model.stream(a):
            device.enqueue(seen.append, "a2")
        with model.stream(b):
            device.wait(b, a)
            device.enqueue(seen.append, "b2")
        model.synchronize()
        assert seen == ["a2", "b2"]
        src, dst = torch.tensor([7]), torch.tensor([0])
        event = device.event(src.device)
        device.copy_async(dst, src)
        event.record()
        model.host_step()  # the host is a step ahead: the device has not run this step yet
        assert not event.query() and dst.tolist() == [0]
        model.host_step()
        assert event.query() and dst.tolist() == [7]


def test_a_write_larger_than_the_copy_buffer_does_not_move_it(mp, guard, caplog):
    with Model(eager=True) as model:  # eager: the probe's copy is made before sglang's write reads it
        guard("warn")
        pool = mha(mp)
        k, loc = torch.ones(4, 2, 4), torch.tensor([1, 2, 3, 4])  # sglang's static buffers: alive
        graph = capture_write(model, pool, loc, k)
        assert len(graph.ops) == 1
        big = torch.arange(1, HIGH + 11) % HIGH  # more ids than slots: sglang never does this
        with caplog.at_level(logging.WARNING, "sglang_oobguard"):
            pool.set_kv_buffer(Layer(0), big, torch.ones(big.numel(), 2, 4), torch.ones(big.numel(), 2, 4))
        gc.collect()
        graph.replay()  # GraphError before the fix: the copy buffer grew (freed, reallocated)
        model.run()
        assert "probed, not contained" in caplog.text


def test_uninstall_keeps_what_a_captured_graph_holds(mp, guard):
    with Model() as model:
        guard("warn")
        pool = mha(mp)
        k, loc = torch.ones(3, 2, 4), torch.tensor([1, 2, 3])
        graph = capture_write(model, pool, loc, k)
        sglang_oobguard.uninstall()
        model.synchronize()
        gc.collect()
        graph.replay()  # GraphError before the fix: uninstall freed the record, copy buffer, counter
        model.run()


@pytest.mark.parametrize("size", [48, 96], ids=["shrink", "grow"])
def test_a_pool_resize_after_capture_keeps_the_captured_shadow(mp, guard, size):
    """The allocator's clear() after a resize (sglang sizes the KV pool after capture on
    some paths): the shadow the graph holds must stay where it was."""
    from sglang.srt.mem_cache import allocator

    with Model() as model:
        guard("warn", liveness=True)
        pool = mha(mp)
        alloc = token_allocator(allocator, pool)
        loc = alloc.alloc(3)
        graph = capture_write(model, pool, loc, torch.ones(3, 2, 4))
        pool.size = size
        alloc.size = size
        alloc.clear()
        model.synchronize()  # the device ran all that was enqueued: only the graph may point at the old shadow
        gc.collect()
        graph.replay()  # GraphError before the fix: the shadow was reallocated
        model.run()


# -- 8. stream waits: the ordering liveness needs -------------------------------------


def serve_two_streams(model, run, alloc, steps: int, frees: int = 2) -> list[int]:
    """sglang's overlap: the scheduling stream allocates, the forward stream writes, the
    scheduling stream frees `frees` times per step (no wait on the forward stream, as
    in sglang). The guard's waits per step."""
    forward, schedule = model.new_stream("forward"), model.new_stream("schedule")  # schedule newest: runs first
    per_step = []
    for _ in range(steps):
        before = model.counts["waits"]
        with model.stream(schedule):
            loc = alloc.alloc(frees + 1)
        forward.wait_stream(schedule)  # sglang's own: the forward reads what the schedule prepared
        model.counts["waits"] -= 1  # (not the guard's)
        with model.stream(forward):
            run.forward(decode_batch(loc))
        with model.stream(schedule):
            for i in range(frees):
                alloc.free(loc[i:i + 1])
            alloc.free(loc[frees:])
        model.host_step()
        per_step.append(model.counts["waits"] - before)
    model.synchronize()
    return per_step


@pytest.mark.parametrize("frees", [0, 2])
def test_waits_per_step_and_a_free_never_overtakes_a_probe(mp, guard, runner, record_property, frees):
    """The device picks the scheduling stream first whenever it may (adversarial): a
    free would clear the flag a write probe enqueued before it still reads, unless the
    guard ordered it. No false report in 6 steps, and the waits it costs per step."""
    from sglang.srt.mem_cache import allocator

    with Model(lag=1) as model:
        guard("raise", liveness=True)
        pool = mha(mp)
        alloc = token_allocator(allocator, pool)
        run = runner(pool)
        per_step = serve_two_streams(model, run, alloc, 6, frees)
        sglang_oobguard.check()
        assert sglang_oobguard.violations() == []
        record_property("guard_waits_per_step", per_step)
        print(f"guard waits per step ({frees + 1} frees, 1 alloc): {per_step}")
        assert max(per_step[1:]) <= 1  # one wait per step: the first shadow update after the step's probes


def test_without_the_guards_wait_the_model_shows_the_false_report(mp, guard, runner, monkeypatch):
    """The control: the same run with the guard's stream wait removed reports a freed
    slot that was live when its write was enqueued. So the test above is not vacuous."""
    from sglang.srt.mem_cache import allocator
    from sglang_oobguard.probes import device

    with Model(lag=1) as model:
        guard("warn", liveness=True)
        pool = mha(mp)
        alloc = token_allocator(allocator, pool)
        run = runner(pool)
        real = model.wait
        monkeypatch.setattr(model, "wait", lambda waiter, waited: None)
        monkeypatch.setattr(device, "wait", lambda waiter, waited: None)
        forward, schedule = model.new_stream("forward"), model.new_stream("schedule")  # schedule newest: runs first
        with model.stream(schedule):
            loc = alloc.alloc(3)
        real(forward, schedule)
        with model.stream(forward):
            run.forward(decode_batch(loc))
        with model.stream(schedule):
            alloc.free(loc)
        model.synchronize()
        sglang_oobguard.check()
        (v,) = sglang_oobguard.violations()
        assert "freed" in str(v) or v.value == int(loc[0]), v


# -- 6. CPU twins of tests/test_gpu.py and tests/test_gpu_observer.py ----------------
# Each names its GPU original. Eager models (the device keeps pace with the host) where
# sglang's own write must read the probe's copy: the model does not order sglang's ops.


def kv(n):
    return torch.randn(n, 2, 4)


def record_of(pool):
    return pool._oobguard_state.record.read_now()


def test_twin_raise_surfaces_at_check_and_contains(mp, guard):
    """test_gpu.py::test_raise_surfaces_at_check_and_contains."""
    with Model(lag=1):
        guard("raise", poll_every=1000)
        pool = mha(mp)
        pool.set_kv_buffer(Layer(2), torch.tensor([1, 70, 3]), kv(3), kv(3))
        with pytest.raises(KVOutOfBoundsError, match=r"layer 2: 1 of 3 slot ids outside \[0, 65\): loc\[1\] = 70"):
            sglang_oobguard.check()


def test_twin_raise_surfaces_at_a_later_guarded_call_without_sync(mp, guard):
    """test_gpu.py::test_raise_surfaces_at_a_later_guarded_call_without_sync: the guard
    never waits; once the device ran the copy, the next guarded call's poll reads it."""
    with Model(lag=1) as model:
        guard("raise", poll_every=1)
        pool = mha(mp)
        model.synchronize()  # the pool's warm-up
        pool.set_kv_buffer(Layer(0), torch.tensor([-1]), kv(1), kv(1))  # recorded; mirror copy enqueued
        pool.set_kv_buffer(Layer(0), torch.tensor([6]), kv(1), kv(1))  # the copy has not landed: no report
        assert model.counts["event_syncs"] == 0
        model.synchronize()
        with pytest.raises(KVOutOfBoundsError, match=r"loc\[0\] = -1"):
            pool.set_kv_buffer(Layer(0), torch.tensor([6]), kv(1), kv(1))
        assert model.counts["event_syncs"] == 0


def test_twin_warn_keeps_every_other_row_intact(mp, guard):
    """test_gpu.py::test_warn_keeps_every_other_row_intact."""
    with Model(eager=True):
        guard("warn")
        pool = mha(mp)
        before = pool.k_buffer[1].clone()
        k = kv(3)
        loc = torch.tensor([7, HIGH + 9, 8])
        pool.set_kv_buffer(Layer(1), loc, k, k)
        sglang_oobguard.check()
        after = pool.k_buffer[1]
        assert torch.equal(after[1:7], before[1:7]) and torch.equal(after[9:], before[9:])
        assert torch.equal(after[7], k[0]) and torch.equal(after[8], k[2])
        assert loc.tolist() == [7, HIGH + 9, 8]
        (v,) = sglang_oobguard.violations()
        assert (v.pos, v.value) == (1, HIGH + 9)


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_twin_graph_replay_checks_again_and_the_callers_ids_stay(mp, guard, mode):
    """test_gpu.py::test_cuda_graph_replay_checks_again and test_gpu_observer.py::
    test_graph_replay_contains_into_a_copy_and_the_callers_ids_stay (and, short of the
    trap, ::test_strict_graph_replay_fails_the_process): each replay probes again; raise
    and warn hand the captured write a copy with the bad ids sent to slot 0, strict
    the caller's ids (the assert stops the stream on a device; the interpreter asserts
    nothing, so strict's trap is proven on a device only)."""
    with Model(lag=1) as model:
        guard(mode, poll_every=1000)
        pool = mha(mp)
        loc, k = torch.tensor([1, 2, 3, 4]), kv(4)
        pool.set_kv_buffer(Layer(0), loc, k, k)  # sglang's eager warm-up runs
        graph = capture_write(model, pool, loc, k)
        (launch,) = [op for op in graph.ops if "launch" in op.label]
        clean = launch.args[2][15]  # what the captured write reads: the copy, or loc itself (strict)
        graph.replay()
        model.synchronize()
        sglang_oobguard.check()
        assert sglang_oobguard.violations() == []
        loc.copy_(torch.tensor([5, HIGH + 7, 6, -1]))
        graph.replay()
        model.synchronize()
        assert loc.tolist() == [5, HIGH + 7, 6, -1]  # the caller's (sglang's static) buffer is unchanged
        written = clean.tensor()
        if mode == "strict":
            assert written.data_ptr() == loc.data_ptr()  # no copy: the assert guards the write
        else:
            assert written.data_ptr() != loc.data_ptr() and written.tolist() == [5, 0, 6, 0]
        rec = record_of(pool)
        assert (rec.calls, rec.total_bad, rec.pos, rec.value) == (1, 2, 1, HIGH + 7)
        if mode == "warn":
            sglang_oobguard.check()
            (v,) = sglang_oobguard.violations()
            assert (v.bad, v.pos, v.value) == (2, 1, HIGH + 7)
        else:
            with pytest.raises(KVOutOfBoundsError, match=rf"2 of 4 slot ids outside \[0, {HIGH}\): loc\[1\] = {HIGH + 7}"):
                sglang_oobguard.check()


def test_twin_liveness_catches_a_freed_slot_in_the_probe_and_in_a_graph(mp, guard):
    """test_gpu.py::test_liveness_on_cuda_catches_a_freed_slot_in_the_probe_and_in_a_graph."""
    from sglang.srt.mem_cache import allocator

    with Model(lag=1) as model:
        guard("raise", poll_every=1000, liveness=True)
        pool = mha(mp)
        alloc = token_allocator(allocator, pool)
        loc, k = alloc.alloc(3), kv(3)
        pool.set_kv_buffer(Layer(1), loc, k, k)
        graph = capture_write(model, pool, loc, k, layer=1)
        graph.replay()
        model.synchronize()
        sglang_oobguard.check()
        freed = int(loc[2])
        alloc.free(loc[2:])
        graph.replay()  # the same captured write, now to a freed slot
        model.synchronize()
        with pytest.raises(KVOutOfBoundsError, match=rf"layer 1: loc\[2\] = {freed} is not allocated \(freed\)"):
            sglang_oobguard.check()


@pytest.mark.parametrize("mode,liveness", [("strict", False), ("raise", False), ("warn", False), ("strict", True)])
def test_twin_one_launch_per_guarded_write_and_per_layer(mp, guard, runner, mode, liveness):
    """test_gpu.py::test_one_launch_per_guarded_write_and_per_layer_of_a_decode_step,
    counted by the model: one launch per guarded write, L for L writes outside a forward
    step, and one per forward step (its out_cache_loc check serves the L layers)."""
    from sglang.srt.mem_cache import allocator

    with Model(lag=1) as model:
        guard(mode, liveness=liveness)
        pool = mha(mp)
        loc = token_allocator(allocator, pool).alloc(3) if liveness else torch.tensor([1, 2, 3])
        model.synchronize()
        k = kv(3)
        start = model.counts["launches"]
        pool.set_kv_buffer(Layer(0), loc, k, k)
        assert model.counts["launches"] - start == 1
        start = model.counts["launches"]
        for layer in range(LAYERS):
            pool.set_kv_buffer(Layer(layer), loc, k, k)
        assert model.counts["launches"] - start == LAYERS
        run = runner(pool)
        start = model.counts["launches"]
        for _ in range(3):
            run.forward(decode_batch(loc))
            model.host_step()
        assert model.counts["launches"] - start == 3
        model.synchronize()
        sglang_oobguard.check()
        assert sglang_oobguard.violations() == []


def test_twin_each_captured_graph_holds_one_probe_after_eager_warm_up(mp, guard):
    """test_gpu.py::test_each_captured_graph_holds_one_probe_after_sglangs_eager_warm_up."""
    with Model(lag=1) as model:
        guard("raise", poll_every=1000)
        pool = mha(mp)
        model.synchronize()
        k = kv(4)
        graphs = {}
        for bs in (2, 4):
            loc = torch.arange(1, bs + 1)

            def step(loc=loc, bs=bs) -> None:
                for layer in range(LAYERS):
                    pool.set_kv_buffer(Layer(layer), loc, k[:bs], k[:bs])

            start = model.counts["launches"]
            step()
            step()
            assert model.counts["launches"] - start == 2 * LAYERS  # eager runs: every write probed
            model.synchronize()
            with model.graph() as graph:
                step()
            assert sum("launch" in op.label for op in graph.ops) == 1  # one probe for the L layers
            graphs[bs] = (graph, loc)
        for bs, (graph, loc) in graphs.items():
            graph.replay()
            model.synchronize()
            sglang_oobguard.check()
            loc[-1] = 64 + 5
            graph.replay()
            model.synchronize()
            with pytest.raises(KVOutOfBoundsError, match=r"= 69"):
                sglang_oobguard.check()
            loc[-1] = bs


def test_twin_a_real_stale_write_across_streams_is_reported(mp, guard):
    """test_gpu_observer.py::test_a_real_stale_write_across_streams_is_reported: the free
    comes first on the scheduling stream, the forward stream waits for it (sglang's
    barrier) and then writes the freed slot: every layer's probe sees it."""
    from sglang.srt.mem_cache import allocator

    with Model(lag=1) as model:
        guard("raise", poll_every=1000, liveness=True)
        pool = mha(mp)
        alloc = token_allocator(allocator, pool)
        forward, schedule = model.new_stream("forward"), model.new_stream("schedule")
        with model.stream(schedule):
            loc = alloc.alloc(3)
        forward.wait_stream(schedule)
        with model.stream(schedule):
            alloc.free(loc[-1:])
        forward.wait_stream(schedule)
        k = kv(3)
        with model.stream(forward):
            for layer in range(LAYERS):
                pool.set_kv_buffer(Layer(layer), loc, k, k)
        model.synchronize()
        with pytest.raises(KVOutOfBoundsError, match=rf"loc\[2\] = {int(loc[2])} is not allocated \(freed\)"):
            sglang_oobguard.check()
        (v,) = sglang_oobguard.violations()
        assert v.calls == LAYERS


@pytest.mark.parametrize("seed", [0, 1])
def test_twin_probes_on_two_streams_fold_exact_totals(mp, guard, seed):
    """test_gpu_observer.py::test_probes_on_two_streams_fold_exact_totals, with the two
    streams' ops interleaved in a random order the model picks. (The model runs one
    kernel at a time: the atomics' behaviour under real concurrency is a device's.)"""
    import random

    rng = random.Random(seed)
    with Model(lag=0, pick=lambda runnable: rng.choice(runnable)) as model:
        guard("warn", poll_every=10**6)
        pool = mha(mp)
        streams = [model.new_stream("a"), model.new_stream("b")]
        bad = {0: torch.tensor([1, HIGH + 1, 2]), 1: torch.tensor([HIGH + 2, HIGH + 3, 3])}
        k = kv(3)
        model.synchronize()
        for i in range(40):
            with model.stream(streams[i % 2]):
                pool.set_kv_buffer(Layer(i % LAYERS), bad[i % 2], k, k)
        model.synchronize()
        sglang_oobguard.check()
        (v,) = sglang_oobguard.violations()
        assert (v.calls, v.total_bad) == (40, 20 * 1 + 20 * 2)
        assert (v.bad, v.pos, v.value) in ((1, 1, HIGH + 1), (2, 0, HIGH + 2))  # one call's details, not a mix


def test_the_read_back_and_ordering_source_calls_no_host_read():
    """tests/test_no_sync.py's source check, for the ring and the stream ordering:
    `.tolist()` only on a slot's numpy view of its pinned mirror (host memory)."""
    import ast
    import inspect
    import textwrap

    from sglang_oobguard.probes import device

    hot = [record.PoolRecord.poll, record.PoolRecord._consume, record.PoolRecord.start_copy, record.PoolRecord._start,
           record._Slot.landed, device.Order.probed, device.Order.after]
    for fn in hot:
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(fn)))):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                name, owner = node.func.attr, ast.unparse(node.func.value)
                if name in {"item", "tolist", "cpu", "numpy", "synchronize", "nonzero"}:
                    assert (name, owner) == ("tolist", "slot.view"), f"{fn.__qualname__}: {owner}.{name}()"
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id != "bool", f"{fn.__qualname__}: bool() on the hot path"


def test_the_real_backend_asks_for_a_stream_with_an_index(monkeypatch):
    """device.Cuda: a pool's device may be torch.device("cuda") with no index (sglang
    passes "cuda"); the raw stream read takes an int (checked with the runtime mocked)."""
    from sglang_oobguard.probes import device

    asked = []
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: asked.append(index) or 1234)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert device.CUDA.stream_id(torch.device("cuda")) == 1234
    assert device.CUDA.stream_id(torch.device("cuda", 1)) == 1234
    assert asked == [3, 1]
    assert device.CUDA.is_gpu(torch.device("cuda")) and not device.CUDA.is_gpu(torch.zeros(1))
    if not torch.cuda.is_initialized():
        assert device.CUDA.capturing() is False
