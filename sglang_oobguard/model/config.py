"""Configuration: the environment, parsed once, strictly.

Standard library only: the plugin entry point imports this module in every sglang
process, and when the guard is off nothing else may be imported.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Mapping, Optional, TypeVar

from . import switches


class ConfigError(ValueError):
    """An environment variable or argument holds a value the guard does not accept."""

    def __init__(self, variable: str, value: str, accepted: str) -> None:
        self.variable, self.value, self.accepted = variable, value, accepted
        super().__init__(
            f"sglang_oobguard: invalid {variable}={value!r}; accepted: {accepted}. "
            "The KV-cache guard is NOT active until this is fixed."
        )


class Mode(str, enum.Enum):
    """What a violation does (README, "Modes")."""

    STRICT = "strict"  # upstream's semantics: the process fails
    RAISE = "raise"  # contain, then KVOutOfBoundsError at the next check point
    WARN = "warn"  # contain, log, never raise
    OFF = "off"


class Backend(str, enum.Enum):
    """Which probe runs (`BACKEND_PATHS` says where, in the words the activation line and doctor use)."""

    AUTO = "auto"
    TORCH = "torch"  # the host scan on every tensor (a host sync per write on an accelerator)
    TRITON = "triton"  # the kernel on every tensor, reported deferred (a CPU needs TRITON_INTERPRET=1)


# What each backend runs where: said in the activation line and by doctor, because the
# host scan costs a host sync per write on any accelerator it serves.
BACKEND_PATHS = {
    Backend.AUTO: "the kernel on CUDA tensors (no sync); the host scan on CPU tensors, and on "
                  "NPU, XPU and MUSA tensors at one host sync per write",
    Backend.TORCH: "the host scan on every tensor: one host sync per write on any accelerator",
    Backend.TRITON: "the kernel on every tensor",
}

ENABLE_VAR = "SGLANG_ENABLE_ASYNC_ASSERT"
INVARIANT_VAR = "SGLANG_INVARIANT_CHECK"
MODE_VAR = "SGLANG_OOBGUARD_MODE"
BACKEND_VAR = "SGLANG_OOBGUARD_BACKEND"
POLL_VAR = "SGLANG_OOBGUARD_POLL_EVERY"
WARN_INTERVAL_VAR = "SGLANG_OOBGUARD_WARN_INTERVAL_S"
LIVENESS_VAR = "SGLANG_OOBGUARD_LIVENESS"
FINITE_VAR = "SGLANG_OOBGUARD_FINITE"
REPORT_DIR_VAR = "SGLANG_OOBGUARD_REPORT_DIR"
OWN_TIME_VAR = "SGLANG_OOBGUARD_OWN_TIME"
CHECKS_VAR = "SGLANG_OOBGUARD_CHECKS"

# sglang's EnvBool rules (sglang/srt/environ.py), any case.
_TRUE = ("true", "1", "yes", "y")
_FALSE = ("false", "0", "no", "n")
_INVARIANT_MODES = {"0": None, "1": Mode.WARN, "2": Mode.STRICT}


@dataclass(frozen=True)
class Config:
    mode: Mode = Mode.OFF
    backend: Backend = Backend.AUTO
    poll_every: int = 16  # deferred path: guarded calls between two record read-backs
    warn_interval_s: float = 10.0  # warn mode: seconds between two running-total lines
    liveness: bool = False  # also check that written and freed slots are allocated (README, "Liveness")
    report_dir: Optional[str] = None  # each process appends its JSON-lines report to a file here (`reportfile`)
    own_time: Optional[str] = None  # a benchmark's folder: each process keeps its own time there (`owntime`)
    upstream_probe: bool = False  # SGLANG_ENABLE_ASYNC_ASSERT is on: sglang's own probe runs in its methods
    finite: bool = False  # also check that the values a write stores are finite (README, "What it catches")
    # the checks on (`switches.NAMES`): SGLANG_OOBGUARD_CHECKS over the aliases; None: the aliases'
    checks: Optional[frozenset] = None
    switched_off: frozenset = frozenset()  # the checks SGLANG_OOBGUARD_CHECKS turned off (the aliases' set less it)

    def __post_init__(self) -> None:
        """`checks` and the older fields say the same: the fields follow the switch when it is given."""
        if self.checks is None:
            object.__setattr__(self, "checks", switches.default(self.liveness, self.finite))
        else:
            object.__setattr__(self, "liveness", "liveness" in self.checks)
            object.__setattr__(self, "finite", "finite" in self.checks)

    @property
    def active(self) -> bool:
        return self.mode is not Mode.OFF


def _get(env: Mapping[str, str], name: str) -> Optional[str]:
    """A variable's value; set-but-empty counts as unset (a CI matrix's 'off' axis)."""
    value = env.get(name)
    return value if value else None


E = TypeVar("E", bound=enum.Enum)


def _choice(env: Mapping[str, str], name: str, kind: type[E]) -> Optional[E]:
    raw = _get(env, name)
    if raw is None:
        return None
    try:
        return kind(raw.lower())
    except ValueError:
        raise ConfigError(name, raw, " | ".join(m.value for m in kind)) from None


def _number(env: Mapping[str, str], name: str, kind: type, default, minimum):
    raw = _get(env, name)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not value >= minimum:  # also refuses nan
        raise ConfigError(name, raw, f"a {kind.__name__} >= {minimum}")
    return value


def _folder(env: Mapping[str, str], name: str) -> Optional[str]:
    """A folder path, made absolute so that a process that changes its directory
    writes to the same place. Whether it can be written is learnt at the first
    write (a warning, never an error: see `reportfile`)."""
    raw = _get(env, name)
    if raw is None:
        return None
    if raw != raw.strip():
        raise ConfigError(name, raw, "a folder path without leading or trailing spaces")
    return os.path.abspath(os.path.expanduser(raw))


def parse_mode(value: Optional[str]) -> Optional[Mode]:
    """`install(mode=...)`'s argument: None, or one of the Mode values."""
    return None if value is None else _choice({"mode": str(value)}, "mode", Mode)


def _bool(env: Mapping[str, str], name: str) -> bool:
    raw = _get(env, name)
    if raw is not None and raw.lower() not in _TRUE + _FALSE:
        raise ConfigError(name, raw, "/".join(_TRUE + _FALSE) + " (any case)")
    return raw is not None and raw.lower() in _TRUE


def from_env(env: Optional[Mapping[str, str]] = None, mode: Optional[Mode] = None,
             default: Mode = Mode.OFF) -> Config:
    """Read the guard's configuration; every invalid value raises ConfigError.
    `mode` (install()'s argument) wins over the environment; `default` is the mode
    when neither asks for one."""
    env = os.environ if env is None else env

    enabled = _bool(env, ENABLE_VAR)
    liveness = _bool(env, LIVENESS_VAR)
    finite = _bool(env, FINITE_VAR)

    raw_level = _get(env, INVARIANT_VAR)
    if raw_level is not None and raw_level not in _INVARIANT_MODES:
        raise ConfigError(INVARIANT_VAR, raw_level, "0 | 1 | 2")
    level_mode = _INVARIANT_MODES.get(raw_level) if raw_level is not None else None

    explicit = mode or _choice(env, MODE_VAR, Mode)
    backend = _choice(env, BACKEND_VAR, Backend) or Backend.AUTO
    poll_every = _number(env, POLL_VAR, int, Config.poll_every, 1)
    warn_interval = _number(env, WARN_INTERVAL_VAR, float, Config.warn_interval_s, 0.0)
    report_dir = _folder(env, REPORT_DIR_VAR)
    own_time = _folder(env, OWN_TIME_VAR)

    if explicit is not None:
        mode = explicit  # includes OFF, which wins over everything
    elif level_mode is not None:
        mode = level_mode
    elif enabled:
        mode = Mode.STRICT
    else:
        mode = default
    raw_checks = _get(env, CHECKS_VAR)
    for deeper, asked in ((LIVENESS_VAR, liveness), (FINITE_VAR, finite), (CHECKS_VAR, raw_checks is not None)):
        if asked and mode is Mode.OFF and explicit is not Mode.OFF:
            # asked for a deeper check with the guard itself off: never run unguarded quietly
            raise ConfigError(deeper, _get(env, deeper) or "", ("unset" if deeper == CHECKS_VAR else "0") +
                              ", or set it with the guard on "
                              f"({ENABLE_VAR}=1 or {MODE_VAR}=strict|raise|warn)")
    on = mode is not Mode.OFF
    aliased = checks = switches.default(liveness and on, finite and on)
    if raw_checks is not None and on:
        checks = switches.parse(raw_checks, aliased, lambda accepted: ConfigError(CHECKS_VAR, raw_checks, accepted))
    # off by the switch: what it took from the aliases' set, or, for a list that starts anew, every check it left out
    decided = raw_checks is not None and on and raw_checks.strip()[:1] not in ("+", "-")
    off = frozenset(switches.NAMES) - checks if decided else aliased - checks
    return Config(mode, backend, poll_every, warn_interval, "liveness" in checks, report_dir, own_time, enabled,
                  "finite" in checks, checks, off)
