"""Test-only: a token rotated at a wrong position, or fed another request's token (the position
check's faults, sglang_oobguard.checks.positions).

`OOBGUARD_POSITIONS=FAULT;FAULT;...`, each fault applied once, on one forward, to a copy of
the batch's `positions` (or `input_ids`): the target's, as `ForwardBatch.init_new` makes its
batch (upstream of the forward, as a bug there would be: the first forward too); a draft
step's, handed to that forward only, sglang's own tensor bound back after it (the draft loop
adds 1 to it in place after each step):
- `decode@N:T:+K`: the target's Nth decode forward (from 0): token T's position + K (a
  decode token's position shifted);
- `extend@N:R:+K`: the target's Nth extend forward: every token of request R + K (an extend
  request's positions offset);
- `swap@N:A:B`: the target's Nth extend forward: the last tokens of requests A and B swap
  their input_ids (a token id swapped between two requests);
- `draft@S:T:-K`: the draft runner's first decode forward at EAGLE draft step S (the same
  batch again is the next step, as the draft loop runs it): token T's position - K (a
  position not advanced: K = 1).

Each prints one line (`oobguard_faultinject: positions fault ...`) naming the forward, the
token, its request, and the position (or token) it had and got: the test matches the
guard's report against it, and a guard-off run shows the fault fired.
"""

from __future__ import annotations

import os
import sys

from . import outermost

_seen = {"decode": 0, "extend": 0}  # the target's forwards so far, by mode
_draft = {"batch": None, "step": -1}  # the draft loop's batch (by id, while it runs) and its step
_done: set[str] = set()
_outer: list[bool] = []


def _faults() -> list[tuple[str, int, int, int]]:
    out = []
    for part in filter(None, os.environ.get("OOBGUARD_POSITIONS", "").split(";")):
        kind, _, rest = part.partition("@")
        n, a, b = rest.split(":")
        out.append((kind, int(n), int(a), int(b)))
    return out


def _say(text: str) -> None:
    print(f"oobguard_faultinject: positions fault {text} (pid {os.getpid()})", file=sys.stderr, flush=True)


def _rows(batch) -> list[tuple[int, int]]:
    """(first token, token count) of each request of an extend batch."""
    starts, counts = batch.extend_start_loc.tolist(), batch.extend_seq_lens.tolist()
    return list(zip(starts, counts))


def _target(batch) -> None:
    """The target's faults due on this batch, as init_new made it (its tensors replaced)."""
    mode = batch.forward_mode.name.lower()
    rids = list(batch.rids or [])
    for kind, n, a, b in _faults():
        key = f"{kind}@{n}:{a}:{b}"
        if key in _done or kind == "draft" or mode != kind.replace("swap", "extend") or _seen.get(mode) != n:
            continue
        _done.add(key)
        if kind == "swap":
            ids = batch.input_ids.clone()
            (sa, ca), (sb, cb) = _rows(batch)[a], _rows(batch)[b]
            i, j = sa + ca - 1, sb + cb - 1
            ids[i], ids[j] = batch.input_ids[j], batch.input_ids[i]
            _say(f"{key}: extend {n} tokens {i} and {j} (requests {rids[a]} and {rids[b]}): input_ids "
                 f"{int(batch.input_ids[i])}, {int(batch.input_ids[j])} -> {int(ids[i])}, {int(ids[j])}")
            batch.input_ids = ids
            continue
        positions = batch.positions.clone()
        first, count = (a, 1) if kind == "decode" else _rows(batch)[a]
        positions[first:first + count] += b
        _say(f"{key}: {mode} {n} tokens {first}..{first + count - 1} request {rids[a] if rids else None}: positions "
             f"{int(batch.positions[first])}.. -> {int(positions[first])}..")
        batch.positions = positions
    if mode in _seen:
        _seen[mode] += 1


def _init_new(wrapped, instance, args, kwargs):
    made = wrapped(*args, **kwargs)
    runner = args[1] if len(args) > 1 else kwargs.get("model_runner")
    if not getattr(runner, "is_draft_worker", True):
        _target(made)
    return made


def _forward(wrapped, instance, args, kwargs):
    """A draft step's fault, on that forward only."""
    batch = args[0] if args else kwargs["forward_batch"]
    own = None
    if instance.is_draft_worker and batch.forward_mode.name.lower() == "decode":
        _draft["step"] = _draft["step"] + 1 if _draft["batch"] == id(batch) else 0
        _draft["batch"] = id(batch)
        for kind, n, a, b in _faults():
            key = f"{kind}@{n}:{a}:{b}"
            if kind == "draft" and n == _draft["step"] and key not in _done:
                _done.add(key)
                own, batch.positions = batch.positions, batch.positions.clone()
                batch.positions[a] += b
                _say(f"{key}: draft step {n} token {a} request {list(batch.rids or [None] * (a + 1))[a]}: position "
                     f"{int(own[a])} -> {int(batch.positions[a])}")
    try:
        return wrapped(*args, **kwargs)
    finally:
        if own is not None:
            batch.positions = own


def patch_batch(module) -> None:
    import wrapt

    wrapt.wrap_function_wrapper(module, "ForwardBatch.init_new", _init_new)


def patch_runner(module) -> None:
    """ModelRunner.forward with the fault's wrapper outermost (`outermost`)."""
    outermost.wrap_forward(module, _forward, _outer)
