"""Activation through sglang's own loader (`sglang.srt.plugins.load_plugins`), each
case in a fresh interpreter with exactly the environment under test."""

from __future__ import annotations

import re

import importlib.util
import json

import pytest

from helpers import run_python

if importlib.util.find_spec("sglang.srt.plugins") is None:
    pytest.skip("sglang's plugin loader arrived in 0.5.11 (the .pth hook serves older releases)",
                allow_module_level=True)

LOAD_AND_REPORT = """
import json, sys
from sglang.srt.plugins import load_plugins
load_plugins()
from sglang.srt.mem_cache import memory_pool as mp
fn = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]
import sglang_oobguard.activate.instrument as p
print(json.dumps({"wrapped": hasattr(fn, "__wrapped__"),
                  "mode": p._active.guard.config.mode.value if p._active else None}))
"""


def loaded(env: dict[str, str]):
    proc = run_python(LOAD_AND_REPORT, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_entry_point_is_registered():
    proc = run_python("from importlib.metadata import entry_points as e;"
                      "print([x.value for x in e(group='sglang.srt.plugins') if x.name == 'oobguard'])", {})
    assert proc.stdout.strip() == "['sglang_oobguard.plugin:load']"


def test_off_imports_nothing_and_patches_nothing():
    proc = run_python("import sys; before = set(sys.modules)\n"
                      "from sglang_oobguard.plugin import load; load()\n"
                      "print(sorted(m for m in set(sys.modules) - before if not m.startswith('_')))", {})
    new = eval(proc.stdout.strip())
    ours = [m for m in new if m.startswith("sglang_oobguard")]
    assert ours == ["sglang_oobguard", "sglang_oobguard.plugin"]
    assert not [m for m in new if m.split(".")[0] in ("torch", "triton", "sglang", "wrapt", "numpy")]


def test_the_entry_points_triggers_are_configs_activating_variables():
    from sglang_oobguard.model import config
    from sglang_oobguard import plugin

    assert plugin.TRIGGERS == (config.ENABLE_VAR, config.INVARIANT_VAR, config.MODE_VAR, config.LIVENESS_VAR,
                               config.FINITE_VAR, config.CHECKS_VAR)


@pytest.mark.parametrize(
    "env,mode",
    [
        ({}, None),
        ({"SGLANG_ENABLE_ASYNC_ASSERT": "0"}, None),
        ({"SGLANG_ENABLE_ASYNC_ASSERT": "Yes"}, "strict"),
        ({"SGLANG_INVARIANT_CHECK": "1"}, "warn"),
        ({"SGLANG_OOBGUARD_MODE": "raise"}, "raise"),
        ({"SGLANG_OOBGUARD_MODE": "off", "SGLANG_ENABLE_ASYNC_ASSERT": "1"}, None),
    ],
)
def test_activation_through_load_plugins(env, mode):
    state, stderr = loaded(env)
    assert state == {"wrapped": mode is not None, "mode": mode}
    active = [line for line in stderr.splitlines() if "sglang_oobguard active" in line]
    if mode:
        assert len(active) == 1
        from importlib.metadata import version

        assert re.search(rf"mode={mode}, backend=auto \(the kernel on CUDA tensors .* one host sync per write\), "
                         rf"[1-9][0-9]* guarded methods \(of the pool classes defined so far\), sglang {version('sglang')}",
                         active[0]), active[0]
    else:
        assert not active


def test_sglang_plugins_whitelist_can_leave_it_out():
    state, _ = loaded({"SGLANG_ENABLE_ASYNC_ASSERT": "1", "SGLANG_PLUGINS": "someone_else"})
    assert state == {"wrapped": False, "mode": None}


def test_invalid_value_is_loud_first_and_never_guards_in_silence():
    state, stderr = loaded({"SGLANG_ENABLE_ASYNC_ASSERT": "on"})
    assert state == {"wrapped": False, "mode": None}
    lines = [line for line in stderr.splitlines() if "oobguard" in line]
    assert lines[0].startswith("sglang_oobguard: invalid SGLANG_ENABLE_ASYNC_ASSERT='on'")
    assert "accepted: true/1/yes/y" in lines[0] and "NOT active" in lines[0]
    assert "Failed to execute general plugin: oobguard" in stderr  # sglang's own traceback follows
