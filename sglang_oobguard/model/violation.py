"""Violation: the one schema of a report, and every text rendered from it.

The log line, the report file's JSON, `KVOutOfBoundsError`, `doctor` and `summary`
all render this frozen dataclass; nothing keeps a second copy of its fields. Site
ids (what a device record stores) are numbered here too, since a record names its
site by number and the report by label.

Standard library only: `summary` reads report files without torch.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass
from typing import Any, Optional

from . import leaktext, steptext


class Kind(enum.IntEnum):
    """What was wrong with the first bad id of a record (its `kind` field)."""

    BOUNDS = 0  # outside [0, high)
    FREED = 1  # inside, on a slot the allocator does not hold as handed out (liveness)
    DOUBLE_FREE = 2  # a free of a slot that is not handed out (liveness)
    OTHER_REQUEST = 3  # out_cache_loc differs from the token's own slot in req_to_token (write map)
    DUPLICATE = 4  # the same slot written by two tokens of one forward step
    SHARED_ROW = 5  # two requests of one forward step share a req_to_token row
    OWNED = 6  # written by one request while another running request owns the slot (liveness)
    HANDED_OUT = 7  # handed out by the allocator while still handed out (a live slot back on a free list)
    UNMAPPED = 8  # SWA: a full id freed with its SWA peer whose peer is not mapped (freed already: SWA double free)
    PEER_MAPPED = 9  # SWA: a full id freed alone while its SWA peer is still mapped (the peer would leak)
    SWA_OTHER = 10  # SWA: a token's SWA id is not the translation of its own full slot (full_to_swa_index_mapping)
    IN_FLIGHT = 11  # a page freed while a KV transfer into it is in flight (PD decode side, `transfer`)
    READ_FREED = 12  # a running request reads a slot that was given back under it (read check)
    READ_REUSED = 13  # ... a slot given back and handed out again under it (read check)
    REPOINTED = 14  # a running request's req_to_token entry, already read, now names another slot (read check)
    NOT_STEP = 15  # a write with ids of its own (not the step's out_cache_loc) into a slot no token of the step writes
    NONFINITE = 16  # a value written is NaN or +-Inf (SGLANG_OOBGUARD_FINITE)
    HELD = 17  # a HiCache host -> device load into a slot another running request holds (`hiloads`)
    POSITION = 18  # a token's positions[i] is not its position in its request (its K rotated there: `positions`)
    TOKEN = 19  # a token's input_ids[i] is not its request's token at its position (`positions`)
    ROW_DOUBLE_FREE = 20  # a req_to_token row freed while not handed out, or by a request that does not hold it (`rows`)
    ROW_REUSED = 21  # a row handed to a request while a running request still has it (`rows`)
    DOUBLE_RELEASE = 22  # a request's KV released a second time (`leaks`)
    LEAK = 23  # at idle: slots handed out that no request, tree node or transfer holds (`leaks`)


READ_KINDS = ("read_freed", "read_reused", "repointed")  # the read check's kinds, by name
# the check (`model.switches.NAMES`) that makes each kind of report, by the kind's name (`Violation.kind`)
CHECK_OF = {"bounds": "bounds", "freed": "liveness", "double_free": "liveness", "other_request": "map",
            "duplicate": "map", "shared_row": "map", "owned": "owners", "handed_out": "liveness", "unmapped": "swa",
            "peer_mapped": "swa", "swa_other": "swa", "in_flight": "pd", "read_freed": "reads", "read_reused": "reads",
            "repointed": "reads", "not_step": "ownids", "nonfinite": "finite", "held": "hicache",
            "position": "positions", "token": "positions", "row_double_free": "rows", "row_reused": "rows",
            "double_release": "leaks", "leak": "leaks"}
ROW_KINDS = ("row_double_free", "row_reused", "double_release")  # their `value` is a req_to_token row
ELEMENTS = ("nan", "+inf", "-inf")  # a non-finite value, as a record numbers it
SAID = {"handed_out": "reported only (the allocator's hand-out goes on)",  # what warn did about a kind, in words
        "nonfinite": "non-finite KV values, written unchanged (the guard reports, it does not repair data)",
        **{kind: f"reported only (the slot is right, the {kind} is not: the step runs on uncontained)"
           for kind in ("position", "token")}, **leaktext.CONTAINED}


# Site ids: a probe record stores an int, the report shows the label it stands for.
_SITE_LABELS: list[str] = []
_SITE_IDS: dict[str, int] = {}
_FREE_PARAMS: dict[int, str] = {}  # free sites (allocator methods): site id -> the freed ids' name


def site_id(label: str) -> int:
    """The id of a label, the same for every method that shares it."""
    site = _SITE_IDS.get(label)
    if site is None:
        site = _SITE_IDS[label] = len(_SITE_LABELS)
        _SITE_LABELS.append(label)
    return site


def free_site_id(label: str, param: str) -> int:
    """The id of an allocator free site, e.g. "free (TokenToKVPoolAllocator)"."""
    site = site_id(label)
    _FREE_PARAMS[site] = param
    return site


_PART_NAMES: list[str] = []  # value parts (cache_k, cache_v, cache_k_rope, k_scale, ...), numbered like sites


def part_id(name: str) -> int:
    """The number a record stores for the argument that held a non-finite value."""
    if name not in _PART_NAMES:
        _PART_NAMES.append(name)
    return _PART_NAMES.index(name)


def part_name(part: int) -> str:
    return _PART_NAMES[part] if 0 <= part < len(_PART_NAMES) else f"part {part}"


def free_param(site: int) -> Optional[str]:
    """The freed ids' parameter name when `site` is a free site, else None."""
    return _FREE_PARAMS.get(site)


def is_site_label(label: object) -> bool:
    return label in _SITE_IDS


def site_label(site: int) -> str:
    return _SITE_LABELS[site] if 0 <= site < len(_SITE_LABELS) else f"site {site}"


@dataclass(frozen=True)
class Violation:
    """One pool's bad write (or, with liveness, bad free): the first bad call in
    detail, plus running totals."""

    label: str
    pool: str
    layer: int  # -1: the caller passed no layer
    high: int  # ids must lie in [0, high)
    bad: int
    numel: int
    pos: int
    value: int
    total_bad: int
    calls: int
    freed: Optional[str] = None  # a free site: the name of the freed ids' parameter
    kind: str = "bounds"  # Kind's name, lower case
    # Where in serving (a write inside a forward step; see `steps`): -1 / None when unknown.
    step: int = -1  # the process's forward step number
    mode: Optional[str] = None  # sglang's forward mode: extend, decode, target_verify, draft_extend, idle, ...
    batch_size: Optional[int] = None
    request: Optional[str] = None  # the writing request's rid (before rids: its req_pool_indices entry)
    token: Optional[int] = None  # the position of the token within its request
    ranks: Optional[str] = None  # "tp 1, pp 0, dp 0"
    # The other side of an ownership violation (write map, duplicate, owner check).
    expected: int = -1  # the token's own slot per req_to_token (-1: not checked)
    owner: Optional[str] = None  # the request that holds the slot: its rid, or "req_to_token row R"
    owner_token: Optional[int] = None  # the position at which the owner holds the slot
    # A bad free or hand-out (`claims`): both requests were looked up, `owner` the one that holds the
    # slot, `request` the one the free or hand-out is for; either may stay unknown, the text says so.
    claimed: bool = False
    # A KV transfer into the pages (PD disaggregation): its bootstrap room and the step it was sent at.
    room: Optional[int] = None
    sent_step: int = -1
    no_drain: bool = False  # it failed on a backend with no drain signal: its writes may still be on their way
    node: Optional[int] = None  # a HiCache load-back: the radix tree node it loads for
    # The slot's history (liveness on): its generation and its last allocation and free.
    generation: int = -1  # the serial of the allocator call that last handed it out (-1: not tracked)
    allocated_step: int = -1
    allocated_by: Optional[str] = None  # the call site: "caller (file:line) > ... > Allocator.method"
    freed_step: int = -1
    freed_by: Optional[str] = None
    read_generation: int = -1  # read check: the generation the reader first saw at that position
    part: Optional[str] = None  # kind "nonfinite": the argument that held it (cache_k, cache_v, k_scale, ...),
    head: Optional[int] = None  # its head,
    element: Optional[str] = None  # "nan", "+inf" or "-inf",
    padding: Optional[bool] = None  # and whether its slot is padding slot 0 (how sglang #36207 starts)
    draft_step: Optional[int] = None  # kind "position": the EAGLE draft step of the forward (None: not a draft step)
    lowest: int = -1  # kind "position", a tree verify: the lowest position allowed (`expected`: the highest)

    @classmethod
    def of(cls, record: Any, pool: str, **where: Any) -> "Violation":
        """A pool's record (record.Record), as the report names it; `where`: the step
        and request fields."""
        kind = Kind(record.kind).name.lower()
        # the read check's record keeps the generation its reader first saw in `expected`
        seen = {"read_generation": record.expected, "expected": -1} if kind in READ_KINDS else \
            {"expected": record.expected}
        return cls(site_label(record.site), pool, record.layer, record.high, record.bad, record.numel,
                   record.pos, record.value, record.total_bad, record.calls, free_param(record.site),
                   kind, **{**seen, **_value_fields(record), **where})

    def as_dict(self) -> dict[str, Any]:
        """The report file's JSON object."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, fields: dict[str, Any]) -> "Violation":
        """Read back from a report file (fields this release does not know are dropped)."""
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in fields.items() if k in known})

    def what(self) -> str:
        """What was wrong, for the first bad id."""
        return _what(self)

    def history(self) -> str:
        """The slot's last free and allocation, when liveness tracked them."""
        parts = []
        unit, given = ("row", "handed out") if self.kind in ROW_KINDS else ("slot", "allocated")
        if self.freed_step >= 0 or self.freed_by:
            parts.append(f"freed {_at_step(self.freed_step)} by {self.freed_by or 'an unknown call'}")
        if self.allocated_step >= 0 or self.allocated_by:
            parts.append(f"{given} {_at_step(self.allocated_step)} by {self.allocated_by or 'an unknown call'}")
        if not parts or self.kind == "double_release":  # its first release is in its text
            return ""
        return f"{unit} {self.value} last " + ", last ".join(parts) + (
            f" (generation {self.generation})" if self.generation >= 0 else "")

    def context(self) -> str:
        """Where in serving it happened, when known: step, mode, batch, the writing request, ranks."""
        parts = []
        if self.step >= 0:
            parts.append(f"step {self.step}" + (f" ({self.mode}, batch {self.batch_size})" if self.mode else ""))
        if self.request is not None and not self.claimed:  # a claim's request is in its text
            parts.append(f"request {self.request}" + (f" token {self.token}" if self.token is not None else ""))
        if self.ranks:
            parts.append(self.ranks)
        return "; ".join(parts)

    def __str__(self) -> str:
        head = f"{self.label}: " if self.freed or self.layer < 0 else f"{self.label} layer {self.layer}: "
        return head + self.what()

    def described(self) -> str:
        """The one-line report: the violation, its pool, and where in serving."""
        context, history = self.context(), self.history()
        return f"{self} (pool {self.pool})" + (f"; {context}" if context else "") + (f"; {history}" if history else "")

    def contained(self) -> str:
        """What warn mode did about it, in words."""
        if self.kind == "in_flight" and self.no_drain:
            return ("free of pages a failed KV transfer may still write (held back from the free list for sglang's "
                    "deferred-release timeout: the backend cannot say when its writes end)")
        if self.kind == "in_flight":
            return "free of pages a KV transfer still writes (held back from the free list until it ends)"
        if self.kind in SAID:
            return SAID[self.kind]
        if self.freed:
            return "bad free (a CPU free passes only the live ids on; a GPU free goes on as asked)"
        return "bad KV slot ids, write contained (the write got a copy with those ids sent to padding slot 0)"


# The device-side assert text of the value check (strict mode on a GPU): one for every site,
# so a pool's warm-up compiles one variant per value dtype, not per site.
FINITE_ASSERT = ("sglang_oobguard: a KV write stores NaN or Inf (SGLANG_OOBGUARD_FINITE); "
                 "rerun with SGLANG_OOBGUARD_MODE=raise for the site, layer, slot and request")


def _value_fields(record: Any) -> dict[str, Any]:
    """A non-finite value's fields, from its record (none for another kind)."""
    if record.kind != Kind.NONFINITE:
        return {}
    return {"part": part_name(record.part), "head": None if record.head < 0 else record.head,
            "element": ELEMENTS[record.elem], "padding": None if record.value < 0 else record.value == 0}


def _nonfinite(v: Violation) -> str:
    """A non-finite value, in words: the argument, the token and its slot, the head."""
    where = f"{v.part}"
    if v.pos >= 0:
        where += f" of loc[{v.pos}] ({'padding slot 0' if v.padding else f'slot {v.value}'})"
    if v.head is not None:
        where += f" head {v.head}"
    return f"{where} is {v.element}, not finite ({v.bad} non-finite values written)"


def _claims(v: Violation) -> str:
    """Both requests of a bad free or hand-out (`claimed`), or what is not known of them."""
    if not v.claimed:
        return ""
    call = "hand-out" if v.kind == "handed_out" else "free"
    unit = "page" if v.freed == "page_ids" else "slot"  # a page-id free's value is a page
    held = (f"; {unit} {v.value} is held by request {v.owner}" + (f" token {v.owner_token}" if v.owner_token is not None
                                                                 else "")) if v.owner is not None else \
        f"; the request holding {unit} {v.value} is not known (no forward step's req_to_token names it)"
    wants = f"; the {call} is for request {v.request}" if v.request is not None else \
        f"; the request the {call} is for is not known (none of its callers passes one)"
    return held + wants


def _what(v: Violation) -> str:
    """What was wrong, for the first bad id (the text of each kind)."""
    if v.kind == "in_flight":
        state = "may still be in flight (no drain signal)" if v.no_drain else "is in flight"
        return (f"page {v.value} freed while a KV transfer into it {state} (request {v.request}, "
                f"bootstrap room {v.room}, sent "
                f"{_at_step(v.sent_step)})"
                + (f" ({v.bad} of {v.numel} freed pages in flight)" if v.bad > 1 else ""))
    if v.kind in ("nonfinite", "position", "token"):  # no slot id: a value, a position, a token
        return (_nonfinite if v.kind == "nonfinite" else steptext.position)(v)
    if v.kind in leaktext.CONTAINED:
        return leaktext.what(v)
    name = v.freed or "loc"
    at = f"{name}[{v.pos}] = {v.value}"
    more = f" ({v.bad} of {v.numel} ids bad)" if v.bad > 1 else ""
    if v.kind == "bounds" or not 0 <= v.value < v.high:
        return f"{v.bad} of {v.numel} slot ids outside [0, {v.high}): {at}"
    if v.kind in ("freed", "double_free"):
        return f"{at} is not allocated ({'double free' if v.freed else 'freed'}){more}{_claims(v)}"
    if v.kind == "handed_out":
        return (f"{at} is handed out again while still allocated (a live slot went back on the free list)"
                f"{more}{_claims(v)}")
    if v.kind == "unmapped":
        return (f"{at} has no SWA slot mapped: its SWA peer was freed already (SWA double free; the free would "
                f"put padding slot 0 on the SWA free list){more}{_claims(v)}")
    if v.kind == "peer_mapped":
        return (f"{at} is freed while its SWA slot {v.expected} is still mapped (that SWA slot would leak)"
                f"{more}{_claims(v)}")
    held = "" if v.owner is None else f"; slot {v.value} is held by request {v.owner}" + (
        f" token {v.owner_token}" if v.owner_token is not None else "")
    if v.kind == "other_request":
        return f"{at} is not this token's slot (req_to_token holds {v.expected}){held}{more}"
    if v.kind == "swa_other":
        own = f"maps to {v.expected}" if v.expected > 0 else "has none: it left the window or was freed"
        return f"{at} is not this token's SWA slot (its full slot {own}){held}{more}"
    if v.kind == "duplicate":
        return f"{at} is written by two tokens of this forward step{held}{more}"
    if v.kind == "shared_row":
        return f"{at}: its request shares its req_to_token row with another of this forward step{held}{more}"
    if v.kind in READ_KINDS:
        return steptext.read(v) + held + more
    if v.kind == "held":
        what = f"tree node {v.node}" + (f" (request {v.request})" if v.request else "") if v.node is not None \
            else f"request {v.request}"
        return f"{at}: a HiCache load for {what} into a slot another running request holds{held}{more}"
    if v.kind == "not_step":
        return f"{at} is not a slot this forward step's tokens write (ids of the writer's own){held}{more}"
    return f"{at} is owned by another running request{held}{more}"


def assert_text(site: int, bound: str, liveness: bool) -> str:
    """The device-side assert text of a site (strict mode on a GPU): a compile-time
    constant, under CUDA's 256 bytes."""
    what = f"KV slot id outside [0, {bound})"
    if free_param(site):
        what = "freed id outside the pool, or not allocated (double free)"
    elif liveness:
        what += ", or not allocated"
    return (f"sglang_oobguard: {site_label(site)}: {what}; "
            "rerun with SGLANG_OOBGUARD_MODE=raise for the report")[:255]


def _at_step(step: int) -> str:
    """When a history event happened: after step N began (the last one begun), or in words."""
    return f"at step {step}" if step >= 0 else "before any forward step"
