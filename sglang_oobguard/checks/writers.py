"""Writers: the KV writes that bypass the pool methods, each wrapped where sglang
looks it up (`targets.FUSED_WRITERS`). A fused writer takes its own ids and indexes
the rows of a buffer it is given, so its bound is that buffer's height; it gets the
same probe, memo and containment as a pool method, keyed on a `WriterSite` per
writer and bound. (The step check of out_cache_loc covers these writers too; this
names the writer, and contains what it is handed.) A `WriterSite` and its buffers
are made at the writer's first call outside a graph capture (sglang's eager
warm-up); a first call under capture is left to the step check, never allocated for.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

import torch

from ..model.finite import stored_values
from ..model.targets import Writer
from ..model.violation import site_id
from ..probes import device
from ..probes.pools import NAME_ATTR, SITES_ATTR
from ..report.reporter import KVOutOfBoundsError
from . import values
from .guard import Guard
from .calls import argument, replaced
from .writes import check_write


class WriterSite:
    """What the guard keeps a record and a copy buffer on, for one writer writing into
    buffers of one bound (a pool's layers share it)."""

    page_size = 0

    def __init__(self, writer: Writer, bound: int, site: int) -> None:
        self.size = bound  # the copy buffer's height: one id per slot at most
        self.__dict__[NAME_ATTR] = writer.function
        self.__dict__[SITES_ATTR] = {site: False}


def make_writer_wrapper(writer: Writer, guard: Guard, function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` is the writer being wrapped: its signature gives `per_row`'s default."""
    site = site_id(writer.label)
    guard.name_site(site, writer.bound)
    (ids_at, ids_name), (rows_at, rows_name) = (writer.ids.position, writer.ids.names[0]), writer.rows
    per_row_default = None if writer.per_row is None else \
        inspect.signature(function).parameters[writer.per_row[1]].default
    holders: dict[tuple[torch.device, int], WriterSite] = {}
    stored_at = stored_values(writer.function, list(inspect.signature(function).parameters))  # values it stores

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        pending = None
        try:
            given = len(args) > ids_at
            loc = argument(args, kwargs, ids_at, ids_name)
            buffer = argument(args, kwargs, rows_at, rows_name)
            if isinstance(loc, torch.Tensor) and isinstance(buffer, torch.Tensor):
                bound = int(buffer.shape[0])
                if writer.per_row is not None:
                    bound *= int(argument(args, kwargs, *writer.per_row, per_row_default))
                holder = holders.get((loc.device, bound))
                if holder is None and not (device.is_gpu(loc) and device.capturing()):
                    holder = holders[loc.device, bound] = WriterSite(writer, bound, site)
                checked = loc if holder is None else check_write(guard, holder, site, 0, loc, bound, lambda: -1,
                                                                 slots=False)
                if checked is not loc:
                    args, kwargs = replaced(args, kwargs, ids_at, ids_name, given, checked)
                if holder is not None and guard.config.finite and stored_at:
                    pending = values.check_values(guard, holder, site, loc, bound, lambda: -1,
                                                  values.parts(stored_at, args, kwargs))
                values.before_write(guard, pending)
        except KVOutOfBoundsError:
            raise
        except Exception as exc:  # the guard's own failure: the write goes on unchecked
            guard.internal_error(writer.label, exc)
        result = wrapped(*args, **kwargs)
        if pending:  # raise and warn: the values went in unchanged, now the report
            values.publish(guard, pending)
        return result

    return wrapper
