"""Call sites: the compact Python stack of an allocator call, interned to one int.

A slot's history (`probes.shadow`) says who last handed it out and who last gave it
back. At each allocator call the host walks a few frames above the call and interns
them, with the allocator method's label, as one int that the per-slot arrays store.
The text ("Scheduler.process_batch_result_decode (scheduler_output_processor_mixin.py:321)
> ... > free (TokenToKVPoolAllocator)") is made only when a report needs it.

The hot path reads no frame's locals and makes no string: per frame its code object's id
(whether it is the guard's own, looked up once per code object) and its instruction
offset, one tuple, one dict look-up (about 1 us a call on the CPU reference,
`bench/history_reads.py`). A key seen for the first time is interned by code object and
line (the offset's line, worked out then): two calls on one line share one site.

Standard library only: `summary` and `doctor` may import it without torch.
"""

from __future__ import annotations

import os
import sys
import threading
from types import CodeType
from typing import Optional

DEPTH = 4  # frames kept above the allocator call
# the guard's layers (not its doors: the demo's frames are a caller's) and wrapt
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = (tuple(os.path.join(_PACKAGE, layer) + os.sep for layer in ("model", "report", "probes", "checks", "activate")),
         f"{os.sep}wrapt{os.sep}")

# id(code) -> whether its frames are a caller's (not the guard's own, not wrapt's). The code
# objects are kept alive in _CODES, so an id in these tables is never reused for another one.
_CALLER: dict[int, bool] = {}
_CODES: dict[int, CodeType] = {}
_IDS: dict[tuple, int] = {}  # (owner, method, id(code), offset, ...): the hot path's key -> site
_LINES: dict[tuple, int] = {}  # (label, id(code), line, ...) -> site
_STACKS: list[tuple[str, tuple[tuple[CodeType, int], ...]]] = []  # per site: label, frames innermost first
_lock = threading.Lock()
_getframe = sys._getframe


def here(owner: type, method: str, skip: int = 1) -> int:
    """The site of the call in progress: the allocator method (`owner`'s `method`) and
    the DEPTH frames above the caller `skip` frames up, the guard's and wrapt's own
    frames skipped."""
    frame = _getframe(skip + 1)
    key: list = [owner, method]
    append, caller, left = key.append, _CALLER, DEPTH
    while frame is not None:
        code = frame.f_code
        try:
            if caller[code_id := id(code)]:
                append(code_id)
                append(frame.f_lasti)
                left -= 1
                if not left:
                    break
        except KeyError:  # a code object not met before: classified once, then looked at again
            _classify(code)
            continue
        frame = frame.f_back
    found = _IDS.get(hot := tuple(key))
    return _intern(hot) if found is None else found


def _classify(code: CodeType) -> bool:
    name = code.co_filename
    theirs = not name.startswith(_OURS[0]) and _OURS[1] not in name  # ours: an adapter's, anywhere in the stack
    _CODES[id(code)] = code
    _CALLER[id(code)] = theirs
    return theirs


def _intern(hot: tuple) -> int:
    """The site of a key the hot path has not seen: one per label, code objects and lines."""
    label = f"{hot[0].__name__}.{hot[1]}"
    frames = tuple((_CODES[hot[i]], line_of(_CODES[hot[i]], hot[i + 1])) for i in range(2, len(hot), 2))
    lines = (label, *(part for code, line in frames for part in (id(code), line)))
    with _lock:
        found = _LINES.get(lines)
        if found is None:
            found = _LINES[lines] = len(_STACKS)
            _STACKS.append((label, frames))
        _IDS[hot] = found
    return found


def line_of(code: CodeType, offset: int) -> int:
    """The source line of the instruction at `offset` (what a frame's f_lineno reads);
    the function's first line where the instruction has none."""
    for start, end, line in code.co_lines():
        if start <= offset < end:
            return code.co_firstlineno if line is None else line
    return code.co_firstlineno


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
_SITES = (1 << SITE_BITS) - 1


def pack(step: int, site: int) -> int:
    return (max(step, -1) + 1) << SITE_BITS | (site & _SITES)


NONE = -1  # no event yet


def unpack(value: int) -> tuple[int, int]:
    """(step, site) of a packed event; (-1, -1) for none."""
    if value < 0:
        return -1, -1
    return (value >> SITE_BITS) - 1, value & _SITES
