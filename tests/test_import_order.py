"""Installation that does not depend on import order (issue #43): sglang's engine imports
its modules in its own order, and the module whose import installs the guard (memory_pool,
for the `.pth` hook) often finishes while the modules that imported it are half run. Each
order the engine's processes use, in a fresh interpreter, the guard installed as a user's
regular install installs it (the `.pth` hook; on 0.5.11+ sglang's plugin loader too, after
the imports, as its processes run it): liveness's allocators and the step hook are wrapped,
the scheduler's idle hook too, no hook is named unguarded, and a real double free is caught.
The hooks' own mechanism, on modules made here: tests/test_onimport.py."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, SHIM, run_python
from sglang_oobguard.model.targets import ALLOCATOR_MODULE, IDLE_HOOK, STEP_HOOK

FIRST = {"allocator": ALLOCATOR_MODULE, "scheduler": IDLE_HOOK.module, "model runner": STEP_HOOK.module}

ORDER = SHIM + """
import importlib, importlib.util, json, site
site.addsitedir({root!r})  # sglang_oobguard.pth, as a regular install places it: armed for memory_pool's first import
skipped = {{}}
for name in {order!r}:
    try:
        importlib.import_module(name)
    except (ImportError, AssertionError) as exc:  # sglang's own, outside the guard: see helpers.FACTS["ModelRunner"]
        skipped[name] = f"{{type(exc).__name__}}: {{exc}}"
if importlib.util.find_spec("sglang.srt.plugins"):  # 0.5.11+: each sglang process runs its plugin loader too
    from sglang.srt.plugins import load_plugins
    load_plugins()
import torch
import sglang_oobguard
from helpers import token_allocator
from sglang.srt.mem_cache import allocator as allocators
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang_oobguard.activate import instrument
from sglang_oobguard.model.discover import AllocatorMethod

hooks = instrument._active.hooks
made = [(getattr(p.owner, "__name__", ""), p.name) for p in instrument._active.patches.made]
allocator = token_allocator(allocators, MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu", False))
ids = allocator.alloc(2)
allocator.free(ids)
allocator.free(ids)  # a double free
print("RESULT " + json.dumps({{
    "skipped": skipped, "step": ({step!r}, {method!r}) in made, "idle": any(name in {idle!r} for _, name in made),
    "allocators": sorted(e.qualname for e in instrument._active.patches.entries if isinstance(e, AllocatorMethod)),
    "unguarded": hooks.unguarded, "violations": [str(v) for v in sglang_oobguard.violations()]}}))
"""


def run_order(first: str) -> tuple[dict, str]:
    order = [first, *(name for name in FIRST.values() if name != first)]
    code = ORDER.format(root=str(ROOT), order=order, step=STEP_HOOK.owner, method=STEP_HOOK.method,
                        idle=IDLE_HOOK.methods)
    # no Triton interpreter (the suite's, for sglang's MLA writes): 0.5.3 - 0.5.4's model_runner refuses it
    proc = run_python(code, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_LIVENESS": "1",
                             "SGLANG_OOBGUARD_WARN_INTERVAL_S": "3600", "TRITON_INTERPRET": None})
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), proc.stderr


@pytest.mark.parametrize("first", list(FIRST))
def test_every_hook_installs_whichever_module_the_engine_imports_first(first):
    got, stderr = run_order(FIRST[first])
    if FIRST[first] in got["skipped"]:
        pytest.skip(f"{FIRST[first]} does not import here: {got['skipped'][FIRST[first]]}")
    assert stderr.count("sglang_oobguard active") == 1, stderr[-4000:]
    assert got["unguarded"] == [] and "NOT GUARDED" not in stderr, stderr[-4000:]
    assert "TokenToKVPoolAllocator.free" in got["allocators"] and "TokenToKVPoolAllocator.alloc" in got["allocators"]
    assert any("(double free)" in text for text in got["violations"]), got
    if STEP_HOOK.module not in got["skipped"]:
        assert got["step"], stderr[-4000:]
    if IDLE_HOOK.module not in got["skipped"]:
        assert got["idle"], stderr[-4000:]
