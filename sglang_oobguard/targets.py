"""Targets: the one table of guarded write methods, and how each resolves on the
installed sglang. The same table drives install, uninstall and the coverage report.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Optional, Union

# Supported versions, declared up front: from the oldest release the CI matrix runs
# (0.5.10: activated by the .pth hook, having no plugin loader) to the newest one read.
# A class or method that a release lacks is skipped and named in a log line; outside
# the range the guard still installs what fits, and the same line says so.
SUPPORTED = ((0, 5, 10), (0, 5, 23))
TESTED = ("0.5.10", "0.5.12", "0.5.23")

MEMORY_POOL = "sglang.srt.mem_cache.memory_pool"
# sglang 0.5.13+'s in-source probe, as memory_pool binds it; its calls under our
# labels duplicate our probe and are skipped while the guard is installed.
UPSTREAM_PROBE = "maybe_detect_oob"


@dataclass(frozen=True)
class Bound:
    """The exclusive upper bound of a method's slot ids (the lower one is 0)."""

    rule: str  # how the bound is computed, for logs and `doctor`
    high: Callable[[Any], int]


def _token_slots(pool: Any) -> int:
    return pool.size + pool.page_size


def _dcp_token_slots(pool: Any) -> int:
    # 0.5.19+: under decode context parallelism the MLA write loc is logical,
    # one stored row per `_write_loc_dcp_span` ids; upstream widens its bound so.
    return (pool.size + pool.page_size) * getattr(pool, "_write_loc_dcp_span", 1)


TOKEN_SLOTS = Bound("size + page_size", _token_slots)
DCP_TOKEN_SLOTS = Bound("(size + page_size) * _write_loc_dcp_span", _dcp_token_slots)


@dataclass(frozen=True)
class Target:
    module: str
    qualname: str  # "Class.method", as wrapt.wrap_function_wrapper takes it
    label: str  # upstream's label for the same site
    bound: Bound

    @property
    def class_name(self) -> str:
        return self.qualname.split(".")[0]

    @property
    def method(self) -> str:
        return self.qualname.split(".")[1]


TARGETS: tuple[Target, ...] = (
    Target(MEMORY_POOL, "MHATokenToKVPool.set_kv_buffer", "set_kv_buffer (MHA)", TOKEN_SLOTS),
    Target(MEMORY_POOL, "MHATokenToKVPoolFP4.set_kv_buffer", "set_kv_buffer (MHA-FP4)", TOKEN_SLOTS),
    Target(MEMORY_POOL, "MLATokenToKVPool.set_kv_buffer", "set_kv_buffer (MLA)", TOKEN_SLOTS),
    Target(MEMORY_POOL, "MLATokenToKVPool.set_mla_kv_buffer", "set_mla_kv_buffer (MLA)", DCP_TOKEN_SLOTS),
    Target(MEMORY_POOL, "MLATokenToKVPoolFP4.set_kv_buffer", "set_kv_buffer (MLA-FP4)", TOKEN_SLOTS),
    # Upstream does not widen the FP4 MLA bound: that write indexes rows directly.
    Target(MEMORY_POOL, "MLATokenToKVPoolFP4.set_mla_kv_buffer", "set_mla_kv_buffer (MLA-FP4)", TOKEN_SLOTS),
)

# A target's position in TARGETS is its site id in the probe's record.
SITES: dict[Target, int] = {target: site for site, target in enumerate(TARGETS)}


@dataclass(frozen=True)
class Resolved:
    """A target as found on the installed sglang: where `loc` and the layer come in."""

    target: Target
    owner: type
    original: Callable[..., Any]
    loc_name: str  # `loc` or `loc_info`, by release; always the 2nd parameter
    override_index: Optional[int]  # position of `layer_id_override` in *args, if any

    @property
    def site(self) -> int:
        return SITES[self.target]


def resolve(target: Target, module: ModuleType) -> Union[Resolved, str]:
    """The target on this sglang, or the reason it cannot be guarded here."""
    owner = getattr(module, target.class_name, None)
    if not isinstance(owner, type):
        return f"{target.class_name} is not in this sglang"
    original = owner.__dict__.get(target.method)
    if original is None:
        return f"{target.qualname} is not defined by the class itself (inherited or absent)"
    original = getattr(original, "__wrapped__", original)  # already wrapped by us
    if not inspect.isfunction(original):
        return f"{target.qualname} is a {type(original).__name__}, not a function"
    params = list(inspect.signature(original).parameters)[1:]  # drop self
    if len(params) < 2:
        return f"{target.qualname}{inspect.signature(original)} has no (layer, loc) parameters"
    override = params.index("layer_id_override") if "layer_id_override" in params else None
    return Resolved(target, owner, original, params[1], override)


def version_of_sglang() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("sglang")
    except PackageNotFoundError:
        return "unknown"


def is_supported(version: str) -> bool:
    parts: list[int] = []
    for piece in version.split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        if not digits:
            return False
        parts.append(int(digits))
    return SUPPORTED[0] <= tuple(parts) <= SUPPORTED[1]
