"""The `.pth` import hook (for sglang releases without a plugin loader), exercised the
way Python runs it: `site.addsitedir` on a directory holding the shipped file, in a
fresh interpreter. The editable install of the test venv does not place .pth files,
so the wheel's contents are checked separately."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile

import pytest

from helpers import ROOT, SHIM, run_python

PTH = ROOT / "sglang_oobguard.pth"

REPORT = """
import json, site, sys
site.addsitedir({site_dir!r})
armed = "sglang_oobguard.autoload" in sys.modules
loaded = sorted(m for m in sys.modules if m.startswith("sglang_oobguard"))
wrapped = None
if {import_pool}:
    from sglang.srt.mem_cache import memory_pool as mp
    wrapped = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]
    if {load_plugins}:
        from sglang.srt.plugins import load_plugins
        load_plugins()
    fn = mp.MHATokenToKVPool.__dict__["set_kv_buffer"]
    wrapped = {{"once": hasattr(fn, "__wrapped__") and not hasattr(fn.__wrapped__, "__wrapped__"),
               "same": fn is wrapped}}
print(json.dumps({{"armed": armed, "loaded": loaded, "wrapped": wrapped}}))
"""


@pytest.fixture
def site_dir(tmp_path):
    shutil.copy(PTH, tmp_path / PTH.name)
    return str(tmp_path)


def report(site_dir, env, import_pool=True, load_plugins=False):
    code = REPORT.format(site_dir=site_dir, import_pool=import_pool, load_plugins=load_plugins)
    proc = run_python(code, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def test_its_triggers_are_the_entry_points():
    from sglang_oobguard.plugin import TRIGGERS

    line = PTH.read_text().strip()
    assert len(PTH.read_text().splitlines()) == 1 and line.startswith("import os;")
    assert [part.split('"')[1] for part in line.split("os.environ.get(")[1:]] == list(TRIGGERS)


def test_off_it_imports_nothing(site_dir):
    got, _ = report(site_dir, {}, import_pool=False)
    assert got == {"armed": False, "loaded": [], "wrapped": None}


def test_on_it_patches_memory_pool_at_first_import_without_the_loader(site_dir):
    got, stderr = report(site_dir, {"SGLANG_ENABLE_ASYNC_ASSERT": "1"})
    assert got["armed"] and got["wrapped"] == {"once": True, "same": True}
    assert stderr.count("sglang_oobguard active") == 1


def test_with_the_entry_point_too_it_installs_exactly_once(site_dir):
    if importlib.util.find_spec("sglang.srt.plugins") is None:
        pytest.skip("sglang's plugin loader arrived in 0.5.11")
    got, stderr = report(site_dir, {"SGLANG_OOBGUARD_MODE": "warn"}, load_plugins=True)
    assert got["wrapped"] == {"once": True, "same": True}
    assert stderr.count("sglang_oobguard active") == 1


def test_an_invalid_value_never_breaks_sglangs_import(site_dir):
    got, stderr = report(site_dir, {"SGLANG_OOBGUARD_MODE": "loud"})
    assert got["armed"] and got["wrapped"] == {"once": False, "same": True}
    assert "sglang_oobguard: invalid SGLANG_OOBGUARD_MODE='loud'" in stderr


def test_the_wheel_ships_it_at_the_root_with_the_license_and_both_entry_points(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path), str(ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("sglang_oobguard-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert archive.read("sglang_oobguard.pth").decode() == PTH.read_text()
        shipped = set(archive.namelist())
        assert "sglang_oobguard/autoload.py" in shipped
        # every module of every layer ships: the wheel is the package, not only its root
        package = ROOT / "sglang_oobguard"
        assert {f"sglang_oobguard/{p.relative_to(package).as_posix()}" for p in package.rglob("*.py")} <= shipped
        info = next(name.split("/")[0] for name in archive.namelist() if name.endswith(".dist-info/METADATA"))
        assert archive.read(f"{info}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()
        metadata = archive.read(f"{info}/METADATA").decode()
        assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata
        entry_points = archive.read(f"{info}/entry_points.txt").decode()
        assert "[sglang.srt.plugins]\noobguard = sglang_oobguard.plugin:load" in entry_points
        assert "[pytest11]\noobguard = sglang_oobguard.pytest_plugin" in entry_points
    assert (ROOT / "LICENSE").read_text().split()[:4] == ["Apache", "License", "Version", "2.0,"]


LATE = """
import json, site
site.addsitedir({site_dir!r})
from sglang.srt.mem_cache import memory_pool  # the hook installs here
from sglang_oobguard.model.discover import Found, import_pool_modules
from sglang_oobguard.model.discover import coverage
import_pool_modules()  # pool modules sglang loads later: SWA, DSA layer-split, HiSparse, ...
found = [e for e in coverage() if isinstance(e, Found)]
once = [e.qualname for e in found if hasattr(e.owner.__dict__[e.method], "__wrapped__")
        and not hasattr(e.owner.__dict__[e.method].__wrapped__, "__wrapped__")]
print(json.dumps({{"found": len(found), "modules": len({{e.owner.__module__ for e in found}}), "once": len(once)}}))
"""


def test_pool_classes_defined_after_the_hook_are_guarded_once(site_dir):
    proc = run_python(LATE.format(site_dir=site_dir), {"SGLANG_ENABLE_ASYNC_ASSERT": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["found"] >= 3 and got["once"] == got["found"]
    if importlib.util.find_spec("sglang.srt.mem_cache.swa_memory_pool"):  # 0.5.8+: pools beyond memory_pool
        assert got["modules"] > 1


WHEEL_INSTALL = SHIM.replace("{", "{{").replace("}", "}}") + """
import json, site, sys
sys.path.insert(0, {target!r})  # the wheel's package first, before the editable one
site.addsitedir({target!r})  # runs its sglang_oobguard.pth, as at a regular install's interpreter start
import torch
import sglang_oobguard
sglang_oobguard.install()  # imports memory_pool, which fires the .pth hook's own install first
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

class Layer:
    layer_id = 1

pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu", False)
k = torch.ones(2, 2, 4)
pool.set_kv_buffer(Layer, torch.tensor([3, -1]), k, k)
fn = MHATokenToKVPool.__dict__["set_kv_buffer"]
print(json.dumps({{"file": sglang_oobguard.__file__, "violations": [str(v) for v in sglang_oobguard.violations()],
                  "once": hasattr(fn, "__wrapped__") and not hasattr(fn.__wrapped__, "__wrapped__")}}))
"""


def test_a_regular_install_from_the_wheel_installs_once_through_either_door(tmp_path):
    """The suite's editable install places no .pth hook, so this builds the wheel and
    installs it as pip would: install() imports memory_pool, that import fires the
    hook, and the hook's install and the call's are one instrumentor: one activation
    line, each method wrapped once, and violations() holds the report."""
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("sglang_oobguard-*.whl")
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True)
    assert (target / "sglang_oobguard.pth").exists()
    proc = run_python(WHEEL_INSTALL.format(target=str(target)), {"SGLANG_OOBGUARD_MODE": "warn"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["file"].startswith(str(target))
    assert proc.stderr.count("sglang_oobguard active") == 1, proc.stderr[-3000:]
    assert got["once"]
    assert got["violations"] == ["set_kv_buffer (MHA) layer 1: 1 of 2 slot ids outside [0, 65): loc[1] = -1"]
