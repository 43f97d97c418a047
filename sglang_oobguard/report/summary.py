"""`python -m sglang_oobguard report DIR`: what the guarded processes of a run
reported, read back from their files in SGLANG_OOBGUARD_REPORT_DIR (`reportfile`),
with an exit code that gates a CI job: 1 on any violation, 0 on none, 2 when no
process was guarded at all (a guard that never ran is a failure, not a pass), and 3
when a check that was asked for did not install in some process (a hook whose module
loaded without what it wraps: that check never ran there).

Standard library only: a CI step can run it without torch.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Optional

from ..model.violation import Violation
from . import counts
from .files import ACTIVATION, COUNTS, PREFIX, ROLE, SUFFIX, UNGUARDED as UNGUARDED_KIND, VIOLATION

OK, VIOLATIONS, UNGUARDED, NOT_INSTALLED = 0, 1, 2, 3  # exit codes


@dataclass
class Process:
    """One guarded process: its activation record, how many violation reports it filed,
    and what each check did (its last `counts` record)."""

    file: str
    activation: dict[str, Any]
    reports: int = 0
    counts: dict[str, dict[str, int]] = field(default_factory=dict)
    unguarded: list[dict[str, Any]] = field(default_factory=list)  # hooks that did not install

    def missing(self) -> list[dict[str, Any]]:
        """The hooks that did not install here and carry a check that was asked for."""
        return [entry for entry in self.unguarded if entry.get("checks")]


@dataclass
class Group:
    """The violations of one site, pool and layer, across processes."""

    label: str
    pool: str
    layer: int
    reports: int = 0
    processes: set[str] = field(default_factory=set)  # "pid@host"
    first: dict[str, Any] = field(default_factory=dict)  # the earliest record


@dataclass
class Summary:
    folder: str
    processes: list[Process]
    groups: list[Group]
    problems: list[str]  # unreadable files and lines, records before any activation

    def totals(self) -> dict[str, dict[str, int]]:
        """What each check did, summed over the processes (a check on in any process is listed)."""
        total: dict[str, dict[str, int]] = {}
        for process in self.processes:
            for check, units in process.counts.items():
                mine = total.setdefault(check, {})
                for unit, n in units.items():
                    mine[unit] = mine.get(unit, 0) + n
        return total

    @property
    def exit_code(self) -> int:
        if not self.processes:
            return UNGUARDED
        if self.groups:
            return VIOLATIONS
        return NOT_INSTALLED if any(p.missing() for p in self.processes) else OK

    @property
    def verdict(self) -> str:
        return {OK: "OK: no violation", VIOLATIONS: "FAIL: KV-cache violations reported",
                UNGUARDED: "FAIL: no process was guarded (no activation record)",
                NOT_INSTALLED: "FAIL: a check that was asked for did not install (see `not installed`)"}[self.exit_code]


def read(folder: str) -> Summary:
    """Every report file in `folder` (a missing folder reads as empty)."""
    processes: list[Process] = []
    groups: dict[tuple[str, str, int], Group] = {}
    problems: list[str] = []
    names = sorted(os.listdir(folder)) if os.path.isdir(folder) else []
    for name in names:
        if not (name.startswith(PREFIX) and name.endswith(SUFFIX)):
            continue
        current: Optional[Process] = None
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as lines:
                for number, line in enumerate(lines, 1):
                    try:
                        record = json.loads(line)
                        kind = record["kind"]
                    except (ValueError, KeyError, TypeError):
                        problems.append(f"{name}:{number}: not a report record")
                        continue
                    if kind == ACTIVATION:
                        current = Process(name, record, unguarded=list(record.get(UNGUARDED_KIND) or []))
                        processes.append(current)
                    elif kind == UNGUARDED_KIND and current is not None:
                        current.unguarded.append(record)
                    elif kind == ROLE and current is not None:  # the process entry, found after activation
                        current.activation.update(role=record.get("role"), ranks=record.get("ranks") or {})
                    elif kind == COUNTS and current is not None:
                        current.counts = record.get("counts") or {}
                    elif kind == VIOLATION:
                        if current is None:
                            problems.append(f"{name}:{number}: a violation before any activation record")
                        else:
                            current.reports += 1
                        _add(groups, record)
        except OSError as exc:
            problems.append(f"{name}: {exc}")
    ordered = sorted(groups.values(), key=lambda g: g.first.get("time", 0.0))
    return Summary(folder, processes, ordered, problems)


def _add(groups: dict[tuple[str, str, int], Group], record: dict[str, Any]) -> None:
    found = record.get("violation") or {}
    key = (str(found.get("label")), str(found.get("pool")), int(found.get("layer", -1)))
    group = groups.setdefault(key, Group(*key))
    group.reports += 1
    group.processes.add(_who(record))
    if not group.first or record.get("time", 0.0) < group.first.get("time", 0.0):
        group.first = record


def _who(record: dict[str, Any]) -> str:
    return f"{record.get('pid')}@{record.get('host')}"


def describe(record: dict[str, Any]) -> str:
    """A violation record's text, as the guard itself reports it (`Violation.__str__`)."""
    found = record.get("violation") or {}
    try:
        return Violation.from_dict(found).described()
    except TypeError:  # written by a release whose Violation has other required fields
        return json.dumps(found)


def _when(record: dict[str, Any]) -> str:
    stamp = record.get("time")
    if not isinstance(stamp, (int, float)):
        return "?"
    return datetime.fromtimestamp(stamp, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _short(argv: str, width: int = 60) -> str:
    """A command line cut to `width`, its first word to its file name."""
    head, _, rest = argv.partition(" ")
    text = " ".join(filter(None, (os.path.basename(head), rest)))
    return text if len(text) <= width else text[:width - 3] + "..."


def _process_line(process: Process) -> str:
    a = process.activation
    where = a.get("role") or _short(str(a.get("argv") or "?"))
    ranks = " ".join(f"{k}={v}" for k, v in sorted((a.get("ranks") or {}).items()))
    said = plural(process.reports, "violation report") if process.reports else "no violation"
    return (f"  pid {a.get('pid')} on {a.get('host')} ({where}{', ' + ranks if ranks else ''}): "
            f"mode {a.get('mode')}, {a.get('guarded')} guarded methods, sglang {a.get('sglang')}: {said}")


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}{'es' if noun.endswith('s') else 's'}"


def render(summary: Summary) -> str:
    reported = [p for p in summary.processes if p.reports]
    lines = [f"sglang_oobguard report {summary.folder}: {plural(len(summary.processes), 'process')} guarded, "
             f"{len(reported)} with violations"]
    if summary.groups:
        lines.append("violations by site, pool and layer (reports, processes; first occurrence):")
        for group in summary.groups:
            first = group.first
            layer = group.layer if group.layer >= 0 else "?"
            lines.append(f"  {group.label} | {group.pool} | layer {layer}: {plural(group.reports, 'report')} in "
                         f"{plural(len(group.processes), 'process')}; first {_when(first)}, pid {first.get('pid')} on "
                         f"{first.get('host')}: {describe(first)}")
    totals = summary.totals()
    if totals:
        never = [check for check, units in totals.items() if not any(n for u, n in units.items() if u != "reports")]
        lines.append(f"checked (all processes): {counts.line(totals)}")
        if never:
            lines.append(f"never ran: {', '.join(never)} (on, but no process counted any work for them)")
    lines += _unguarded_lines(summary)
    lines.append("processes:" + ("" if summary.processes else " none"))
    lines += [_process_line(process) for process in summary.processes]
    lines += [f"unreadable: {problem}" for problem in summary.problems]
    lines.append(summary.verdict)
    return "\n".join(lines)


def _unguarded_lines(summary: Summary) -> list[str]:
    """Each hook that did not install, once, with the processes it failed in."""
    seen: dict[tuple[str, str], tuple[dict[str, Any], list[str]]] = {}
    for process in summary.processes:
        for entry in process.unguarded:
            key = (str(entry.get("hook")), str(entry.get("why")))
            seen.setdefault(key, (entry, []))[1].append(str(process.activation.get("pid")))
    return [f"not installed: {hook} after {entry.get('module')} loaded ({why}), in pid {', '.join(pids)}: " +
            (f"checks that did not run there: {', '.join(entry['checks'])}" if entry.get("checks")
             else "no check depends on it") for (hook, why), (entry, pids) in seen.items()]


def as_json(summary: Summary) -> dict[str, Any]:
    return {
        "folder": summary.folder,
        "exit_code": summary.exit_code,
        "verdict": summary.verdict,
        "groups": [{"label": g.label, "pool": g.pool, "layer": g.layer, "reports": g.reports,
                    "processes": sorted(g.processes), "first": {**g.first, "message": describe(g.first)}}
                   for g in summary.groups],
        "checked": summary.totals(),
        "processes": [{"file": p.file, "reports": p.reports, "counts": p.counts, **p.activation,
                       UNGUARDED_KIND: p.unguarded}
                      for p in summary.processes],
        "problems": summary.problems,
    }


def run(folder: str, as_json_output: bool = False) -> int:
    """Prints the summary of `folder`; returns the exit code."""
    summary = read(folder)
    if not os.path.isdir(folder):
        summary.problems.append(f"{folder} is not a folder")
    print(json.dumps(as_json(summary), indent=2) if as_json_output else render(summary))
    return summary.exit_code
