"""Call sites: the compact Python stack of an allocator call, interned to one int.

A slot's history (`probes.shadow`) says who last handed it out and who last gave it
back. At each allocator call the host walks a few frames above the call (no string
is made) and interns them, with the allocator method's label, as one int that the
per-slot arrays store. The text ("Scheduler.process_batch_result_decode
(scheduler_output_processor_mixin.py:321) > ... > free (TokenToKVPoolAllocator)")
is made only when a report needs it.

Standard library only: `summary` and `doctor` may import it without torch.
"""

from __future__ import annotations

import os
import sys
import threading
from types import CodeType, FrameType
from typing import Optional

DEPTH = 4  # frames kept above the allocator call
# the guard's layers (not its doors: the demo's frames are a caller's) and wrapt
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (tuple(os.path.join(_PACKAGE, layer) + os.sep for layer in ("model", "report", "probes", "checks", "activate")),
         f"{os.sep}wrapt{os.sep}")

# key: (label, id(code), line, ...) -> site; the code objects are kept alive in _STACKS,
# so an id in a key is never reused for another code object.
_IDS: dict[tuple, int] = {}
_STACKS: list[tuple[str, tuple[tuple[CodeType, int], ...]]] = []
_lock = threading.Lock()


def here(label: str, skip: int = 1) -> int:
    """The site of the call in progress: `label` (the allocator method) and the DEPTH
    frames above the caller `skip` frames up (the guard's and wrapt's own frames
    skipped). A few attribute reads and one dict lookup."""
    frame: Optional[FrameType] = sys._getframe(skip + 1)
    while frame is not None and frame.f_code.co_filename.startswith(_OURS[0]):
        frame = frame.f_back
    key: list = [label]
    frames = []
    while frame is not None and len(frames) < DEPTH:
        code = frame.f_code
        if _OURS[1] not in code.co_filename and not code.co_filename.startswith(_OURS[0]):  # ours: an adapter's
            key += (id(code), frame.f_lineno)
            frames.append((code, frame.f_lineno))
        frame = frame.f_back
    found = _IDS.get(tuple(key))
    if found is None:
        with _lock:
            found = _IDS.get(tuple(key))
            if found is None:
                found = len(_STACKS)
                _STACKS.append((label, tuple(frames)))
                _IDS[tuple(key)] = found
    return found


def _frame(code: CodeType, line: int) -> str:
    name = getattr(code, "co_qualname", code.co_name)
    return f"{name} ({os.path.basename(code.co_filename)}:{line})"


def text(site: int) -> Optional[str]:
    """A site's stack, outermost first, ending with the allocator method; None: unknown."""
    if not 0 <= site < len(_STACKS):
        return None
    label, frames = _STACKS[site]
    return " > ".join([*(_frame(code, line) for code, line in reversed(frames)), label])


# A step and a site packed in one int64 (the per-slot arrays store it): step << SITE_BITS | site.
SITE_BITS = 24


def pack(step: int, site: int) -> int:
    return (max(step, -1) + 1) << SITE_BITS | (site & ((1 << SITE_BITS) - 1))


NONE = -1  # no event yet


def unpack(value: int) -> tuple[int, int]:
    """(step, site) of a packed event; (-1, -1) for none."""
    if value < 0:
        return -1, -1
    return (value >> SITE_BITS) - 1, value & ((1 << SITE_BITS) - 1)
