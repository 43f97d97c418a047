"""Registry: every check the guard can run, one line each, in the order they are listed
(the exit line's, the report's, doctor's and `help`'s).

A new check is one new unit (`checks.unit`) and one line here; its switch is one entry
in `model.switches`. The instrumentor hands these to the guard, which imports none.
"""

from __future__ import annotations

from . import (hicache, history, leaks, liveness, owners, ownids, positions, reads, rows, stepcheck, swa, transfer, values,
               writes)
from .unit import Unit

UNITS: tuple[Unit, ...] = (
    writes.UNIT,  # bounds
    stepcheck.UNIT,  # map
    owners.UNIT,
    liveness.UNIT,
    history.UNIT,
    reads.UNIT,
    ownids.UNIT,
    positions.UNIT,
    values.UNIT,  # finite
    swa.UNIT,
    transfer.UNIT,  # pd
    hicache.UNIT,
    rows.UNIT,
    leaks.UNIT,
)

