"""The guard's own time per decode step without an engine, beside its floor (issue 35).

sglang's ModelRunner.forward under the guard's real step hook, with the model replaced
by 8 layers that each run about a tiny Llama layer's small torch ops (so the guard's
code runs as cold as in the engine) and write their KV through the real MHA pool from a
copy of out_cache_loc (sglang 0.5.23's layers write from one). Each step follows a
scheduler's worth of Python. Per configuration, interleaved round by round, the own
time read from the own-time file (as `bench/engine.py` does):

- guarded: the guard (strict), its own time per step by entry point;
- floor: the guard off, the same entry points wrapped by empty wrappers timed the same
  way: what any timed wrapt guard costs here, and what the guard's figure includes of it.

    .venv/bin/python bench/step_cost.py              # ~30 seconds
    .venv/bin/python bench/step_cost.py --quick      # a smoke run (numbers not meaningful)
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
from typing import Any, Callable

import torch
import wrapt

LAYERS, SLOTS, HIDDEN = 8, 4096, 64


class LayerWork:
    """About one tiny Llama layer's small ops on a batch, and some Python: what runs
    between two KV writes of a decode step on the CPU engine (about half a millisecond)."""

    def __init__(self, batch: int = 1, ops: int = 24) -> None:
        self.weights = [torch.randn(HIDDEN, HIDDEN) for _ in range(ops)]
        self.x = torch.randn(batch, HIDDEN)
        self.junk = [{"a": i, "b": str(i)} for i in range(3000)]

    def __call__(self) -> None:
        x = self.x
        for w in self.weights:
            x = torch.nn.functional.silu(x @ w) + x
            x = x / (x.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()
        sum(len(d["b"]) for d in self.junk)


class Layer:
    """What a pool reads of sglang's RadixAttention: its layer id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


def measure(batch: int, steps: int, rounds: int) -> dict[str, dict[str, float]]:
    """Median own us per step by kind, per configuration (guarded, floor)."""
    import sglang_oobguard
    from sglang.srt.mem_cache import memory_pool as mp
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode
    from sglang.srt.model_executor.model_runner import ModelRunner
    from sglang_oobguard.report import owntime

    logging.getLogger("sglang_oobguard").setLevel(logging.ERROR)  # one activation line per install otherwise
    guarded_dir, floor_dir = tempfile.mkdtemp(prefix="oobguard-own-"), tempfile.mkdtemp(prefix="oobguard-floor-")
    os.environ["SGLANG_OOBGUARD_OWN_TIME"] = guarded_dir  # read by the first install
    pool = mp.MHATokenToKVPool(SLOTS, 1, torch.bfloat16, 2, 16, LAYERS, "cpu", False)
    table = mp.ReqToTokenPool(size=batch + 1, max_context_len=512, device="cpu", enable_memory_saver=False)
    runner = ModelRunner.__new__(ModelRunner)  # no model loaded: only what the step hook reads
    runner.token_to_kv_pool, runner.req_to_token_pool, runner.tp_rank, runner.pp_rank, runner.dp_rank = \
        pool, table, 0, 0, 0
    seq = [100 + r for r in range(batch)]
    for r in range(batch):
        table.req_to_token[r, :seq[r]] = torch.arange(1 + r * 512, 1 + r * 512 + seq[r])
    loc = torch.tensor([1 + r * 512 + seq[r] - 1 for r in range(batch)])
    k = torch.ones(batch, 2, 16, dtype=torch.bfloat16)
    layers, work, copy = [Layer(i) for i in range(LAYERS)], LayerWork(batch), torch.zeros(256, dtype=torch.int64)
    write_loc = getattr(mp, "KVWriteLoc", None)

    def model(forward_batch: Any) -> None:
        copy[:batch].copy_(forward_batch.out_cache_loc)
        ids = copy[:batch] if write_loc is None else write_loc(copy[:batch], None)
        for layer in layers:
            work()
            pool.set_kv_buffer(layer, ids, k, k)

    def new_batch() -> Any:
        made = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=batch, input_ids=torch.zeros(batch, dtype=torch.int64),
                            req_pool_indices=torch.arange(batch), seq_lens=torch.tensor(seq), out_cache_loc=loc.clone(),
                            seq_lens_sum=sum(seq))
        made.seq_lens_cpu, made.rids = torch.tensor(seq), [f"r{i}" for i in range(batch)]
        return made

    timer = owntime.OwnTime(floor_dir)
    empty: Callable[..., Any] = lambda wrapped, instance, args, kwargs: wrapped(*args, **kwargs)  # noqa: E731
    floor_step = timer.timed("step", empty)
    original = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]
    hooks: list = []

    def guarded() -> None:
        sglang_oobguard.install("strict")
        hooks[:] = [ModelRunner.__dict__["forward"]._self_wrapper]

    def floor() -> None:
        sglang_oobguard.uninstall()
        mp.MHATokenToKVPool.set_kv_buffer = wrapt.FunctionWrapper(original, timer.timed("write", empty))
        hooks[:] = [floor_step]

    scheduler = LayerWork(batch, ops=8)
    batches = [new_batch() for _ in range(steps)]
    results: dict[str, list[dict[str, float]]] = {"guarded": [], "floor": []}
    configurations = (("guarded", guarded_dir, guarded), ("floor", floor_dir, floor))
    for round_ in range(rounds):  # in alternating order, so drift and noise hit both alike
        for name, folder, start in configurations if round_ % 2 == 0 else configurations[::-1]:
            start()
            before = owntime.read(folder)
            for forward_batch in batches:
                scheduler()
                hooks[0](lambda b: model(b), runner, (forward_batch,), {})
            after = owntime.read(folder)
            results[name].append({kind: (after[kind][0] - before[kind][0]) / steps / 1e3 for kind in owntime.KINDS})
            mp.MHATokenToKVPool.set_kv_buffer = original
    sglang_oobguard.uninstall()
    return {name: {kind: statistics.median(r[kind] for r in rows) for kind in ("write", "step")}
            for name, rows in results.items()}


HEADER = ("| batch | the guard's own time per step (strict) | empty timed wrappers at the same entry points | "
          "the guard over that floor | the guard / the floor |\n|---|---|---|---|---|")


def row(batch: int, got: dict[str, dict[str, float]], target: float = 3.0) -> tuple[str, float]:
    """The table's row of one batch, and the guard's own time over the floor's (issue 46's
    target: at most `target`)."""
    total = {name: sum(kinds.values()) for name, kinds in got.items()}
    x = total["guarded"] / total["floor"]
    return (f"| {batch} | {total['guarded']:.1f} us (write {got['guarded']['write']:.1f}, step "
            f"{got['guarded']['step']:.1f}) | {total['floor']:.1f} us (write {got['floor']['write']:.1f}, step "
            f"{got['floor']['step']:.1f}) | {total['guarded'] - total['floor']:.1f} us "
            f"| {x:.2f}x ({'PASS' if x <= target else 'MISS'} <= {target:g}x) |"), x


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smoke run: few steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(HEADER)
    for batch in (1, 8):
        print(row(batch, measure(batch, 10 if args.quick else 150, 2 if args.quick else 6))[0])
    print(f"\n{LAYERS} layers, each after about half a millisecond of a layer's small ops, writing from a copy of "
          "out_cache_loc; own time per forward step, the median over interleaved rounds.")


if __name__ == "__main__":
    main()
