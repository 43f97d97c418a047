"""What each check costs a server (issue 46): `bench/engine.py --per-check`.

One engine per column, each the guard in strict mode with one more check on
(SGLANG_OOBGUARD_CHECKS; `python -m sglang_oobguard help` lists the checks and what each
needs), every one with the own-time file (`report/owntime.py`). The grid: rounds at
batch B and context C (tests/e2e/engine_run.py's serve workload with `contexts=`: every
prompt is C token ids of one shared prefix in the radix cache, so the prefix is
prefilled once, in the warm-up, and each decode step reads about C tokens per request).
Every engine runs every grid point in every round, the engines in turn (the order
rotated); `--at-once` bounds the engines up together (each takes about 1.8 GB).

Per cell: the guard's own host time per forward step (every entry point: the writes,
the step check, the allocator hooks, the flush; the own-time timer's own cost included,
about 6 us a step), its share of the forward steps' own time, and what the column's
check adds to the column it builds on. Then the issue's targets, each as its measured
ratio with PASS or MISS. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from engine import measure, num, own_time, timer_ns

# name, label, SGLANG_OOBGUARD_CHECKS (None: unset, strict's default set), the column it adds a check to
COLUMNS = (
    ("bounds", "bounds", "bounds", None),
    ("map", "+ map", "bounds,map", "bounds"),
    ("positions", "+ positions", "bounds,map,positions", "map"),
    ("strict", "strict (+ ownids)", None, "positions"),
    ("liveness", "+ liveness", "+liveness", "strict"),
    ("owners", "+ owners", "+liveness,+owners", "liveness"),
    ("history", "+ history", "+liveness,+owners,+history", "owners"),
    ("reads", "+ reads: strict + liveness", "+liveness,+owners,+history,+reads", "history"),
    ("rows", "+ rows", "+liveness,+rows", "liveness"),
    ("leaks", "+ leaks (per release, per idle)", "+liveness,+leaks", "liveness"),
    ("finite", "strict + finite", "+finite", "strict"),
    ("all", "everything", "all", "reads"),
)
GRIDS = {"targets": ((8, 512), (8, 4096)), "full": tuple((b, c) for b in (1, 8, 64) for c in (512, 4096)),
         "smoke": ((8, 64), (8, 128))}  # smoke: tests/test_bench.py's (numbers not meaningful)
TARGET_BATCH = 8
# at batch 8: (column, over column, at most) of the own time (issue 45: the position check rides the step
# check's own time, within 15% of it; issue 46: the heavy checks); flat in context; everything's share
RATIO_TARGETS = (("positions", "map", 1.15), ("reads", "strict", 2.0), ("finite", "strict", 2.0))
FLAT_TARGET, SHARE_TARGET = 1.3, 0.02


def environment(checks: str | None) -> dict[str, str]:
    return {"SGLANG_OOBGUARD_MODE": "strict", **({"SGLANG_OOBGUARD_CHECKS": checks} if checks else {})}


def run(args: argparse.Namespace) -> int:
    """Measure the grid, print the table and the targets line; 1 where the tokens differ."""
    from e2e.tiny_model import build_tiny_llama

    points = GRIDS[args.grid]
    columns = [column for column in COLUMNS if column[0] in args.columns]
    contexts = sorted({c for _, c in points})
    options = (f"batch={max(b for b, _ in points)}", f"tokens={args.new_tokens}",
               f"contexts={','.join(map(str, contexts))}", *(("cuda",) if args.device == "cuda" else ()))
    sizes = tuple({"batch": b, "context": c} for b, c in points)
    rounds: dict = {}
    t0, load = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="oobguard-bench-checks-") as folder:
        model = build_tiny_llama(Path(folder) / "model", layers=args.layers,
                                 positions=contexts[-1] + args.new_tokens + 64)
        for first in range(0, len(columns), args.at_once):
            group = {name: environment(checks) for name, _, checks, _ in columns[first:first + args.at_once]}
            rounds.update(measure(args, model, group, sizes, options)["rounds"])
    wall = time.monotonic() - t0
    cells = {}
    for name, *_ in columns:
        for i, point in enumerate(points):
            mine = [got for got in rounds[name] if got["point"] == i]
            cells[(name, point)] = {**own_time(mine), "forward_ms": forward_ms(mine)}
    same = all(got["outputs"] == base["outputs"] for name, *_ in columns
               for got, base in zip(rounds[name], rounds[columns[0][0]]))
    print(f"sglang-oobguard cost per check: bench/engine.py --per-check --grid {args.grid}, tiny Llama {args.layers} "
          f"layers, {args.new_tokens} new tokens greedy per round, {args.rounds} rounds interleaved, shared-prefix "
          f"prompts of the context's length in the radix cache; {wall:.0f} s in all, load average {load:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after ({os.cpu_count()} cores: above that, other work takes turns with the "
          "guard's code, and the own time, a wall clock, counts those turns)")
    print()
    print(table(columns, cells, points))
    print()
    print(kinds_table(columns, cells, points))
    print()
    warm, cold = timer_ns()
    calls = [cell["own_calls"] for cell in cells.values() if cell["own_calls"] == cell["own_calls"]]
    print(f"The own-time timer itself, in every figure: about {warm:.0f} ns a call warm, {cold:.0f} cold (this "
          f"process), at {min(calls):.1f}-{max(calls):.1f} timed entry calls a step: about "
          f"{min(calls) * cold / 1e3:.0f}-{max(calls) * cold / 1e3:.0f} us a step.")
    print(targets_line(cells, points))
    print(f"tokens: {f'every column produced the {columns[0][1]} column' + chr(39) + 's tokens' if same else 'DIFFER'}"
          " at every grid point in every round")
    if args.json:
        args.json.write_text(json.dumps({"grid": points, "cells": {f"{n} {b}x{c}": v for (n, (b, c)), v in
                                                                    cells.items()}, "rounds": rounds}, indent=1))
    return 0 if same else 1


def table(columns: list, cells: dict, points: tuple) -> str:
    """One row per grid point, one column per check: own us per step (share; what the
    column's check adds to the column it builds on, where that ran too)."""
    lines = ["| batch | context | forward step | " + " | ".join(label for _, label, _, _ in columns) + " |",
             "|---|---|---|" + "---|" * len(columns)]
    for point in points:
        row = [str(point[0]), str(point[1]), f"{num(cells[(columns[0][0], point)]['forward_ms'], 1)} ms"]
        for name, _, _, over in columns:
            cell = cells[(name, point)]
            added = "" if (over, point) not in cells else f", {cell['own_us'] - cells[(over, point)]['own_us']:+.0f}"
            row.append(f"{num(cell['own_us'])} us ({num(cell['own_share'] * 100, 2)}%{added})")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def kinds_table(columns: list, cells: dict, points: tuple) -> str:
    """Where each cell's own time goes: us per step by kind of entry point (`report.owntime.KINDS`:
    the step check, the allocator hooks, the pool writes, ...), the kinds that took any."""
    lines = ["| batch | context | column | own us per step by entry point |", "|---|---|---|---|"]
    for point in points:
        for name, label, _, _ in columns:
            kinds = cells[(name, point)]["own_kinds"]
            lines.append(f"| {point[0]} | {point[1]} | {label} | "
                         + ", ".join(f"{kind} {us:.0f}" for kind, us in kinds.items()) + " |")
    return "\n".join(lines)


def verdict(met: bool) -> str:
    return "PASS" if met else "MISS"


def targets_line(cells: dict, points: tuple) -> str:
    """The issue's targets at batch 8, each as measured and PASS / MISS (over every
    context of the grid at batch 8)."""
    at = [point for point in points if point[0] == TARGET_BATCH]
    label = {name: text for name, text, _, _ in COLUMNS}
    ran = {name for name, _ in cells}
    parts = []
    for name, over, most in RATIO_TARGETS:
        if not at or not {name, over} <= ran:
            parts.append(f"{label[name]} <= {most:g}x {label[over]}: not measured")
            continue
        ratios = [cells[(name, p)]["own_us"] / cells[(over, p)]["own_us"] for p in at]
        parts.append(f"{label[name]} <= {most:g}x {label[over]}: " + ", ".join(
            f"{r:.2f}x at {p[1]}" for r, p in zip(ratios, at)) + f": {verdict(max(ratios) <= most)}")
    if len(at) > 1 and "reads" in ran:
        flat = cells[("reads", at[-1])]["own_us"] / cells[("reads", at[0])]["own_us"]
        parts.append(f"{label['reads']} flat in context, {at[-1][1]} within {FLAT_TARGET:g}x of {at[0][1]}: "
                     f"{flat:.2f}x: {verdict(flat <= FLAT_TARGET)}")
    else:
        parts.append(f"{label['reads']} flat in context: not measured")
    if at and "all" in ran:
        shares = [cells[("all", p)]["own_share"] for p in at]
        parts.append(f"everything on under {SHARE_TARGET:.0%} of the forward step: " + ", ".join(
            f"{s * 100:.2f}% at {p[1]}" for s, p in zip(shares, at)) + f": {verdict(max(shares) < SHARE_TARGET)}")
    else:
        parts.append(f"everything on under {SHARE_TARGET:.0%} of the forward step: not measured")
    return f"targets (issues 45 and 46, own time per forward step at batch {TARGET_BATCH}): " + "; ".join(parts) + "."


def forward_ms(rounds: list[dict]) -> float:
    """The median forward step's own wall time (ms), the guard's included."""
    steps = [got["own"]["step"][2] / got["own"]["step"][1] / 1e6 for got in rounds if got["own"]["step"][1]]
    return statistics.median(steps) if steps else float("nan")
