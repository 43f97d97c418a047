"""The KV transfer check (checks/transfer.py) on sglang's real decode-side send
(`DecodePreallocQueue._send_kv_metadata`), the real fake-backend receiver, a real MHA pool
with sglang's token allocator and ReqToTokenPool: destination pages outside the page space,
freed, or another request's are reported at the send; a free of pages in flight is reported
until the transfer really ended, and warn mode holds them back until then.
(helpers.DecodeSide says how the queue is built)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch

import pytest

import sglang_oobguard
from helpers import DecodeSide, has, mha, needs, token_allocator
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.checks import inflight, transfer

TOKENS = 8  # the request's prompt: 8 tokens, page size 1


@pytest.fixture
def decode():
    needs("DecodePreallocQueue._send_kv_metadata")
    from sglang.srt.disaggregation import decode

    return decode


@pytest.fixture
def side(mp, guard, decode):
    """make(mode): the guard with liveness, a real pool, its allocator, sglang's decode-side send."""
    from sglang.srt.mem_cache import allocator as allocators

    def make(mode: str):
        guard(mode, liveness=True)
        side = DecodeSide(token_allocator(allocators, mha(mp, 64)))
        side.request = functools.partial(side.request, tokens=TOKENS)
        return side

    return make


def test_a_clean_send_passes_on_and_its_pages_are_in_flight(side):
    s = side("strict")
    req, slots = s.request("r0", 0, 7)
    s.send(req, slots)
    assert req.kv_receiver.has_sent_metadata  # sglang's send went on
    guard = sglang_oobguard.activate.instrument._active.guard
    table = next(iter(guard.held["pd"].tables.values()))  # page -> the key of its transfer in flight
    assert set(table.nonzero()[0].tolist()) == set(slots.tolist())


@pytest.mark.parametrize("fault,kind,text", [
    ("high", "bounds", "outside [0, 65)"),
    ("freed", "freed", "is not allocated (freed)"),
    ("other", "other_request", "is not this token's slot (req_to_token holds"),
])
def test_bad_destination_pages_are_reported_at_the_send_naming_the_request(side, fault, kind, text):
    s = side("strict")
    req, slots = s.request("r0", 0, 7)
    other, theirs = s.request("r1", 1, 8)
    bad = slots.clone()
    if fault == "high":
        bad[3] = 70
    elif fault == "freed":
        s.alloc.free(slots[3:4])
    else:
        bad[3] = theirs[0]
    with pytest.raises(KVOutOfBoundsError) as info:
        s.send(req, bad)
    violation = info.value.violation
    assert (violation.kind, violation.pos, violation.request, violation.room) == (kind, 3, "r0", 7)
    assert violation.label == transfer.SEND_LABEL and text in str(violation)
    assert not req.kv_receiver.has_sent_metadata  # strict: raised before the pages reached prefill


def poll(s, req, state):
    """The transfer queue's poll of one request, as the hook sees its result."""
    guard = sglang_oobguard.activate.instrument._active.guard
    transfer.polled(guard, SimpleNamespace(queue=[req]), [state])


def test_a_free_in_flight_is_reported_until_success(side):
    from sglang.srt.disaggregation.base.conn import KVPoll

    s = side("strict")
    req, slots = s.request("r0", 0, 7)
    s.send(req, slots)
    with pytest.raises(KVOutOfBoundsError) as info:
        s.alloc.free(slots)
    violation = info.value.violation
    assert (violation.kind, violation.request, violation.room, violation.bad) == ("in_flight", "r0", 7, TOKENS)
    assert f"page {int(slots[0])} freed while a KV transfer into it is in flight (request r0, bootstrap room 7" \
        in str(violation)
    poll(s, req, KVPoll.Success)
    s.alloc.free(slots)  # the write ended: a free like any other


def test_failed_ends_a_transfer_once_its_armed_drain_signal_says_so(side, monkeypatch):
    from sglang.srt.disaggregation.base.conn import KVPoll

    s = side("strict")
    req, slots = s.request("r0", 0, 7)
    s.send(req, slots)
    drained = []
    monkeypatch.setattr(type(s.manager), "enable_deferred_decode_kv_release", True)
    monkeypatch.setattr(type(s.manager), "is_abort_release_safe", lambda self, room, acks: bool(drained), raising=False)
    req.kv_receiver.abort()
    poll(s, req, KVPoll.Failed)
    with pytest.raises(KVOutOfBoundsError) as info:  # aborted, Failed, but the backend has not drained
        s.alloc.free(slots)
    assert "is in flight (request r0" in str(info.value.violation) and not info.value.violation.no_drain
    drained.append(True)
    s.alloc.free(slots)


def abort_without_drain_signal(s, rid: str, row: int, room: int):
    """A request sent, then aborted: the fake backend's receiver (no drain signal) polls Failed."""
    from sglang.srt.disaggregation.base.conn import KVPoll

    req, slots = s.request(rid, row, room)
    s.send(req, slots)
    assert inflight.drain_signal(req.kv_receiver) is None  # the real fake backend cannot say its writes drained
    req.kv_receiver.abort()
    poll(s, req, KVPoll.Failed)
    return req, slots


@pytest.mark.parametrize("armed_off", [False, True], ids=["fake backend", "deferred release off"])
def test_a_failed_transfer_with_no_drain_signal_stays_in_flight(side, monkeypatch, armed_off):
    """Failed is not 'ended' where the backend cannot say the writes drained (#23020)."""
    s = side("strict")
    if armed_off:  # a backend with the signal, but sglang's deferred release switched off: not armed
        monkeypatch.setattr(type(s.manager), "is_abort_release_safe", lambda self, room, acks: True, raising=False)
    req, slots = abort_without_drain_signal(s, "r0", 0, 7)
    with pytest.raises(KVOutOfBoundsError) as info:
        s.alloc.free(slots)
    violation = info.value.violation
    assert (violation.kind, violation.request, violation.room, violation.no_drain) == ("in_flight", "r0", 7, True)
    assert "freed while a KV transfer into it may still be in flight (no drain signal) (request r0, " \
        "bootstrap room 7" in str(violation)
    assert violation.as_dict()["no_drain"] is True


def test_warn_holds_a_failed_transfers_pages_with_no_drain_signal_for_sglangs_release_timeout(side, monkeypatch,
                                                                                             caplog):
    """Not handed out during the hold; given back after sglang's deferred-release timeout, logged."""
    import logging
    import time

    monkeypatch.setenv("SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT", "0.3")
    s = side("warn")
    req, slots = abort_without_drain_signal(s, "r0", 0, 7)
    before = s.alloc.available_size()
    s.alloc.free(slots)
    assert s.alloc.available_size() == before  # held: not on the free list
    (violation,) = sglang_oobguard.violations()
    assert violation.no_drain and "may still be in flight (no drain signal)" in str(violation)
    guard = sglang_oobguard.activate.instrument._active.guard
    everything = s.alloc.alloc(before)  # all the allocator has: none of the held pages
    assert not set(everything.tolist()) & set(slots.tolist()) and guard.held["pd"].holding()
    s.alloc.free(everything)
    guard.held["pd"].settle()  # as sglang's resolve_deferred_releases runs it: the timeout has not passed
    assert guard.held["pd"].holding()
    time.sleep(0.35)
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        guard.held["pd"].settle()
    assert not guard.held["pd"].holding() and s.alloc.available_size() == before + TOKENS
    assert "the backend has no drain signal for the KV transfer of request r0 (bootstrap room 7) after 0 s: " \
        f"the {TOKENS} pages held back go to the free list now" in caplog.text


def test_warn_holds_in_flight_pages_back_and_gives_them_back_when_the_transfer_ends(side):
    from sglang.srt.disaggregation.base.conn import KVPoll

    s = side("warn")
    req, slots = s.request("r0", 0, 7)
    s.send(req, slots)
    before = s.alloc.available_size()
    s.alloc.free(slots)
    assert s.alloc.available_size() == before  # held: not on the free list
    assert sglang_oobguard.violations()[0].kind == "in_flight"
    guard = sglang_oobguard.activate.instrument._active.guard
    assert guard.held["pd"].holding()
    poll(s, req, KVPoll.Success)
    assert s.alloc.available_size() == before + TOKENS and not guard.held["pd"].holding()
    everything = s.alloc.alloc(s.alloc.available_size())  # each slot once on the free list, the held ones back
    assert len(set(everything.tolist())) == everything.numel() and set(slots.tolist()) <= set(everything.tolist())


def test_a_clear_forgets_the_transfers_and_what_was_held(side):
    s = side("warn")
    req, slots = s.request("r0", 0, 7)
    s.send(req, slots)
    s.alloc.free(slots)
    s.alloc.clear()
    guard = sglang_oobguard.activate.instrument._active.guard
    assert not guard.held["pd"].holding() and not guard.held["pd"].by_request


@pytest.fixture
def prefill(mp, guard):
    """make(mode): sglang's prefill-side chunk send (`_send_kv_chunk`, its mixin built without a
    scheduler: only the attributes a non-last chunk reads are set) over a real pool and allocator,
    and a request of 8 prompt tokens with the fake backend's real sender."""
    needs("SchedulerDisaggregationPrefillMixin._send_kv_chunk")
    from sglang.srt.disaggregation.fake.conn import FakeKVManager, FakeKVSender
    from sglang.srt.disaggregation.prefill import SchedulerDisaggregationPrefillMixin
    from sglang.srt.mem_cache import allocator as allocators

    def make(mode: str):
        guard(mode, liveness=True)
        side = DecodeSide(token_allocator(allocators, mha(mp, 64)))  # its allocator and ReqToTokenPool
        scheduler = object.__new__(SchedulerDisaggregationPrefillMixin)
        scheduler.__dict__.update(token_to_kv_pool_allocator=side.alloc, req_to_token_pool=side.rows,
                                  enable_staging=False, disagg_prefill_pending_chunk_rids=set())
        reqs = []
        for row in range(2):
            slots = side.alloc.alloc(TOKENS)
            side.rows.req_to_token[row, :TOKENS] = slots
            reqs.append(SimpleNamespace(rid=f"p{row}", kv=SimpleNamespace(req_pool_idx=row), bootstrap_room=20 + row,
                                        origin_input_ids=list(range(TOKENS)), extend_end=TOKENS, start_send_idx=0,
                                        disagg_decode_prefix_len=0,
                                        disagg_kv_sender=FakeKVSender(FakeKVManager(None, None, None), "h", 20 + row)))
        return side, scheduler, reqs

    return make


def test_prefill_sends_of_the_rows_own_live_pages_pass(prefill):
    side, scheduler, (req, _) = prefill("strict")
    scheduler._send_kv_chunk(req)
    assert req.disagg_kv_sender.has_sent and req.start_send_idx == TOKENS  # sglang's send went on


@pytest.mark.parametrize("fault,kind", [("freed", "freed"), ("other", "other_request")])
def test_prefill_source_pages_freed_or_of_another_request_are_reported(prefill, monkeypatch, fault, kind):
    side, scheduler, (req, other) = prefill("strict")
    if fault == "freed":  # the row still names a slot given back
        side.alloc.free(side.rows.req_to_token[0, 2:3].clone())
    else:  # a translation that maps slot 2 of the row to the other request's first slot
        monkeypatch.setattr(type(side.alloc), "translate_kv_indices_for_transfer",
                            lambda self, ids: torch.cat([ids[:2], side.rows.req_to_token[1, :1], ids[3:]]))
    with pytest.raises(KVOutOfBoundsError) as info:
        scheduler._send_kv_chunk(req)
    violation = info.value.violation
    assert (violation.kind, violation.pos, violation.request, violation.room) == (kind, 2, "p0", 20)
    assert violation.label == transfer.SOURCE_LABEL and not req.disagg_kv_sender.has_sent


def test_the_activation_line_says_which_kv_transfer_checks_run_and_from_which_release(guard, caplog):
    """Read from sglang's classes (helpers.has asks them too): each feature check this release
    lacks is named off, with the release it needs; the others run where sglang runs the feature."""
    import importlib
    import logging

    from sglang_oobguard.activate import activation
    from sglang_oobguard.model.transfertargets import HICACHE_POOLS, HICACHE_SINCE, TRANSFER_MODULES, TRANSFER_SINCE

    for module in (*TRANSFER_MODULES, *(module for module, _ in HICACHE_POOLS)):
        try:
            importlib.import_module(module)  # as the engine would: the facts come with the import
        except ImportError:
            pass  # not in this release
    pd = has("DecodePreallocQueue._send_kv_metadata") and has("SchedulerDisaggregationPrefillMixin._send_kv_chunk")
    hicache = has("MHATokenToKVPoolHost.load_to_device_per_layer")
    with caplog.at_level(logging.INFO, logger="sglang_oobguard"):
        guard("warn", liveness=True)
    line = next(r.getMessage() for r in caplog.records if "sglang_oobguard active" in r.getMessage())
    assert ("pd check on where sglang runs PD disaggregation" in line) == pd, line
    assert ("pd check off (this sglang has no DecodePreallocQueue._send_kv_metadata" in line) != pd, line
    assert f"(sglang {TRANSFER_SINCE}+)" in line or pd
    assert ("hicache check on where sglang runs HiCache" in line) == hicache, line
    assert f"(sglang {HICACHE_SINCE}+)" in line or hicache
    absent = " ".join(activation.absent_hooks())
    assert ("the pd check (this sglang has no" in absent) != pd and ("the hicache check (" in absent) != hicache


def test_an_swa_allocators_transfers_are_checked_on_its_full_sub_allocators_shadow(guard, decode, caplog):
    """sglang's SWATokenToKVPoolAllocator over a real SWAKVPool: req_to_token and the sent
    pages hold full ids, so the send and the in-flight free read the full sub-allocator's
    shadow; its SWA destination pages are said once not to be checked."""
    needs("SWATokenToKVPoolAllocator")
    from helpers import swa_allocator, swa_pool

    guard("strict", liveness=True)
    allocator = swa_allocator(swa_pool(1))
    s = DecodeSide(allocator)
    req, slots = s.request("r0", 0, 7, tokens=TOKENS)
    allocator.free(slots[3:4])
    with pytest.raises(KVOutOfBoundsError) as info:
        s.send(req, slots)
    violation = info.value.violation
    assert (violation.kind, violation.pos, violation.request, violation.pool) == (
        "freed", 3, "r0", "SWAKVPool.full_kv_pool (full ids)")
    other, theirs = s.request("r1", 1, 8, tokens=TOKENS)
    s.send(other, theirs)
    with pytest.raises(KVOutOfBoundsError) as info:
        allocator.free(theirs)  # sglang's SWA free: its full half goes back in flight
    assert (info.value.violation.kind, info.value.violation.request) == ("in_flight", "r1")
    assert caplog.text.count("PD transfer check on SWATokenToKVPoolAllocator: not checked: a PD transfer's SWA "
                             "destination pages") == 1
