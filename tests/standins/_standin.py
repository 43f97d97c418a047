"""TEST-ONLY machinery for stand-ins of compiled packages that have no CPU build.

`stand_in(package)` makes `package` and every `package.<sub>` importable; every name
in them is a callable that raises NotImplementedError when called, so a code path
that really needs the compiled kernels fails loudly instead of being faked. This
directory is put on PYTHONPATH for test processes only, never installed.
"""

from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec


class _Missing:
    """A kernel that does not exist here: importable, raises when used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a test-only stand-in: the real package has no CPU build")

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def not_implemented(op: str, what: str) -> NotImplementedError:
    """The error of a working stand-in asked for a mode it does not implement."""
    return NotImplementedError(f"{op} (a test-only stand-in) does not implement {what}")


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> _Missing:
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Finder:
    """Makes `<package>.<anything>` importable as a stand-in submodule."""

    def __init__(self, package: str) -> None:
        self.prefix = package + "."

    def find_spec(self, fullname, path=None, target=None):
        if fullname.startswith(self.prefix):
            return ModuleSpec(fullname, _Loader(), is_package=True)
        return None


class _Loader:
    @staticmethod
    def create_module(spec):
        module = _Module(spec.name)
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module):
        return None


def missing_names(module: str) -> None:
    """Every name the module being imported does not define becomes a _Missing."""
    sys.modules[module].__class__ = _Module


def stand_in(package: str) -> None:
    """Turn the package being imported into a stand-in (call from its __init__)."""
    missing_names(package)
    sys.meta_path.append(_Finder(package))
