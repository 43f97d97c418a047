"""Step texts: what a report of the read check and of the position check says, in words.

Kept beside `violation`, which renders every other kind (as `leaktext` the row and leak
kinds'). Standard library only.
"""

from __future__ import annotations

from typing import Any


def position(v: Any) -> str:
    """A token rotated at the wrong position (`value`), or fed the wrong token, and what it should be."""
    more = f" ({v.bad} of {v.numel} tokens)" if v.bad > 1 else ""
    if v.kind == "token":
        return f"input_ids[{v.pos}] = {v.value} is not its request's token at position {v.token} ({v.expected}){more}"
    own = f"in [{v.lowest}, {v.expected}] (its depth in the draft tree)" if v.lowest >= 0 else f"{v.expected}"
    return (f"positions[{v.pos}] = {v.value} is not this token's position {own}"
            f"{'' if v.draft_step is None else f' at draft step {v.draft_step}'}: its K is rotated there{more}")


def read(v: Any) -> str:
    """The read check's finding: `pos` is the position read, `value` its slot."""
    at = f"slot {v.value} at position {v.pos}"
    if v.kind == "read_freed":
        return f"{at} is read by its running request but was given back (freed)"
    if v.kind == "read_reused":
        return (f"{at} is read by its running request but was given back and handed out again "
                f"(generation {v.read_generation} -> {v.generation})")
    return f"{at} was read before as another slot: the running request's entry was repointed"
