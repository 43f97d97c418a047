"""Measurement only, never on a user's path: the write map's reach-back (issue #43,
docs/checks.md, "Where the write map runs"). Put first on PYTHONPATH, in the test process and
through it in every engine process, it opens the write map's checks (map, owners, reads,
ownids, positions) on the installed sglang as if that release had been measured
(`maptargets.WRITE_MAP_MEASURED`, its speculative and PD decode forwards still left out), so
that the clean matrix's runs show whether the release's step layouts hold there. It also runs
Triton's kernels in its interpreter: sglang's CPU engine calls alloc_extend's Triton kernel at
page size > 1 before 0.5.22. Then it runs the next sitecustomize on the path (the 0.4.x torch
shim), as tests/e2e/siteinstall does, looking only further down the path."""

import importlib.machinery
import importlib.util
import os
import sys
from importlib.metadata import version

_here = os.path.dirname(os.path.abspath(__file__))
os.environ["TRITON_INTERPRET"] = "1"
_paths = [os.path.abspath(entry or ".") for entry in sys.path]
_next = importlib.machinery.PathFinder.find_spec(  # only the folders after this one: no loop with siteinstall's
    "sitecustomize", sys.path[_paths.index(_here) + 1:] if _here in _paths else [])
if _next is not None and _next.loader is not None:
    _next.loader.exec_module(importlib.util.module_from_spec(_next))

from sglang_oobguard.model import maptargets  # noqa: E402  (standard library only: imports no sglang)

maptargets.WRITE_MAP_MEASURED.setdefault(version("sglang"), (maptargets.SPECULATIVE, maptargets.PD_DECODE))
