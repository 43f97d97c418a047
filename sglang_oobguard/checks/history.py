"""History: each slot's last allocation and free, named in every report (a unit).

ASan's report gives the bad access first, then where the memory was allocated and
freed. Liveness keeps, per page of the shadow, its generation and the call sites that
last handed it out and gave it back (`probes.shadow`, captured by `checks.liveness` at
each allocator call when this check is on); a report reads them when it is made.
"""

from __future__ import annotations

from typing import Any

from ..model import callsite
from ..model.violation import Kind, free_param
from ..probes import shadow
from ..probes.pools import PoolState
from ..probes.record import Record
from .unit import Unit


def fields(state: PoolState, record: Record) -> dict[str, Any]:
    """The Violation fields of the reported slot's history (its last allocation and
    free, its generation), read when the report is made; {} when liveness does not
    track the pool or the id is outside it."""
    live = state.live
    if live is None or record.kind == Kind.BOUNDS or not 0 <= record.value < record.high:
        return {}
    page = record.value if free_param(record.site) == "page_ids" else record.value // live.page
    told = shadow.story(live, page)
    if told is None:
        return {}
    generation, allocated, freed, _ = told
    (allocated_step, allocated_by), (freed_step, freed_by) = callsite.unpack(allocated), callsite.unpack(freed)
    return {"generation": generation, "allocated_step": allocated_step, "allocated_by": callsite.text(allocated_by),
            "freed_step": freed_step, "freed_by": callsite.text(freed_by)}


UNIT = Unit("history", "each slot's last allocation and free, named in every report",
            "per allocator call: one call site captured", ("events",),
            "the tracked allocators' methods (with liveness); read when a report is made",
            fields=fields, memory=lambda pages, rows, context: shadow.PAGE_BYTES["story"] * (pages + 1),
            doctor=lambda found: [
                "slot history, with liveness: each report names the slot's last free and allocation (step, call site) "
                "and generation"])
