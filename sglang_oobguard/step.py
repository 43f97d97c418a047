"""Step: the forward step as the guard sees it.

sglang runs every forward pass through `ModelRunner.forward(forward_batch, ...)` (all
releases of the matrix). Wrapping it gives the guard a step boundary:

- the deferred GPU records are read there (no sync), so a violation inside a CUDA-graph
  replay is reported at most a step or two later, on a decode-only server too;
- `forward_batch.out_cache_loc` is checked once, before any layer runs, against the
  pool it targets: whatever writer uses those ids next (a pool method, the fused RoPE
  store, an attention op that writes K/V itself) is covered by this one check, and
  the layers' own probes of the same ids object in the same step are skipped;
- the step is numbered (on the host, and in a device counter the kernels read, so a
  probe captured in a graph records the step of its replay), and its request layout
  is kept for a few steps, from host-side values sglang already has, so a report read
  later names the request and the token.
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any, NamedTuple, Optional

import torch

LAYOUTS_KEPT = 32  # steps whose layout a late report can still name


class Layout(NamedTuple):
    """One step's batch: what maps a position in out_cache_loc to its request."""

    step: int
    mode: str  # sglang's ForwardMode, lower case: extend, decode, target_verify, draft_extend, idle, ...
    batch_size: int
    ranks: str  # "tp 0, pp 0, dp 0" (the ranks the model runner knows)
    rids: Optional[list]  # request ids (0.5.x); None: name the request's pool index
    pool_indices: Optional[torch.Tensor]  # req_pool_indices (read only for a report)
    counts: Optional[list]  # tokens per request in this step, in out_cache_loc's order
    firsts: Optional[list]  # per request: the token index of its first token in this step


def _lengths(batch: Any, mode: str, size: int) -> tuple[Optional[list], Optional[list]]:
    """Tokens per request and the index of each request's first token, from host-side
    values only (no device read)."""
    seq_lens = getattr(batch, "seq_lens_cpu", None)
    extend = getattr(batch, "extend_seq_lens_cpu", None)
    if mode == "decode" and seq_lens is not None:
        return [1] * size, [int(n) - 1 for n in seq_lens[:size].tolist()]
    if extend is not None and len(extend) == size:
        prefix = getattr(batch, "extend_prefix_lens_cpu", None) or [0] * size
        return [int(n) for n in extend], [int(n) for n in prefix]
    drafts = getattr(getattr(batch, "spec_info", None), "draft_token_num", None)
    if isinstance(drafts, int) and seq_lens is not None:  # target verify: the draft tokens follow the sequence
        return [drafts] * size, [int(n) for n in seq_lens[:size].tolist()]
    return None, None


def _ranks(runner: Any) -> str:
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
    written in this process, which must not cost the step its check."""
    try:
        value = getattr(source, f"{name}_rank", None)
    except Exception:
        return None
    return value if isinstance(value, int) else None


def layout(step: int, ranks: str, batch: Any) -> Layout:
    mode = getattr(getattr(batch, "forward_mode", None), "name", "unknown").lower()
    size = int(getattr(batch, "batch_size", 0) or 0)
    counts, firsts = _lengths(batch, mode, size)
    return Layout(step, mode, size, ranks, getattr(batch, "rids", None), getattr(batch, "req_pool_indices", None),
                  counts, firsts)


class Steps:
    """The process's step counter, its device copies, and the last steps' layouts."""

    def __init__(self) -> None:
        self.number = -1  # -1: no forward step yet
        self.depth = 0  # forward steps in progress (a nested forward counts as its own step)
        self._counters: dict[torch.device, torch.Tensor] = {}
        self._layouts: deque[Layout] = deque(maxlen=LAYOUTS_KEPT)
        self._ranks: "weakref.WeakKeyDictionary[Any, str]" = weakref.WeakKeyDictionary()

    @property
    def open(self) -> bool:
        return self.depth > 0

    def counter(self, device: torch.device) -> torch.Tensor:
        """The device's step counter (made with the first pool on that device)."""
        counter = self._counters.get(device)
        if counter is None:
            counter = self._counters[device] = torch.full((1,), self.number, dtype=torch.int64, device=device)
        return counter

    def begin(self, runner: Any, batch: Any) -> Layout:
        self.number += 1
        self.depth += 1  # first: the hook's step_end undoes it whatever fails below
        capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
        for counter in self._counters.values():
            if not (counter.is_cuda and capturing):
                counter.fill_(self.number)
        self._layouts.append(layout(self.number, self._ranks_of(runner), batch))
        return self._layouts[-1]

    def _ranks_of(self, runner: Any) -> str:
        """Read once per runner (a process's ranks stay); a runner that cannot be a
        weak key (no __weakref__, unhashable) is read every step instead."""
        try:
            ranks = self._ranks.get(runner)
            if ranks is None:
                ranks = self._ranks[runner] = _ranks(runner)
            return ranks
        except TypeError:
            return _ranks(runner)

    def end(self) -> None:
        self.depth -= 1

    def find(self, step: int) -> Optional[Layout]:
        return next((lay for lay in reversed(self._layouts) if lay.step == step), None)


def request_of(lay: Layout, pos: int, numel: int) -> dict[str, Any]:
    """The request and token a position of that step's ids stands for (the Violation
    fields), when the ids follow out_cache_loc's order (same count, or padded after)."""
    fields: dict[str, Any] = {"step": lay.step, "mode": lay.mode, "batch_size": lay.batch_size,
                              "ranks": lay.ranks or None}
    if lay.counts is None or pos < 0:
        return fields
    tokens = sum(lay.counts)
    if numel < tokens:
        return fields
    if pos >= tokens:
        fields["request"] = "padding (beyond the batch's tokens)"
        return fields
    for i, count in enumerate(lay.counts):
        if pos < count:
            break
        pos -= count
    if lay.rids is not None and i < len(lay.rids):
        fields["request"] = str(lay.rids[i])
    elif lay.pool_indices is not None:
        fields["request"] = f"req_pool_indices[{i}] = {int(lay.pool_indices[i])}"  # a report's read, not the hot path
    if lay.firsts is not None:
        fields["token"] = lay.firsts[i] + pos
    return fields


def make_forward_hook(guard: Any, pool_attr: str) -> Any:
    """The wrapt wrapper for ModelRunner.forward: the step boundary (reports), then one
    check of out_cache_loc against the runner's pool, then the forward itself."""
    from .report import KVOutOfBoundsError

    def wrapper(wrapped: Any, runner: Any, args: tuple, kwargs: dict) -> Any:
        batch = args[0] if args else kwargs.get("forward_batch")
        swap = None  # [ownership] the cleaned ids this forward writes with
        try:
            swap = guard.step_begin(runner, batch, getattr(runner, pool_attr, None))
        except KVOutOfBoundsError:
            guard.step_end()
            raise
        except Exception as exc:
            guard.internal_error("ModelRunner.forward (step check)", exc)
        if swap is not None:  # [ownership] bound for this forward only; sglang's tensor is restored after it
            batch.out_cache_loc, swap = swap, batch.out_cache_loc
        try:
            return wrapped(*args, **kwargs)
        finally:
            if swap is not None:  # [ownership]
                batch.out_cache_loc = swap
            guard.step_end()

    return wrapper
