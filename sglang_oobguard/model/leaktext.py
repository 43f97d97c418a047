"""Leak texts: what a report of the request-row and leak checks says, in words.

Kept beside `violation`, which renders every other kind: a row report's `value` is a
req_to_token row (`violation.ROW_KINDS`), a leak's the first of its slots.
Standard library only.
"""

from __future__ import annotations

from typing import Any

from .leaktargets import RELEASE_LEAK_LABEL


def _at_step(step: int) -> str:
    return f"at step {step}" if step >= 0 else "before any forward step"


def _who(rid: Any) -> str:
    return f"request {rid}" if rid is not None else "a request not known (none of the callers passes one)"


def what(v: Any) -> str:
    """The text of a `row_double_free`, `row_reused`, `double_release` or `leak` report."""
    if v.kind == "row_double_free":
        if v.owner is not None:
            return (f"req_to_token row {v.value} is freed for {_who(v.request)} while request {v.owner} holds it "
                    "(a row freed twice: once under its running request)")
        return f"req_to_token row {v.value} is freed while not handed out (double free); the free is for {_who(v.request)}"
    if v.kind == "row_reused":
        return (f"req_to_token row {v.value} is handed to {_who(v.request)} while running request {v.owner} still has "
                "it (its row was given back under it): both write and read one row")
    if v.kind == "double_release":
        return (f"request {v.request} is released a second time (row {v.value}): its first release was "
                f"{_at_step(v.freed_step)} by {v.freed_by or 'an unknown call'}")
    whose = f"request {v.request}" if v.request is not None else "one allocation (its request not known)"
    if v.label == RELEASE_LEAK_LABEL:
        return (f"{v.bad} slot{'s' if v.bad > 1 else ''} of {whose}, slot {v.value} first, neither freed "
                f"by its release nor left to the tree: leaked ({v.numel} committed slots in its row)")
    return (f"{v.bad} slot{'s' if v.bad > 1 else ''} of {whose}, slot {v.value} first, held by no running request, "
            f"tree node or KV transfer at idle: leaked ({v.numel} leaked slots in all)")


CONTAINED = {
    "row_double_free": "that row's free dropped (the row stays with its holder)",
    "row_reused": "reported only (the hand-out goes on)",
    "double_release": "the second release dropped",
    "leak": "reported only (the slots stay allocated)",
}
