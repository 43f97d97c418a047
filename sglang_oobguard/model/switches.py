"""Switches: one check, one name, one switch (SGLANG_OOBGUARD_CHECKS).

A user who finds one check wrong must be able to turn that one off and keep the
rest. The list is read left to right: `all`, `name` (on), `+name` (on), `-name`
(off). A list that starts with `+` or `-` edits the set the older variables ask for
(`SGLANG_OOBGUARD_LIVENESS=1`, `SGLANG_OOBGUARD_FINITE=1`: `ALIASES`); one that starts
with `all` or a bare name starts from nothing. A check whose dependency is off is an
error, never a check that quietly does not run.

Standard library only (read by `config` in every sglang process).
"""

from __future__ import annotations

from typing import Callable, Iterable, Mapping

# Every check the guard can run: its switch's name, in the order of the exit line, the report and doctor.
# Each is a unit of `checks/` (`checks.registry` lists them, with what each catches), which this table names
# only: sglang's processes read the switch before torch, where no unit may load.
NAMES = ("bounds", "map", "owners", "liveness", "history", "reads", "ownids", "positions", "finite", "swa", "pd",
         "hicache", "rows", "leaks")

# What each check reads that another keeps: the read check reads the owner table and each
# slot's generation (history); ids of a layer's own are compared with the ids the map passed; a token's
# position is the one the map finds its slot at.
NEEDS = {
    "owners": ("liveness", "map"),
    "history": ("liveness",),
    "reads": ("liveness", "map", "owners", "history"),
    "ownids": ("map",),
    "positions": ("map",),
    "pd": ("liveness",),
    "rows": ("liveness",),
    "leaks": ("liveness",),
}

# The guard on, nothing else asked for. The SWA door's slot check and HiCache's copies run
# without liveness (their frees, and the loads' owners, with it): on, as before the switch. The position
# check runs wherever the write map does.
DEFAULT = frozenset({"bounds", "map", "ownids", "positions", "swa", "hicache"})
ALIASES = {  # the older variables, each a set of checks turned on
    "liveness": frozenset({"liveness", "history", "owners", "reads", "swa", "pd", "hicache", "rows", "leaks"}),
    "finite": frozenset({"finite"}),
}
ALWAYS = "bounds"
HELP = ("SGLANG_OOBGUARD_CHECKS: which checks run, a comma list read left to right: all, NAME or +NAME (on), "
        "-NAME (off); a list that starts with + or - edits the default below, any other starts from nothing "
        "(e.g. all,-reads; bounds,map; -ownids). Default: unset (the checks below marked on, with those of "
        "SGLANG_OOBGUARD_LIVENESS=1 and SGLANG_OOBGUARD_FINITE=1 when set). bounds is never off.")


def default(liveness: bool, finite: bool) -> frozenset[str]:
    """The checks of the older variables alone: exactly what they turned on before the switch."""
    return DEFAULT | (ALIASES["liveness"] if liveness else frozenset()) | (ALIASES["finite"] if finite else frozenset())


def parse(raw: str, start: frozenset[str], fail: Callable[[str], Exception]) -> frozenset[str]:
    """The checks `raw` (SGLANG_OOBGUARD_CHECKS) turns on over `start` (the aliases' set);
    `fail(accepted)` makes the error for a list the guard does not accept."""
    items = [item.strip().lower() for item in raw.split(",")]  # any case, as the modes
    if not items or not all(items):
        raise fail(_accepted("an empty item"))
    on = set(start) if items[0][0] in "+-" else set()
    for item in items:
        sign, name = (item[0], item[1:].strip()) if item[0] in "+-" else ("+", item)
        if name == "all":
            on = set(NAMES) if sign == "+" else set()
        elif name not in NAMES:
            raise fail(_accepted(f"unknown check {name!r}"))
        elif sign == "+":
            on.add(name)
        else:
            on.discard(name)
    if ALWAYS not in on:
        raise fail(f"a list that keeps {ALWAYS!r} on ({ALWAYS!r} cannot be turned off while the guard is on; "
                   "SGLANG_OOBGUARD_MODE=off turns the guard off)")
    missing = [(name, need) for name in NAMES if name in on for need in NEEDS.get(name, ()) if need not in on]
    if missing:
        name, need = missing[0]
        raise fail(f"a list in which each check's dependencies are on ({name!r} needs {need!r}, which is off: "
                   f"add '+{need}', or turn {name!r} off with '-{name}')")
    return frozenset(on)


def _accepted(why: str) -> str:
    return f"a comma list of all, NAME, +NAME, -NAME with NAME one of {', '.join(NAMES)} (not {why})"


def help_lines(catches: Mapping[str, str], defaults: Iterable[str] = DEFAULT) -> list[str]:
    """One line per check, ASan `help=1` style: name, default, what it catches (`catches`: the units' words)."""
    on = set(defaults)
    lines = []
    for name in NAMES:
        alias = next((f"on with SGLANG_OOBGUARD_{key.upper()}=1" for key, names in ALIASES.items() if name in names), "")
        state = "on" if name in on else alias or "off"
        needs = f" (needs {', '.join(NEEDS[name])})" if name in NEEDS else ""
        lines.append(f"  {name:9} default: {state}{needs} - {catches[name]}")
    return lines
