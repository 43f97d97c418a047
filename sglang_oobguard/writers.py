"""Writers: the KV writes that bypass the pool methods, each wrapped where sglang
looks it up (`targets.FUSED_WRITERS`). A fused writer takes its own ids and indexes
the rows of a buffer it is given, so its bound is that buffer's height; it gets the
same probe, memo and containment as a pool method, keyed on a `WriterSite` per
writer and buffer height. (The step check of out_cache_loc covers these writers
too; this names the writer, and contains what it is handed.)
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from .guard import NAME_ATTR, SITES_ATTR, Guard, replaced
from .report import KVOutOfBoundsError, site_id
from .targets import Writer


class WriterSite:
    """What the guard keeps a record and a copy buffer on, for one writer writing into
    buffers of one height (a pool's layers share it)."""

    page_size = 0

    def __init__(self, writer: Writer, rows: int, site: int) -> None:
        self.size = rows  # the copy buffer's height: one id per row at most
        self.__dict__[NAME_ATTR] = writer.function
        self.__dict__[SITES_ATTR] = {site: False}


def make_writer_wrapper(writer: Writer, guard: Guard) -> Callable[..., Any]:
    site = site_id(writer.label)
    guard.bounds[site] = f"{writer.rows[1]}.shape[0]"
    (ids_at, ids_name), (rows_at, rows_name) = (writer.ids.position, writer.ids.names[0]), writer.rows
    holders: dict[tuple[torch.device, int], WriterSite] = {}

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        try:
            given = len(args) > ids_at
            loc = args[ids_at] if given else kwargs.get(ids_name)
            buffer = args[rows_at] if len(args) > rows_at else kwargs.get(rows_name)
            if isinstance(loc, torch.Tensor) and isinstance(buffer, torch.Tensor):
                rows = int(buffer.shape[0])
                holder = holders.get((loc.device, rows))
                if holder is None:
                    holder = holders[loc.device, rows] = WriterSite(writer, rows, site)
                checked = guard.check_write(holder, site, 0, loc, rows, lambda: -1)
                if checked is not loc:
                    args, kwargs = replaced(args, kwargs, ids_at, ids_name, given, checked)
        except KVOutOfBoundsError:
            raise
        except Exception as exc:  # the guard's own failure: the write goes on unchecked
            guard.internal_error(writer.label, exc)
        return wrapped(*args, **kwargs)

    return wrapper
