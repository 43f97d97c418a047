"""Host scan: the immediate check of ids that live in host memory (CPU tensors).

The same contract as the kernels (`kernels`), folding into the same record
(`record.fold_host`): a write's ids must lie in [0, high) and, with a liveness
shadow, on a live page (page 0, the padding page, passes); a free's ids must be
live, and where each id owns its flag, named once. `cleaned` makes the private copy
a contained write receives; the caller's ids are only read.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np
import torch

from ..model.violation import Kind
from .record import Record
from .shadow import GEN, Live

# Below this many ids a Python list beats a torch reduction.
_HOST_LIST_MAX = 32


class Finding(NamedTuple):
    """What one call's scan found: how many ids were bad, the first one and where."""

    bad: int
    pos: int
    value: int

    def record(self, site: int, layer: int, high: int, numel: int, step: int, free: bool = False) -> Record:
        """This call as a record of its own (what `record.fold_host` folds in)."""
        outside = self.value < 0 or self.value >= high
        kind = Kind.BOUNDS if outside else (Kind.DOUBLE_FREE if free else Kind.FREED)
        return Record.bad_ids(site=site, layer=layer, high=high, numel=numel, bad=self.bad, pos=self.pos,
                              value=self.value, step=step, kind=kind)


class Looked(NamedTuple):
    """What the shadow says of each of some host ids (`look_up`)."""

    inside: np.ndarray  # bool: in the bound looked in
    page: np.ndarray  # int64: its page where inside, else 0 (the padding page, never handed out)
    live: np.ndarray  # bool: inside, on a page handed out
    generation: Optional[np.ndarray]  # int64: its page's generation (0 without history); None unless asked


def look_up(ids: np.ndarray, live: Live, high: Optional[int] = None, low: int = 0,
            generation: bool = False) -> Looked:
    """Per host id: whether it lies in [low, high) (default: the shadow's ids; `low`
    live.page leaves the padding page out), its page, whether that page is handed out,
    and (`generation`) the page's generation. The one host read of a shadow by id, for
    the checks that work in numpy (a CUDA shadow is copied: a report's or a rare call's)."""
    inside = (ids >= low) & (ids < (live.high if high is None else high))
    page = np.where(inside, ids // live.page, 0)
    flags = np.frombuffer(live.host, dtype=np.int32) if live.host is not None else live.flags.cpu().numpy()
    handed = inside & (flags.take(page) != 0)
    gen = None
    if generation:
        gens = live.history[GEN].cpu().numpy() if live.history is not None else np.zeros(flags.size, np.int64)
        gen = gens.take(page)
    return Looked(inside, page, handed, gen)


def _written(loc: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Which ids of a (rows, cols) `loc` are written: the first lens[row] of each row."""
    cols = torch.arange(loc.shape[-1], device=loc.device)
    return (cols[None, :] < lens.to(loc.device, torch.int64)[:, None]).reshape(-1)


def _bad(flat: torch.Tensor, high: int, live: Optional[Live], padding_ok: bool = True) -> torch.Tensor:
    """Per id: outside [0, high), or (with a shadow) inside it and the shadow, on a page
    that is not live. `padding_ok`: page 0 passes (a write may target it; a free may not)."""
    bad = (flat < 0) | (flat >= high)
    if live is not None:
        covered = ~bad & (flat < live.high)
        flags = live.flags.to(flat.device)[flat.clamp(0, max(live.high - 1, 0)) // live.page]
        dead = covered & (flags == 0)
        bad |= dead & (flat >= live.page) if padding_ok else dead
    return bad


def _finding(flat: torch.Tensor, bad: torch.Tensor) -> Optional[Finding]:
    """How many ids are bad, and the first one: what a record keeps of a call."""
    if not bool(bad.any()):
        return None
    pos = int(bad.to(torch.uint8).argmax())
    return Finding(int(bad.sum()), pos, int(flat[pos]))


def _all_live(ids: np.ndarray, live: Live, padding_ok: bool = True) -> bool:
    """Every id (already inside the bound) sits on a live page, on page 0 (`padding_ok`),
    or outside the shadow."""
    assert live.host is not None
    inside = ids[ids < live.high]
    held = np.frombuffer(live.host, dtype=np.int32)[inside if live.page == 1 else inside // live.page] != 0
    return bool(held.all()) or (padding_ok and bool((held | (inside < live.page)).all()))


def _clean(flat: torch.Tensor, high: int, live: Live, padding_ok: bool = True) -> bool:
    """The fast answer for a clean call with a shadow: True when every id is in [0, high)
    and on a live page (page 0 too where `padding_ok`); False means "scan it in full".
    Plain Python for a few ids, numpy over the shadow's memory for many."""
    host = live.host
    if host is None or not flat.is_cpu:
        return False
    if flat.numel() <= _HOST_LIST_MAX:
        few = flat.tolist()
        if few and (min(few) < 0 or max(few) >= high):
            return False
        page, covered = live.page, live.high
        low = page if padding_ok else 0
        return all(i < low or i >= covered or host[i // page] for i in few)
    ids = flat.numpy()
    return bool(ids.min() >= 0 and ids.max() < high) and _all_live(ids, live, padding_ok)


def _write_mask(loc: torch.Tensor, high: int, lens: Optional[torch.Tensor], live: Optional[Live]) -> torch.Tensor:
    """Per id of `loc` (flattened): bad and written."""
    bad = _bad(loc.reshape(-1), high, live)
    return bad & _written(loc, lens) if lens is not None else bad


def scan_host(loc: torch.Tensor, high: int, lens: Optional[torch.Tensor] = None,
              live: Optional[Live] = None) -> Optional[Finding]:
    """None when every written id is in [0, high) (and, with `live`, on a live page).
    With `lens`, only each row's valid prefix is written, and checked."""
    shape = loc.shape
    if lens is None and live is None:  # the common write: its bound alone, in the fewest tensor calls (issue 35)
        if len(shape) == 1 and shape[0] <= _HOST_LIST_MAX:  # a few ids: a Python list
            few = loc.tolist()
            if len(few) == 1:
                if 0 <= few[0] < high:
                    return None
            elif not few or (min(few) >= 0 and max(few) < high):
                return None
        elif 0 in shape:  # no ids (a Size is a tuple: no tensor call)
            return None
        else:  # many: one torch reduction, over any shape
            lo, hi = torch.aminmax(loc)
            if lo.item() >= 0 and hi.item() < high:
                return None
    flat = loc if len(shape) == 1 else loc.reshape(-1)
    if lens is None and live is not None and _clean(flat, high, live):
        return None
    return _finding(flat, _write_mask(loc, high, lens, live))


def cleaned(loc: torch.Tensor, high: int, lens: Optional[torch.Tensor] = None,
            live: Optional[Live] = None) -> torch.Tensor:
    """A private copy of `loc` with its bad (written) ids sent to padding slot 0, as
    the kernel's copy; `loc` itself is left as it was."""
    return loc.masked_fill(_write_mask(loc, high, lens, live).reshape(loc.shape), 0)


def _repeats(flat: torch.Tensor) -> torch.Tensor:
    """Per id: the same id came earlier in this call."""
    ids = flat.numpy()
    seen = np.zeros(ids.shape, dtype=bool)
    seen[np.unique(ids, return_index=True)[1]] = True
    return torch.from_numpy(~seen)


def bad_free(flat: torch.Tensor, high: int, live: Live) -> torch.Tensor:
    """Per freed id: outside [0, high), on a page not live before the call, or, where
    each id owns its flag (page 1: token slots or page ids), named twice in the call.
    Several token ids of one page may share a paged free: it takes the page back once."""
    bad = _bad(flat, high, live, padding_ok=False)
    return bad | _repeats(flat) if live.page == 1 else bad


def scan_free(ids: torch.Tensor, high: int, live: Live) -> Optional[Finding]:
    """The check of a free: None when every id is in [0, high) on a live page."""
    flat = ids.reshape(-1)
    if _clean_free(flat, high, live):
        return None
    return _finding(flat, bad_free(flat, high, live))


def _clean_free(flat: torch.Tensor, high: int, live: Live) -> bool:
    """`_clean` for a free (page 0 is no page to give back) and, where each id owns its
    flag (page 1), no id twice: True when `bad_free` would find nothing."""
    if not _clean(flat, high, live, padding_ok=False):
        return False
    if live.page > 1:
        return True
    if flat.numel() <= _HOST_LIST_MAX:
        return len(set(flat.tolist())) == flat.numel()
    return np.unique(flat.numpy()).size == flat.numel()


def live_only(ids: torch.Tensor, high: int, live: Live) -> torch.Tensor:
    """A free's containment (warn mode): only the ids in [0, high) on a live page,
    each once, so the allocator's free list never takes a slot twice."""
    flat = ids.reshape(-1)
    return flat[~bad_free(flat, high, live)]


def scan_handed_out(ids: torch.Tensor, live: Live) -> Optional[Finding]:
    """The check of a hand-out, before its pages are marked: an id that opens a page
    (offset 0: a page the allocator just took off its free list; the other ids may
    continue a request's last page) must find that page not live. None when so."""
    if live.host is not None and ids.is_cpu:  # the fast answer for a clean hand-out
        if ids.numel() <= _HOST_LIST_MAX:
            page, high, flags = live.page, live.high, live.host
            if not any(flags[i // page] for i in ids.reshape(-1).tolist() if page <= i < high and not i % page):
                return None
        host = ids.reshape(-1).numpy()
        opens = host[(host >= live.page) & (host < live.high) & (host % live.page == 0)]
        if not np.frombuffer(live.host, dtype=np.int32)[opens // live.page].any():
            return None
    flat = ids.reshape(-1).to(torch.int64)
    inside = (flat >= live.page) & (flat < live.high)
    opens = inside & (flat % live.page == 0)
    flags = live.flags[flat.clamp(0, max(live.high - 1, 0)) // live.page]
    return _finding(flat, opens & (flags != 0))
