"""TEST-ONLY stand-in for `sgl_kernel`, sglang's compiled CUDA kernel package.

No sgl_kernel wheel runs on a CPU (the PyPI builds need libcuda.so.1), yet sglang
imports names from it at load time. This package lets those imports succeed on the
CPU test machines; every name is a callable that raises NotImplementedError when
called, so a code path that really needs a CUDA kernel fails loudly instead of being
faked. It is put on PYTHONPATH for the engine test subprocesses only, never installed.
"""

from __future__ import annotations

import sys
import types
from importlib.machinery import ModuleSpec

__version__ = "0.0.0+cpu-test-standin"


class _Missing:
    """A kernel that does not exist here: importable, raises when used."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name} is a test-only stand-in: the real sgl_kernel has no CPU build")

    def __getattr__(self, attr: str) -> "_Missing":
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Missing(f"{self._name}.{attr}")


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Missing(f"sgl_kernel.{name}")


class _Submodule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Missing(f"{self.__name__}.{name}")


class _Finder:
    """Makes `sgl_kernel.<anything>` importable as a stand-in submodule."""

    @staticmethod
    def find_spec(fullname, path=None, target=None):
        if fullname.startswith("sgl_kernel."):
            return ModuleSpec(fullname, _Loader(), is_package=True)
        return None


class _Loader:
    @staticmethod
    def create_module(spec):
        module = _Submodule(spec.name)
        module.__path__ = []
        return module

    @staticmethod
    def exec_module(module):
        return None


sys.meta_path.append(_Finder())
