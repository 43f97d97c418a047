"""Test support: every process of a test engine (the spawned scheduler and detokenizer
too) starts as it does where the guard is installed as a regular package, its
`sglang_oobguard.pth` in a site folder. The test venvs install the guard editable, which
places no `.pth`; Python runs this module at each start when its folder is on PYTHONPATH
(`harness.engine_env(site=True)`), and it adds the repository root, which holds the very
file the wheel ships (tests/test_pth.py), as a site folder: the hook arms as in a user's
install. On releases without sglang's plugin loader (before 0.5.11) the fault injector, a
sglang plugin, is loaded here as the loader would (OOBGUARD_FAULT_PLUGIN=1). A stand-in
folder's own sitecustomize later on the path (tests/standins/releases-0.4) runs first."""

import importlib.machinery
import importlib.util
import os
import site
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_next = importlib.machinery.PathFinder.find_spec(
    "sitecustomize", [entry for entry in sys.path if os.path.abspath(entry or ".") != _here])
if _next is not None and _next.loader is not None:  # first: a torch shim must precede any sglang import
    _next.loader.exec_module(importlib.util.module_from_spec(_next))
if os.environ.get("OOBGUARD_SITE_DIR"):
    site.addsitedir(os.environ["OOBGUARD_SITE_DIR"])
if os.environ.get("OOBGUARD_FAULT_PLUGIN"):
    import oobguard_faultinject

    oobguard_faultinject.load()
