"""Steps: the forward steps as the guard numbers and remembers them.

Each step is numbered on the host and in a device counter the kernels read (so a
probe captured in a graph records the step of its replay). What maps a position of
out_cache_loc to its request is kept by reference for the last steps, and worked
out only when a report needs it: a step costs a few attribute reads, nothing more.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections import deque
from typing import Any, Iterator, NamedTuple, Optional

import torch

from ..probes import device
from ..probes.record import Kind
from . import owners

LAYOUTS_KEPT = 32  # steps whose layout a late report can still name
# What a step keeps of its batch, by reference (Seen's fields after the runner)
FIELDS = ("forward_mode", "batch_size", "rids", "req_pool_indices", "seq_lens_cpu", "extend_seq_lens_cpu",
          "extend_prefix_lens_cpu", "spec_info")
_FIELDS = operator.itemgetter(*FIELDS)


class Seen(NamedTuple):
    """What one step keeps of its batch: references to sglang's host-side values."""

    step: int
    runner: Any
    mode: Any  # sglang's ForwardMode
    batch_size: int
    rids: Optional[list]  # request ids (0.5.x); None: name the request's pool index
    pool_indices: Optional[torch.Tensor]  # req_pool_indices (read only for a report)
    seq_lens: Optional[torch.Tensor]  # seq_lens_cpu
    extend_lens: Optional[list]  # extend_seq_lens_cpu
    prefix_lens: Optional[list]  # extend_prefix_lens_cpu
    spec_info: Any  # speculative decoding's input (draft_token_num)


def _lengths(seen: Seen) -> tuple[Optional[list], Optional[list]]:
    """Tokens per request and the position of each request's first token in this
    step, from host-side values only."""
    mode, size = _mode(seen), seen.batch_size
    if mode == "decode" and getattr(seen.runner, "is_draft_worker", False):  # an EAGLE draft step: topk lanes a row
        topk = getattr(getattr(seen.runner, "server_args", None), "speculative_eagle_topk", None)
        return ([topk] * size, None) if isinstance(topk, int) else (None, None)  # positions: its draft step's
    if mode == "decode" and seen.seq_lens is not None:
        return [1] * size, [int(n) - 1 for n in seen.seq_lens[:size].tolist()]
    if seen.extend_lens is not None and len(seen.extend_lens) == size:
        prefix = seen.prefix_lens or [0] * size
        return [int(n) for n in seen.extend_lens], [int(n) for n in prefix]
    drafts = getattr(seen.spec_info, "draft_token_num", None)
    if isinstance(drafts, int) and seen.seq_lens is not None:  # target verify: the drafts follow the sequence
        return [drafts] * size, [int(n) for n in seen.seq_lens[:size].tolist()]
    return None, None


def _mode(seen: Seen) -> str:
    return getattr(seen.mode, "name", "unknown").lower()


def ranks_of(runner: Any) -> str:
    """"tp 1, pp 0, dp 0": from the model runner (0.4.x .. 0.5.1x), else from sglang's
    runtime context (0.5.2x keeps the ranks there); a rank neither knows is left out."""
    sources = [runner]
    try:
        from sglang.srt.runtime_context import get_parallel

        sources.append(get_parallel())
    except Exception:  # an older release: the runner is all there is
        pass
    found = {}
    for name in ("tp", "pp", "dp"):
        value = next((value for value in (_rank(src, name) for src in sources) if value is not None), None)
        if value is not None:
            found[name] = value
    return ", ".join(f"{name} {value}" for name, value in found.items())


def _rank(source: Any, name: str) -> Optional[int]:
    """One rank, or None: sglang's runtime context raises RuntimeError for a rank not
    written in this process, which must not cost a report its other fields."""
    try:
        value = getattr(source, f"{name}_rank", None)
    except Exception:
        return None
    return value if isinstance(value, int) else None


def _weakly(runner: Any) -> Any:
    """The runner held weakly where it takes a weak reference: the last steps kept for a
    late report must not keep an engine shut down in this process (its model runner, KV
    pool and req_to_token) alive. (`weakref.ref` hands back the runner's one reference.)"""
    try:
        return weakref.ref(runner)
    except TypeError:  # no weak references (slots): held as it is
        return runner


class Steps:
    """The process's step counter, its device copies, and the last steps' batches."""

    def __init__(self) -> None:
        self._next = itertools.count()  # next() is atomic: threads stepping at once get distinct numbers
        self.number = -1  # the latest step (-1: none yet)
        self.open = 0  # steps in progress on any thread (the idle flush waits for none)
        self.counters: dict[torch.device, torch.Tensor] = {}  # by device: made with its first probe
        self._seen: deque[tuple] = deque(maxlen=LAYOUTS_KEPT)  # (step, the runner held weakly, the batch's FIELDS)
        self._ranks: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

    def counter(self, device: torch.device) -> torch.Tensor:
        """The device's step counter (made with the first pool on that device)."""
        counter = self.counters.get(device)
        if counter is None:
            counter = self.counters[device] = torch.full((1,), self.number, dtype=torch.int64, device=device)
        return counter

    def begin(self, runner: Any, batch: Any, capturing: bool) -> int:
        """A new step: numbered, its counters set (not inside a capture, where the
        fill would be baked into the graph), its batch remembered."""
        number = self.number = next(self._next)
        for counter in self.counters.values() if self.counters else ():
            if not (capturing and device.is_gpu(counter)):  # a fill inside a capture would be baked into the graph
                device.enqueue(counter.fill_, number)  # in stream order with the probes
        try:  # one read of the batch's own dict (a ForwardBatch is a dataclass: every field is there)
            fields = _FIELDS(batch.__dict__)
        except KeyError:  # an older batch: what it has
            fields = tuple(map(batch.__dict__.get, FIELDS))
        except AttributeError:  # no __dict__ (slots)
            fields = tuple(getattr(batch, name, None) for name in FIELDS)
        self._seen.append((number, _weakly(runner), fields))
        return number

    def find(self, step: int) -> Optional[Seen]:
        found = next((seen for seen in reversed(self._seen) if seen[0] == step), None)
        if found is None:
            return None
        number, held, (mode, size, *rest) = found
        runner = held() if type(held) is weakref.ref else held  # None: its engine was shut down
        return None if runner is None else Seen(number, runner, mode, int(size or 0), *rest)

    def recent(self) -> Iterator[Seen]:
        """The kept steps, newest first (those whose engine was shut down left out)."""
        kept = (self.find(step) for step in range(self.number, max(-1, self.number - LAYOUTS_KEPT), -1))
        return (seen for seen in kept if seen is not None)

    def ranks(self, runner: Any) -> str:
        """Read once per runner (a process's ranks stay); a runner that cannot be a
        weak key is read every time."""
        try:
            ranks = self._ranks.get(runner)
            if ranks is None:
                ranks = self._ranks[runner] = ranks_of(runner)
            return ranks
        except TypeError:
            return ranks_of(runner)

    def where(self, record: Any) -> dict[str, Any]:
        """The Violation fields of a record's first bad id: its step, and the request
        and token when the ids follow out_cache_loc's order (same count, or padded
        after); for a write-map or owner violation, the owner too."""
        seen = self.find(record.step) if record.step >= 0 else None
        if record.kind in owners.READ_KINDS:
            return self._read(seen, record)
        fields = self._where(record.step, record.pos, record.numel)
        if record.kind not in owners.NAMED_KINDS:
            return fields
        try:
            return {**fields, **owners.named(owners.of_step(seen), record.kind, record.row, fields.get("token"),
                                             record.value, record.owner, record.expected)}
        except Exception:  # a report names what it can
            return fields

    def _read(self, seen: Optional[Seen], record: Any) -> dict[str, Any]:
        """A read check's record: the reader (the batch's row `record.row`), the
        position it read (`record.pos`), and the slot's holder, unless it was freed."""
        fields = self._where(record.step, -1, 0)
        if seen is None:
            return fields
        fields.update(request=self.request(seen, record.row), token=record.pos)
        if record.kind == Kind.READ_FREED:
            return fields
        try:
            found = owners.holder(owners.of_step(seen), record.value, prefer=record.owner, own=(record.row, record.pos))
        except Exception:  # a report names what it can
            found = None
        if found is not None:
            fields["owner"], fields["owner_token"] = found
        return fields

    def _where(self, step: int, pos: int, numel: int) -> dict[str, Any]:
        seen = self.find(step) if step >= 0 else None
        if seen is None:
            return {"step": step}
        fields: dict[str, Any] = {"step": step, "mode": _mode(seen), "batch_size": seen.batch_size,
                                  "ranks": self.ranks(seen.runner) or None}
        counts, firsts = _lengths(seen)
        if counts is None or pos < 0 or numel < sum(counts):
            return fields
        if pos >= sum(counts):
            fields["request"] = "padding (beyond the batch's tokens)"
            return fields
        row = 0
        while pos >= counts[row]:
            pos -= counts[row]
            row += 1
        fields["request"] = self.request(seen, row)
        if firsts is not None:
            fields["token"] = firsts[row] + pos
        return fields

    @staticmethod
    def request(seen: Seen, row: int) -> Optional[str]:
        """The name of the batch's request at `row`: its rid, else its pool index."""
        if seen.rids is not None and row < len(seen.rids):
            return str(seen.rids[row])
        if seen.pool_indices is not None:
            return f"req_pool_indices[{row}] = {int(seen.pool_indices[row])}"  # a report's read, not the hot path
        return None
