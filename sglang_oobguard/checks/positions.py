"""Positions: each token of a forward step is rotated at its own position, and fed its own token.

The step check already knows, for each token i, the position p its slot holds in its
request's req_to_token row (the write map). sglang rotates the token's K at
`forward_batch.positions[i]`; when that is not p the slot is right, and every later read
of it sees a K rotated at the wrong place. Greedy outputs may stay the same: sglang PR
#25015 fixed an EAGLE draft loop that advanced positions one step early (verification
rejected the bad drafts; only the acceptance fell). sglang's own KV canary reports it as
POSITION_MISMATCH.

So at each step, before the layers write, every token's position is compared with the one
its forward mode gives it (`model.poslayout`): on the host for CPU tensors (`hostpos`), on
a GPU inside the step kernel's one launch. An EAGLE draft decode's step s is counted here
(the draft loop runs the same batch once per step): its positions must be seq_lens + s,
and the write map finds its slots from s. Where the scheduler knows the token (the target's
extend and decode, CPU ids), input_ids[i] must be the request's token at p, its prompt and
outputs as the ScheduleBatch that `ForwardBatch.init_new` was made from holds them (kept
by a hook on it): kind `token`. A token the scheduler does not hold yet (the overlap
scheduler's decode input, still in flight) is not compared.

A mismatch is not contained (the slot is right): strict stops the step before its layers
write; warn logs and the step runs on; raise files it before the forward and raises
after it (on a GPU: at the next check point).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any, Optional

import numpy as np
import torch

from ..model import poslayout, writemap
from ..model.config import Mode
from ..model.targets import write_map_off, write_map_unmeasured
from ..model.violation import Kind, site_id
from ..probes import hostpos
from ..probes.pools import PoolState
from ..probes.record import Record
from ..report.counts import slot
from ..report.reporter import KVOutOfBoundsError
from .guard import Guard
from .unit import Found, Unit

POSITION_LABEL, TOKEN_LABEL = "positions (forward step)", "input_ids (forward step)"
POSITION_SITE, TOKEN_SITE = site_id(POSITION_LABEL), site_id(TOKEN_LABEL)
REQS_ATTR = "_oobguard_reqs"  # on a ForwardBatch: its ScheduleBatch's reqs (the token check)
STEPS = slot("positions", "steps")
BATCH_MODULE = "sglang.srt.model_executor.forward_batch_info"


class Book:
    """The unit's state: the draft loop's step, and a raise mode's report held for after the forward."""

    __slots__ = ("batch", "step", "pending")

    def __init__(self) -> None:
        self.batch: Any = None  # the draft runner's last decode batch, held weakly
        self.step = -1  # its draft step
        self.pending: Optional[KVOutOfBoundsError] = None  # raise mode: raised once this step's forward ran


def draft_step(guard: Guard, runner: Any, batch: Any) -> int:
    """This forward's EAGLE draft step: the draft runner's decode of a batch seen at the last
    such forward is the next step, of another batch step 0; -1: not a draft decode."""
    book: Optional[Book] = guard.held.get("positions")
    if book is None or not getattr(runner, "is_draft_worker", False) or writemap.mode_of(batch) != "decode":
        return -1
    last = book.batch() if isinstance(book.batch, weakref.ref) else book.batch
    book.step = book.step + 1 if last is batch else 0
    try:
        book.batch = weakref.ref(batch)
    except TypeError:  # no weak reference: held until the next draft step
        book.batch = batch
    return book.step


def begin(guard: Guard) -> None:
    if "positions" in guard.held:
        guard.held["positions"].pending = None


def after_forward(guard: Guard) -> None:
    """Raise mode: the position or token report this step filed, raised now that it ran."""
    book: Optional[Book] = guard.held.get("positions")
    pending = None if book is None else book.pending
    if pending is not None:
        book.pending = None
        raise pending


def _report(guard: Guard, state: PoolState, finding: hostpos.PositionFinding, numel: int) -> None:
    site = TOKEN_SITE if finding.kind == Kind.TOKEN else POSITION_SITE
    record = finding.record(site, numel, guard.steps.number)
    if guard.config.mode is not Mode.RAISE:
        guard.report_now(state, record)  # strict raises before the layers write; warn logs
        return
    try:
        guard.report_now(state, record)
    except KVOutOfBoundsError as error:  # filed now; raised after the forward (not contained)
        if "positions" not in guard.held:
            raise
        guard.held["positions"].pending = error


def check_host(guard: Guard, state: PoolState, rule: writemap.Rule, batch: Any, runner: Any) -> None:
    """The step's positions (where its layout is known) and tokens (where the scheduler knows them)."""
    if not rule.expect:
        return
    guard.counts.n[STEPS] += 1
    finding = hostpos.check_positions(rule)
    if finding is not None:
        _report(guard, state, finding, rule.ids.numel())
    reqs = _requests(batch, runner, rule.batch)
    ids = getattr(batch, "input_ids", None)
    if reqs is None or rule.family not in ("extend", "decode") or not _host_ids(ids, rule.ids.numel()):
        return
    finding = hostpos.check_tokens(rule, ids.numpy(), lambda r, lo, hi: _known(reqs[r], lo, hi))
    if finding is not None:
        _report(guard, state, finding, rule.ids.numel())


def check_plain(guard: Guard, state: PoolState, runner: Any, batch: Any, seq_lens: torch.Tensor) -> None:
    """A plain decode step whose slots the fast check passed: its positions are seq_lens - 1,
    its tokens the requests' last (in lists: a few tokens); a mismatch is found again in full."""
    given = getattr(batch, "positions", None)
    if type(given) is not torch.Tensor or given.dim() != 1 or not given.is_cpu or \
            isinstance(poslayout.layout("decode", batch, runner, -1), str):
        return
    seq = seq_lens.tolist()
    n = len(seq)
    if given.numel() < n:
        return
    guard.counts.n[STEPS] += 1
    want = [s - 1 for s in seq]
    ids = getattr(batch, "input_ids", None)
    reqs = _requests(batch, runner, n)
    if given.tolist()[:n] == want and (reqs is None or not _host_ids(ids, n) or all(
            known is None or known == token for known, token in
            zip((_token_at(req, p) for req, p in zip(reqs, want)), ids.tolist()))):
        return
    guard.counts.n[STEPS] -= 1  # counted again by the full check
    rule = writemap.rule_of(batch, runner, -1, True)
    if not isinstance(rule, str):
        check_host(guard, state, rule, batch, runner)


def _host_ids(ids: Any, n: int) -> bool:
    return isinstance(ids, torch.Tensor) and ids.is_cpu and ids.dim() == 1 and ids.numel() >= n


def _requests(batch: Any, runner: Any, size: int) -> Optional[list]:
    """The batch's requests, where the scheduler's tokens are the forward's: the target
    runner, no input embeddings, no multimodal inputs, the same requests as the batch's rids."""
    reqs = getattr(batch, "__dict__", {}).get(REQS_ATTR)
    if reqs is None or len(reqs) != size or getattr(runner, "is_draft_worker", False) \
            or getattr(batch, "input_embeds", None) is not None or getattr(batch, "replace_embeds", None) is not None \
            or any(m is not None for m in getattr(batch, "mm_inputs", None) or ()):
        return None
    rids = getattr(batch, "rids", None)
    if rids is not None and [req.rid for req in reqs] != list(rids)[:size]:
        return None
    return reqs


def _token_at(req: Any, p: int) -> Optional[int]:
    """Request's token at position p (its prompt, then its outputs); None: not held yet."""
    origin = req.origin_input_ids
    if p < len(origin):
        return origin[p]
    out = req.output_ids
    return out[p - len(origin)] if p - len(origin) < len(out) else None


def _known(req: Any, lo: int, hi: int) -> np.ndarray:
    """The request's tokens at positions [lo, hi) that it holds (its prompt, then its outputs)."""
    origin, out = req.origin_input_ids, req.output_ids
    n = len(origin)
    head = origin[lo:min(hi, n)] if lo < n else ()
    tail = out[max(lo - n, 0):hi - n] if hi > n else ()
    return np.fromiter(itertools.chain(head, tail), dtype=np.int64)


def hook(module: Any, guard: Guard, wrap: Any) -> None:
    """ForwardBatch.init_new keeps its ScheduleBatch's reqs on the batch it makes (the token check)."""
    owner = getattr(module, "ForwardBatch", None)
    if owner is None or "init_new" not in vars(owner):
        return

    def init_new(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
        made = wrapped(*args, **kwargs)
        try:
            if "positions" in (guard.config.checks or ()):
                reqs = getattr(args[0] if args else kwargs.get("batch"), "reqs", None)
                if isinstance(reqs, list):
                    made.__dict__[REQS_ATTR] = reqs
        except Exception as exc:
            guard.internal_error("ForwardBatch.init_new (token check)", exc)
        return made

    wrap(owner, "init_new", init_new)


def fields(state: PoolState, record: Record) -> dict[str, Any]:
    """A position report's token (its position: the highest allowed), draft step and lowest position."""
    if record.kind != Kind.POSITION:
        return {}
    return {"token": record.expected, "draft_step": None if record.owner < 0 else record.owner,
            "lowest": record.head if record.head >= 0 else -1}


def doctor(found: Found) -> list[str]:
    return ["each token's positions[i] against its position in its request (extend and decode: its slot's; an "
            "EAGLE draft step s: seq_len + s; verify: a chain exactly, a tree within [seq_len, seq_len + j]); "
            "not checked:",
            *(f"  {name}: {why}" for name, why in poslayout.NOT_DERIVED),
            *(f"  {name}: {why} (the write map skips them)" for name, why in write_map_unmeasured()),
            "input_ids[i] against its request's token at that position: the target's extend and decode, CPU ids "
            "only (a GPU's would need a host copy), tokens the scheduler holds (ForwardBatch.init_new keeps the "
            f"batch's requests: {found(BATCH_MODULE, 'ForwardBatch', 'init_new')})"]


UNIT = Unit("positions", "a token rotated at a position not its own (its K), or fed a token not its request's",
            "per step: O(tokens), in the step kernel on a GPU", ("steps",),
            "the forward step (positions, input_ids), ForwardBatch.init_new", where=write_map_off,
            state=Book, modules=(BATCH_MODULE,), hook=hook, fields=fields, doctor=doctor)
