"""Reads: the read check of each forward step (on with liveness).

Every request of a step reads its whole `req_to_token[row, 0:seq_len]`: a slot that
was freed, or freed and handed to another request, while its request still reads it
is read silently (a radix prefix evicted under a running request, a transfer over a
live slot). At each step boundary, after the step check (whose owner claims it
reads), `readmap.check_reads` checks every slot read against the liveness shadow and
its history, and the report names the reader, the position, the new holder and the
slot's history.

The host path serves CPU tensors, counted (`readcount`: only the positions new to a
request, the entries that changed and the pages that changed hands while read; the full
scan, counted as `scans`, only where that cannot tell), one launch of `readkernel` the
others (after the step kernel, on the same stream: no host sync; O(context)). The draft model runner of speculative decoding
shares the target's req_to_token and is not checked twice; a forward with
out_cache_loc_virtual (req_to_token in another id space), a batch without request
ids (a row's new holder cannot be told apart) and a graph capture are skipped, each
said once in the log.

Its memory (`readmap.Seen`, 8 bytes per req_to_token entry: 2-4 GB for 2-4k rows at
128k context) is made with sglang's ReqToTokenPool (`make_table_hook`), as sglang
sizes its pools, so serving and graph capture never allocate it; its size is said in
the log then (and by `doctor`). A table built before the guard (or before liveness was
turned on) gets it at its first step, with a WARNING.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import numpy as np
import torch

from ..model.log import logger
from ..model.targets import write_map_off, write_map_unmeasured
from ..model.violation import site_id
from ..probes import device, readcount, readkernel, readmap
from ..probes.record import Record
from .guard import Guard
from .unit import Found, Unit

READ_LABEL = "req_to_token (read check)"
SEEN_ATTR = "_oobguard_reads"  # on sglang's ReqToTokenPool: its readmap.Seen
EXTENDS = ("extend", "mixed")  # forwards that map a request's prefix anew
MEMORY = "8 B per req_to_token entry, made with sglang's ReqToTokenPool"  # the activation line and doctor say it


def check_reads(guard: Guard, runner: Any, batch: Any, pool: Any, high: int) -> None:
    """The read check of one step: reports (and raises, unless warn) the first slot
    read that its reader no longer holds."""
    if getattr(runner, "is_draft_worker", False):
        return
    table = getattr(getattr(runner, "req_to_token_pool", None), "req_to_token", None)
    rows, lens = getattr(batch, "req_pool_indices", None), getattr(batch, "seq_lens_cpu", None)
    if lens is None:
        lens = getattr(batch, "seq_lens", None)
    size = int(getattr(batch, "batch_size", 0) or 0)
    if not size or not all(isinstance(t, torch.Tensor) for t in (table, rows, lens)):
        return
    state = guard.state(pool, table.device)
    if state.live is None:
        return
    why = _skipped(guard, table, batch)
    if why:
        if guard.first_time(f"read check skipped: {why}"):
            logger.warning("sglang_oobguard: read check skipped for %s", why)
        return
    host = guard.on_host(table)
    seen = _seen(guard, runner.req_to_token_pool, table)
    if not host and not seen.warm:  # compiled at the first step (sglang's warm-up forward), never while serving
        readkernel.warm_up(seen, table, rows, batch.seq_lens, state.live, state.record.tensor,
                           guard.steps.counter(state.device), site_id(READ_LABEL), high)
        seen.warm = True
    guard.counts.add("reads", "steps")
    rids = list(batch.rids)[:size]
    mode = getattr(getattr(batch, "forward_mode", None), "name", "").lower()
    extend = mode in EXTENDS
    if not host:
        readmap.forget_changed_holders(seen, _host_rows(batch, size), rids)
        _launch(guard, state, seen, table, batch, size, mode, high)
        return
    lens_l = lens[:size].tolist()
    finding, full = readcount.check(seen, state.live, table.numpy(), rows[:size].tolist(), lens_l, rids, extend,
                                    high, lambda: _written(batch, mode, np.array(lens_l, dtype=np.int64)))
    if full:
        guard.counts.add("reads", "scans")
    if finding is not None:
        _report(guard, state, finding, high)


def make_table_hook(guard: Guard) -> Callable[..., Any]:
    """Wrapper for ReqToTokenPool.__init__: with liveness on, the read check's memory is
    made with the table, when sglang sizes its pools (never at a step)."""

    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
        result = wrapped(*args, **kwargs)
        table = getattr(instance, "req_to_token", None)
        if "reads" in guard.config.checks and isinstance(table, torch.Tensor) and table.dim() == 2:
            try:
                _make(guard, instance, table)
            except Exception as exc:  # no memory for it: the first step tries again, or the check is skipped
                guard.internal_error(f"{type(instance).__name__}.__init__ (read check memory)", exc)
        return result

    return wrapper


def _seen(guard: Guard, owner: Any, table: torch.Tensor) -> readmap.Seen:
    """The table's Seen: made with its pool, else now (a table built before the guard)."""
    seen = owner.__dict__.get(SEEN_ATTR)
    if seen is not None and seen.fits(table):
        return seen
    if device.is_gpu(table) and guard.first_time("read check memory late"):
        logger.warning("sglang_oobguard: the read check's memory (%s) is allocated at the first step, after sglang "
                       "sized its pools (the table was built before the guard or with liveness off)",
                       _size(table))
    if seen is not None:
        device.retain(seen)
    return _make(guard, owner, table)


def _make(guard: Guard, owner: Any, table: torch.Tensor) -> readmap.Seen:
    seen = readmap.Seen(*table.shape, table.device)
    guard.mark(owner, SEEN_ATTR, seen)
    logger.info("sglang_oobguard: read check memory: %s on %s (req_to_token %d x %d: two int32 per entry), made with "
                "sglang's %s", _size(table), table.device, *table.shape, type(owner).__name__)
    return seen


def _size(table: torch.Tensor) -> str:
    return f"{readmap.Seen.bytes_for(*table.shape) / 2**20:.1f} MiB"


def _written(batch: Any, mode: str, lens: np.ndarray) -> Optional[np.ndarray]:
    """The first position each request writes in this step (host values): decode its
    last, an extend its prefix length; other forwards write none they read. None: unknown."""
    if mode == "decode":
        return lens - 1
    if mode in EXTENDS:
        prefix = getattr(batch, "extend_prefix_lens_cpu", None)
        return None if prefix is None or len(prefix) < lens.size else np.asarray(prefix[:lens.size], dtype=np.int64)
    return lens


def _launch(guard: Guard, state: Any, seen: readmap.Seen, table: torch.Tensor, batch: Any, size: int, mode: str,
            high: int) -> None:
    """The device path: one launch on the current stream, after the step kernel (no host sync)."""
    prefix = getattr(batch, "extend_prefix_lens", None) if mode in EXTENDS else None
    written = readkernel.WRITTEN_DECODE if mode == "decode" else readkernel.WRITTEN_NONE if mode not in EXTENDS \
        else readkernel.WRITTEN_PREFIX if isinstance(prefix, torch.Tensor) else readkernel.WRITTEN_ANY
    readkernel.launch(seen, table, batch.req_pool_indices, batch.seq_lens, size, mode in EXTENDS, state.live,
                      state.record.tensor, guard.steps.counter(state.device), site_id(READ_LABEL), high, written,
                      prefix if written == readkernel.WRITTEN_PREFIX else None)
    if device.is_gpu(table):
        state.order.probed(table.device)
    guard.launched(state)  # its record is read at step boundaries


def _host_rows(batch: Any, size: int) -> list:
    """The batch's req_pool_indices as host ints: sglang's host copy, or a CPU tensor
    (never a device read)."""
    rows = getattr(batch, "req_pool_indices_cpu", None)
    rows = batch.req_pool_indices if rows is None else rows
    return rows[:size].tolist()


def _skipped(guard: Guard, table: torch.Tensor, batch: Any) -> str:
    """Why this step's reads are not checked, or ""."""
    if getattr(batch, "out_cache_loc_virtual", None) is not None:
        return "forwards with out_cache_loc_virtual (req_to_token holds virtual ids)"
    if getattr(batch, "rids", None) is None:
        return "batches without request ids (ForwardBatch.rids: set from sglang 0.5.10 on, not in 0.5.9)"
    if table.device.type != "cpu" and not isinstance(getattr(batch, "req_pool_indices_cpu", None), torch.Tensor):
        return "GPU batches without req_pool_indices_cpu (a row's new holder is told on the host)"
    return ""


def _report(guard: Guard, state: Any, finding: readmap.ReadFinding, high: int) -> None:
    """The record of a host finding; `steps.where` names the reader, the position and the holder."""
    record = Record.read(site=site_id(READ_LABEL), high=high, numel=finding.numel, bad=finding.bad, kind=finding.kind,
                         reader=finding.row, position=finding.position, slot=finding.slot, generation=finding.seen,
                         owner=finding.owner, step=guard.steps.number)
    guard.report_now(state, record)


def doctor(found: Found) -> list[str]:
    gib = {rows: f"{readmap.Seen.bytes_for(rows, 131072) / 2**30:.1f} GiB" for rows in (4096, 2048)}
    return ["the read check, with liveness: every slot each request reads (req_to_token[row, 0:seq_len]) live and of "
            "the generation it first read (host path on CPU tensors, counted; one launch on a GPU); where the write map runs ("
            + (write_map_off() or "on here") + ")" + "".join(f"; not for {name} ({why}: skipped with the write map)"
                                                             for name, why in write_map_unmeasured()),
            f"the read check's memory, with liveness: {MEMORY} as sglang sizes its pools (sglang's budget does not "
            f"count it), before serving and capture: {gib[4096]} for 4096 rows x 131072 context, {gib[2048]} for 2048"]


UNIT = Unit("reads", "a running request reads a slot given back or handed to another",
            "per step on the host: O(positions new or changed, pages that changed hands), a full scan only "
            "where that cannot tell; on a GPU: O(context of the batch)", ("steps", "scans"),
            "the forward step's end; sglang's ReqToTokenPool (its memory)",
            where=write_map_off, doctor=doctor, memory=lambda pages, rows, context: readmap.Seen.bytes_for(rows, context)
            if rows else 0)
