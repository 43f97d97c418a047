"""Discovery: what the installed sglang defines that the targets' rules cover.

Walks the subclasses of memory_pool's `KVCache` (whatever modules have defined them
so far), takes each method a class defines in its own `__dict__` whose name is a
write method's, and resolves it against `targets`: a `Found` site to guard, or a
`Skipped` one with the reason. Inherited methods are guarded where they are defined.
The tracked allocators' methods are found the same way (`allocator_targets`).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pkgutil
import textwrap
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

from .targets import (ALLOCATOR_BASE, ALLOCATOR_METHODS, ALLOCATOR_MODULE, BASE_CLASS, MEMORY_POOL, TRACKED_ALLOCATORS,
                      WRITE_METHOD, Role, Rule, label_for, rule_for)
from .dsv4targets import DSV4_FORWARDED, DSV4_UNREAD
from .swatargets import SWA_CHECKED, SWA_FORWARDED, SWA_METHODS, SWA_NAMED_ONLY, SwaRole
from .violation import site_id

# Modules that define pools outside memory_pool; `doctor` imports them to show the
# whole picture (the guard itself waits for sglang to import them: see patch).
POOL_PACKAGES = ("sglang.srt.mem_cache", "sglang.srt.hardware_backend.npu")


@dataclass(frozen=True)
class Method:
    """A method of a class, where that class defines it."""

    owner: type
    method: str

    @property
    def qualname(self) -> str:
        return f"{self.owner.__name__}.{self.method}"


@dataclass(frozen=True)
class Found(Method):
    """A write method to guard, and where its ids, layer and lengths come in."""

    original: Callable[..., Any]
    rule: Rule
    id_names: tuple[str, ...]  # per id parameter: its name in this signature
    sites: tuple[int, ...]  # per id parameter: its site id in the probe's record
    layer_name: Optional[str]
    override_index: Optional[int]  # position of `layer_id_override` in *args, if any


@dataclass(frozen=True)
class Skipped(Method):
    reason: str
    by_design: bool  # the method raises or does nothing by design: nothing to guard


def pool_classes(base: type) -> list[type]:
    """`base` and every subclass defined so far, parents first."""
    seen: dict[type, None] = {}

    def walk(cls: type) -> Iterator[type]:
        yield cls
        sub: type
        for sub in cls.__subclasses__():
            yield from walk(sub)

    for cls in walk(base):
        seen.setdefault(cls, None)
    return list(seen)


def write_methods(cls: type) -> list[str]:
    return [name for name in cls.__dict__ if WRITE_METHOD.match(name)]


def discover(base: type) -> list[Union[Found, Skipped]]:
    return [resolve(cls, name) for cls in pool_classes(base) for name in write_methods(cls)]


def resolve(owner: type, method: str) -> Union[Found, Skipped]:
    """How to guard `owner.method` on this sglang, or why not."""
    original = owner.__dict__[method]
    original = getattr(original, "__wrapped__", original)  # already wrapped by us
    if not inspect.isfunction(original):
        return Skipped(owner, method, f"a {type(original).__name__}, not a function", False)
    design = by_design(original)
    if design:
        return Skipped(owner, method, design, True)
    forwarded = SWA_FORWARDED.get((owner.__name__, method)) or DSV4_FORWARDED.get((owner.__name__, method))
    if forwarded is not None:  # takes no ids of its own: guarded where they land
        return Skipped(owner, method, forwarded, True)
    rule = rule_for(owner.__name__, method)
    if rule is None:
        why = DSV4_UNREAD if owner.__name__.startswith("DeepSeekV4") else "no bound rule known for its ids"
        return Skipped(owner, method, why, False)
    params = list(inspect.signature(original).parameters.values())[1:]  # drop self
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    for ids in rule.ids:
        if ids.position >= len(names) or names[ids.position] not in ids.names:
            return Skipped(owner, method, f"signature {inspect.signature(original)} does not put "
                                          f"{' or '.join(ids.names)} at position {ids.position + 1}", False)
    if rule.lens is not None and rule.lens >= len(names):
        return Skipped(owner, method, f"signature {inspect.signature(original)} has no row lengths", False)
    layer_name = names[rule.layer] if rule.layer is not None and rule.layer < len(names) else None
    override = names.index("layer_id_override") if "layer_id_override" in names else None
    sites = tuple(site_id(label_for(owner.__name__, method, ids)) for ids in rule.ids)
    return Found(owner, method, original, rule, tuple(names[i.position] for i in rule.ids), sites,
                 layer_name, override)


_DESIGN: "weakref.WeakKeyDictionary[Callable[..., Any], str]" = weakref.WeakKeyDictionary()


def by_design(function: Callable[..., Any]) -> str:
    """'raises ...' or 'does nothing' when the body is one raise or a bare return
    (after a docstring): such a method writes nothing and is left alone. Cached per
    function, weakly: a method's function holds its class, which must stay free to go."""
    try:
        return _DESIGN[function]
    except (KeyError, TypeError):
        pass
    verdict = _read_design(function)
    try:
        _DESIGN[function] = verdict
    except TypeError:  # not weakly referable: not cached
        pass
    return verdict


def _read_design(function: Callable[..., Any]) -> str:
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError):
        return ""
    definition = tree.body[0]
    assert isinstance(definition, (ast.FunctionDef, ast.AsyncFunctionDef))
    body = [s for s in definition.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1:
        return ""
    statement = body[0]
    if isinstance(statement, ast.Raise):
        raised = statement.exc.func if isinstance(statement.exc, ast.Call) else statement.exc
        return f"raises {ast.unparse(raised) if raised is not None else ''} by design".replace("  ", " ")
    if isinstance(statement, ast.Pass) or (isinstance(statement, ast.Return) and statement.value is None):
        return "does nothing by design"
    return ""


def import_pool_modules() -> dict[str, str]:
    """Import the modules of `POOL_PACKAGES` (not their subpackages) so that every
    pool class is defined; returns {module: why it did not import}."""
    failed: dict[str, str] = {}
    for package in POOL_PACKAGES:
        try:
            path = importlib.import_module(package).__path__
        except ImportError as exc:
            failed[package] = f"{type(exc).__name__}: {exc}"
            continue
        for info in pkgutil.iter_modules(path, package + "."):
            if info.ispkg:
                continue
            try:
                importlib.import_module(info.name)
            except Exception as exc:  # an optional backend's module: say so and go on
                failed[info.name] = f"{type(exc).__name__}: {exc}"
    return failed


def base_class() -> Union[type, str]:
    """memory_pool's KVCache, or why it cannot be had."""
    try:
        return getattr(importlib.import_module(MEMORY_POOL), BASE_CLASS)
    except (ImportError, AttributeError) as exc:
        return f"{MEMORY_POOL}.{BASE_CLASS} is not importable: {type(exc).__name__}: {exc}"


def coverage() -> Union[list[Union[Found, Skipped]], str]:
    """Every write method of the pool classes defined so far: Found, or Skipped with why."""
    base = base_class()
    return base if isinstance(base, str) else discover(base)


@dataclass(frozen=True)
class AllocatorMethod(Method):
    """One allocator method to wrap (where it is defined) and what it does."""

    original: Callable[..., Any]
    role: Union[Role, SwaRole]


def allocator_targets() -> Union[tuple[list[AllocatorMethod], list[str]], str]:
    """The methods of the tracked allocator classes, each where it is defined, and
    the names of the allocator classes that are not tracked; or why there are none."""
    try:
        base = getattr(importlib.import_module(ALLOCATOR_MODULE), ALLOCATOR_BASE)
    except (ImportError, AttributeError) as exc:
        return f"{ALLOCATOR_MODULE}.{ALLOCATOR_BASE} is not importable: {type(exc).__name__}: {exc}"
    classes = [cls for cls in pool_classes(base) if cls is not base]
    methods: dict[tuple[type, str], AllocatorMethod] = {}
    families: list[tuple[tuple[str, ...], dict[str, Any]]] = [
        (TRACKED_ALLOCATORS, ALLOCATOR_METHODS), (SWA_CHECKED, {name: spec.role for name, spec in SWA_METHODS.items()})]
    for names, roles in families:
        for cls in (cls for cls in classes if cls.__name__ in names):
            for name, role in roles.items():
                owner = next((c for c in cls.__mro__ if name in c.__dict__), None)
                if owner is None or (owner, name) in methods or name == "free_segment" and (
                        owner is base or role is Role.FREE_SEGMENT and hasattr(cls, "free_page_ids")):
                    continue  # the base's free_segment is free() (0.5.17-0.5.19), the paged one's free_page_ids
                original = owner.__dict__[name]
                original = getattr(original, "__wrapped__", original)
                if not by_design(original):  # e.g. the token allocator's alloc_extend: raises, hands out nothing
                    methods[owner, name] = AllocatorMethod(owner, name, original, role)
    known = TRACKED_ALLOCATORS + SWA_CHECKED + SWA_NAMED_ONLY
    return list(methods.values()), [cls.__name__ for cls in classes if cls.__name__ not in known]


def defining(cls: Optional[type], methods: tuple[str, ...]) -> tuple[Optional[type], str]:
    """(the class in `cls`'s bases that defines the first of `methods` it has, that name),
    or (None, "")."""
    for method in methods:
        for owner in getattr(cls, "__mro__", ()):
            if method in owner.__dict__:
                return owner, method
    return None, ""
