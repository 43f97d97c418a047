"""Patches: what the instrumentor replaced on sglang's classes and modules, in order, and
the one place that puts it back (uninstall), newest first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Union

import wrapt

from ..model.discover import AllocatorMethod, Found
from ..report.owntime import OwnTime

MISSING = object()


@dataclass(frozen=True)
class Patch:
    """One attribute we replaced: where, what was there (its own, or MISSING), and
    what it stands for in the report (a Found or AllocatorMethod, else None)."""

    owner: Any
    name: str
    before: Any
    entry: Optional[Union[Found, AllocatorMethod]] = None

    def undo(self) -> None:
        if self.before is MISSING:
            delattr(self.owner, self.name)
        else:
            setattr(self.owner, self.name, self.before)


class Patches:
    """What the instrumentor replaced, in order, and the one place that puts it back."""

    def __init__(self, own_time: Optional[OwnTime]) -> None:
        self.made: list[Patch] = []
        self.own_time = own_time  # set: every wrapper is timed (a benchmark's own-time file)

    @property
    def entries(self) -> tuple[Union[Found, AllocatorMethod], ...]:
        return tuple(p.entry for p in self.made if p.entry is not None)

    def wrap(self, owner: Any, name: str, wrapper: Callable[..., Any], kind: str,
             entry: Optional[Union[Found, AllocatorMethod]] = None) -> None:
        """Wrap `owner.name` once (a second wrap of the same attribute is a no-op);
        `kind`: the entry point's kind in the own time (`owntime.KINDS`)."""
        if any(p.owner is owner and p.name == name for p in self.made):
            return
        if self.own_time is not None:
            wrapper = self.own_time.timed(kind, wrapper)
        before = owner.__dict__.get(name, MISSING)
        wrapt.wrap_function_wrapper(owner, name, wrapper)
        self.made.append(Patch(owner, name, before, entry))

    def of_kind(self, kind: str) -> Callable[[Any, str, Callable[..., Any]], None]:
        """`wrap` with its kind given: what the hooks of one family are handed."""
        return lambda owner, name, wrapper: self.wrap(owner, name, wrapper, kind)

    def undo(self, which: Callable[[Patch], bool] = lambda patch: True) -> None:
        """Put back, newest first, what each chosen patch replaced."""
        for patch in reversed([p for p in self.made if which(p)]):
            patch.undo()
        self.made = [p for p in self.made if not which(p)]
