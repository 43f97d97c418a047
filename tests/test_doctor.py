"""`python -m sglang_oobguard doctor` on the installed sglang."""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import subprocess
import venv
from typing import Optional

import pytest
from importlib.metadata import version

import doctor_expected as written
from helpers import ROOT, SGLANG, has, run_python

DOCTOR = "import sys; from sglang_oobguard.__main__ import main; sys.exit(main(['doctor']))"
LATEST = SGLANG == written.RELEASE  # the release the written lists were read from (doctor_expected)
# On every release of the matrix: rows whose class and method exist there unchanged (survey, section 2).
EVERY_RELEASE_GUARDED = [("MHATokenToKVPool.set_kv_buffer", "in [0, size + page_size)"),
                         ("MLATokenToKVPool.set_kv_buffer", "in [0, size + page_size)"),
                         ("MLATokenToKVPool.set_mla_kv_buffer", "in [0, ")]


def test_doctor_lists_version_activation_mode_and_every_write_method(tmp_path):
    folder = tmp_path / "reports" / "new"
    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_REPORT_DIR": str(folder)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = proc.stdout
    assert out.startswith(f"sglang {version('sglang')} (supported;")
    assert "entry point sglang.srt.plugins:oobguard registered" in out and ".pth import hook" in out
    assert "mode: warn (active); backend: auto (the kernel on CUDA tensors (no sync); the host scan on CPU tensors, " \
           "and on NPU, XPU and MUSA tensors at one host sync per write); liveness: off (set SGLANG_OOBGUARD_LIVENESS=1" in out
    assert f"report files: {folder} (writable; summarise with: python -m sglang_oobguard report {folder})" in out
    assert "  TokenToKVPoolAllocator.alloc " in out and "  PagedTokenToKVPoolAllocator.alloc_extend " in out
    assert "liveness tracks these allocator families:\n  TokenToKVPoolAllocator, PagedTokenToKVPoolAllocator: " in out
    if has("SWATokenToKVPoolAllocator"):  # the SWA allocators' own module (0.5.16+)
        assert "liveness not tracked (bound check only): " in out and "UnifiedSWATokenToKVPoolAllocator" in out
        # the unified-memory SWA allocators (0.5.23): untracked, and doctor says why
        assert re.search(r"\n  [^\n]*UnifiedSWATokenToKVPoolAllocator[^\n]*: unified memory pool: its sub-allocators "
                         r"\(MultiEndedAllocator\) hand out virtual page ids", out), out
        assert "\n  SWATokenToKVPoolAllocator: both id spaces" in out and "  SWATokenToKVPoolAllocator.free_full " in out
    if has("DeepSeekV4SingleKVPool"):
        assert "DeepSeek-V4 composite pool" in out
    swa_pool = getattr(importlib.import_module("sglang.srt.mem_cache.swa_memory_pool"), "SWAKVPool", None) \
        if importlib.util.find_spec("sglang.srt.mem_cache.swa_memory_pool") else None
    if "set_index_k_scale_buffer" in vars(swa_pool or object):  # its ids passed on to a guarded write
        assert "SWAKVPool.set_index_k_scale_buffer" in out
    assert "  the read check, with liveness: every slot each request reads" in out
    assert "  slot history, with liveness: each report names the slot's last free and allocation" in out
    assert "  a layer's write with ids of its own (not the step's out_cache_loc)" in out
    sections = section_rows(out)
    listed = {title: {row.split()[0]: row.split(None, 1)[1] for row in sections[title]}
              for title in ("guarded", "not guarded", "left alone, writes nothing")}
    if LATEST:  # the written lists, row for row
        assert listed["guarded"] == dict(written.GUARDED)
        assert listed["not guarded"] == dict(written.NOT_GUARDED)
        assert listed["left alone, writes nothing"] == dict(written.LEFT_ALONE)
    for qualname, bound in EVERY_RELEASE_GUARDED:
        assert bound in listed["guarded"].get(qualname, ""), (qualname, listed["guarded"].get(qualname))
    assert "KVCache.set_kv_buffer" in listed["left alone, writes nothing"]  # abstract: raises
    for row in listed["guarded"].values():  # each id parameter: label: ids in [0, bound)
        assert re.fullmatch(r"[^:;]+: \w+ in \[0, [^;]+\)(, valid prefix of each row)?"
                            r"(; [^:;]+: \w+ in \[0, [^;]+\))?", row), row
    counts = {title: len(rows) for title, rows in listed.items()}
    assert f"guarded ({counts['guarded']} methods, of the pool classes of every pool module" in out
    assert f"not guarded ({counts['not guarded']} methods):" in out or counts["not guarded"] == 0
    # the KV transfer check: each hook found (or named absent), as the installed sglang has it
    for module, owner, method in written.TRANSFER_HOOKS:
        here = _defines(module, owner, method)
        state = "not importable here" if here is None else f"found in {module}" if here else "ABSENT"
        if LATEST:
            assert state == f"found in {module}", method
        # 0.4.x: doctor's fresh interpreter may not import what this one (with the tests' shims) does
        assert any(f"{owner}.{method}" in line and (state in line or "not importable here" in line and
                                                    SGLANG.startswith("0.4.")) for line in sections["checks"]), method
    assert "the transfer engine's RDMA write itself is not observable" in out
    assert "the fake backend (and any with the deferred release off) gives no drain signal" in out
    for module, owner, method, what in written.HICACHE_COPIES:  # the HiCache check: each host pool's load and backup
        here = _defines(module, owner, method)
        assert not LATEST or here, method
        assert any(f"{owner}.{method}" in line and what in line and (f"found in {module}" if here else "ABSENT") in line
                   for line in sections["checks"]), method
    for module, owner, method in written.HICACHE_LOADS:  # the holder check: what each load is for
        here = _defines(module, owner, method)
        assert not LATEST or here, method
        assert any(f"{owner}.{method}" in line and (f"found in {module}" if here else "ABSENT") in line
                   for line in sections["checks"]), method
    assert "KV transfers (PD disaggregation, sglang 0.5.21+" in out and "HiCache (sglang 0.5.16+" in out


def _defines(module: str, owner: str, method: str) -> Optional[bool]:
    """Whether the installed sglang's `module` defines `owner.method` (None: it does not import here)."""
    from pathlib import Path

    base = Path(importlib.util.find_spec("sglang").submodule_search_locations[0], *module.split(".")[1:])
    if not (base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()):
        return False
    try:
        return method in vars(getattr(importlib.import_module(module), owner, object))
    except Exception:
        return None

def section_rows(out: str) -> dict[str, list[str]]:
    """The doctor's sections ("title (N methods):" or "title: none") and their rows,
    checking that each header's count is its number of rows."""
    sections: dict[str, list[str]] = {}
    title = ""
    for line in out.splitlines():
        if line.startswith("  "):
            sections[title].append(line)
        else:
            title = re.split(r" \(|:", line)[0]
            sections[title] = []
            count = re.match(r"[^(]+\((\d+) ", line)
            if count and title != "sglang":
                sections[title + " count"] = [count.group(1)]
    for name in [n for n in sections if n.endswith(" count")]:
        assert int(sections.pop(name)[0]) == len(sections[name[:-len(" count")]]), name
    return sections


def test_doctor_prints_nothing_but_its_report(tmp_path):
    """sglang's import-time warnings ("Only CUDA, HIP and XPU support AWQ currently")
    and log lines stay out of it."""
    (tmp_path / "a-file").write_text("")
    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_REPORT_DIR": str(tmp_path / "a-file" / "reports")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "reports (NOT writable: the guard would warn once and go on;" in proc.stdout
    assert proc.stderr == ""
    assert "AWQ" not in proc.stdout and "Warning" not in proc.stdout


def test_doctor_without_torch_says_so_in_one_line(tmp_path):
    """A python that has no torch (a bare venv, the package on PYTHONPATH): one line
    naming what is missing, no traceback."""
    venv.create(tmp_path / "bare", with_pip=False)
    python = tmp_path / "bare" / "bin" / "python"
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(python), "-m", "sglang_oobguard", "doctor"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr == "" and len(proc.stdout.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith(f"sglang_oobguard doctor: torch is not installed for {python}")


def test_doctor_exits_non_zero_on_an_invalid_configuration():
    proc = run_python(DOCTOR, {"SGLANG_ENABLE_ASYNC_ASSERT": "maybe"})
    assert proc.returncode == 2
    assert "invalid SGLANG_ENABLE_ASYNC_ASSERT='maybe'" in proc.stdout


@pytest.mark.parametrize("variable", ["SGLANG_OOBGUARD_LIVENESS", "SGLANG_OOBGUARD_FINITE"])
def test_doctor_exits_non_zero_when_a_deeper_check_is_asked_for_with_the_guard_off(variable):
    proc = run_python(DOCTOR, {variable: "1"})
    assert proc.returncode == 2
    assert f"invalid {variable}='1'" in proc.stdout and "SGLANG_ENABLE_ASYNC_ASSERT=1" in proc.stdout


def test_doctor_says_whether_the_value_check_is_on_and_which_writers_values_it_cannot_see():
    off = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn"})
    on = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_FINITE": "1"})
    assert off.returncode == on.returncode == 0, off.stderr[-2000:] + on.stderr[-2000:]
    assert "\nfinite values: off (set SGLANG_OOBGUARD_FINITE=1 to check it); " in off.stdout
    line = next(row for row in on.stdout.splitlines() if row.startswith("finite values: on; "))
    assert all(f"{function} ({why})" in line for function, why in written.UNSEEN.items()), line
    rows = {row.split()[0]: row.split(None, 1)[1] for row in on.stdout.split("fused writers (", 1)[1].split("\n")[1:]
            if row.startswith("  ") and row.split()[0] in written.FUSED_WRITERS}
    assert set(rows) == set(written.FUSED_WRITERS)  # every writer has its row, on every release
    for writer, row in rows.items():
        if LATEST:  # written out: bound, where found, the values read (its parameters in 0.5.23's signature)
            assert row == written.FUSED_WRITERS[writer], row
        elif ": found in " in row:  # the values a writer's row names are parameters of the writer as this release
            values = row.rsplit("; values: ", 1)[1]  # defines it (an absent or unimportable one's: the table's)
            names = _parameters(writer, row)
            assert values == "NOT seen" or names is not None and all(v in names for v in values.split(", ")), row
    assert rows["fused_fp8_set_kv_buffer"].endswith("; values: NOT seen")  # unread, on every release


def _parameters(writer: str, row: str) -> Optional[list[str]]:
    """The writer's parameters in the module its doctor row found it in, else None."""
    found = re.search(r": found in (\S+);", row)
    if found is None:
        return None
    function = getattr(importlib.import_module(found.group(1)), writer)
    return list(inspect.signature(function).parameters)


# A sitecustomize for a fresh interpreter: the import of sglang's memory_pool raises
# {exc} (as a missing sgl_kernel, or transformers 5.x under sglang 0.5.5, does), while
# torch and the rest of sglang import as usual.
FAILING_POOLS = """
import sys

class _Fail:
    def find_spec(self, name, path=None, target=None):
        if name in {modules}:
            raise {exc}
        return None

sys.meta_path.insert(0, _Fail())
"""


def _doctor_with_pools_failing(tmp_path, exc: str, modules: tuple[str, ...] = ("sglang.srt.mem_cache.memory_pool",),
                               **env: str) -> subprocess.CompletedProcess:
    (tmp_path / "sitecustomize.py").write_text(FAILING_POOLS.format(exc=exc, modules=modules))
    path = os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")]))
    return run_python(DOCTOR, {"PYTHONPATH": path, **env})


def test_doctor_says_a_check_is_unknown_where_its_modules_do_not_import(tmp_path):
    """A unit's modules that exist but do not import here (0.4.x's PD modules under a newer torch,
    before its shim): doctor cannot read whether the check would run, and says so instead of
    promising it, or of reading an absent method from a class it could not import."""
    from sglang_oobguard.model.transfertargets import TRANSFER_MODULES

    proc = _doctor_with_pools_failing(tmp_path, 'RuntimeError("no AMX probe")', TRANSFER_MODULES,
                                      SGLANG_OOBGUARD_MODE="warn", SGLANG_OOBGUARD_LIVENESS="1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"  pd: unknown here ({TRANSFER_MODULES[0]} is not importable here (RuntimeError: no AMX probe)) - " \
        in proc.stdout, proc.stdout


def test_doctor_exits_non_zero_in_one_line_when_a_module_the_pools_need_is_missing(tmp_path):
    proc = _doctor_with_pools_failing(tmp_path, 'ModuleNotFoundError("No module named \'sgl_kernel\'", name="sgl_kernel")')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "" and len(proc.stdout.splitlines()) == 1, proc.stdout + proc.stderr
    assert proc.stdout.startswith("sglang_oobguard doctor: sglang's pools do not import here, nothing can be guarded "
                                  "(sglang.srt.mem_cache.memory_pool: ModuleNotFoundError: No module named "
                                  "'sgl_kernel'); install sgl_kernel into the python that runs sglang"), proc.stdout
    assert "guarded" not in proc.stdout.replace("nothing can be guarded", "")


def test_doctor_exits_non_zero_without_a_traceback_when_the_pools_import_raises_anything_else(tmp_path):
    """sglang 0.5.5 under transformers 5.x: a TypeError in sglang's janus_pro config."""
    proc = _doctor_with_pools_failing(tmp_path, 'TypeError("unhashable type: \'dict\'\\nsecond line")')
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr == "" and "Traceback" not in proc.stdout, proc.stdout + proc.stderr
    assert proc.stdout.splitlines() == [
        "sglang_oobguard doctor: sglang's pools do not import here, nothing can be guarded "
        "(sglang.srt.mem_cache.memory_pool: TypeError: unhashable type: 'dict'); a dependency of sglang is missing "
        "or of a version this sglang does not work with: install the versions this sglang release requires "
        "(pip show sglang; its Requires-Dist)"]


def test_doctor_lists_every_check_with_its_state():
    """One line per check, its state written out here by hand for this configuration (the write
    map's checks run on 0.5.23, the release it was measured on, and on the older releases measured
    with the engine (0.5.12, ...) but for their speculative and PD decode forwards, which the map's, owners', reads', ownids'
    and positions' lines name)."""
    from sglang_oobguard.model.maptargets import WRITE_MAP_MEASURED
    from sglang_oobguard.model.targets import write_map_off

    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_LIVENESS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("checks (each counts its work"))
    end = next(i for i, line in enumerate(lines) if i > start and not line.startswith("  "))
    states = [line.split(" - ")[0].strip() for line in lines[start + 1:end] if not line.startswith("    ")]
    older = SGLANG in WRITE_MAP_MEASURED  # an older release measured in the engine (0.5.12, ...)
    mapped = "on" if SGLANG == "0.5.23" or older else f"off ({write_map_off()})"
    unmeasured = ("speculative decoding's forwards (EAGLE, NGRAM: draft, verify and the target's own): not measured "
                  f"on sglang {SGLANG}", f"PD disaggregation's decode side: not measured on sglang {SGLANG}")
    for what in unmeasured:  # under the map's, the owners', the reads', the ownids' and the positions' lines
        said = [line for line in lines if what.split(":")[0] in line and f"not measured on sglang {SGLANG}" in line]
        assert len(said) == (5 if older else 0), said
    if older:
        assert f"      {unmeasured[0]}: bounds and liveness only" in lines, proc.stdout
    decode = "sglang.srt.disaggregation.decode"
    pd = "with liveness, where sglang runs PD disaggregation" if has("DecodePreallocQueue._send_kv_metadata") else \
        "off (this sglang has no DecodePreallocQueue._send_kv_metadata or SchedulerDisaggregationPrefillMixin." \
        "_send_kv_chunk (sglang 0.5.21+))" if run_python(f"import {decode}", {}).returncode == 0 else \
        f"unknown here ({decode} is not importable here"  # (0.4.x under torch 2.14, unshimmed): the rest is the error
    states = [f"pd: {pd}" if pd.startswith("unknown") and state.startswith(f"pd: {pd} (") else state for state in states]
    leaks = "off (this sglang has no release_kv_cache (sglang 0.5.10+))"
    hicache = "with liveness, where sglang runs HiCache" if has("MHATokenToKVPoolHost.load_to_device_per_layer") else \
        "off (this sglang has no MHATokenToKVPoolHost.load_to_device_per_layer or MLATokenToKVPoolHost." \
        "load_to_device_per_layer (sglang 0.5.16+))"
    assert states == ["bounds: on", f"map: {mapped}", f"owners: {mapped}", "liveness: on", "history: on",
                      f"reads: {mapped}", f"ownids: {mapped}", f"positions: {mapped}", "finite: off (set SGLANG_OOBGUARD_FINITE=1)",
                      "swa: with liveness, where sglang runs sliding-window models", f"pd: {pd}",
                      f"hicache: {hicache}", "rows: on", f"leaks: {'on' if has('release_kv_cache') else leaks}"], \
        states


def test_doctor_says_which_checks_the_switch_turned_off_and_help_lists_every_switch():
    proc = run_python(DOCTOR, {"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_LIVENESS": "1",
                               "SGLANG_OOBGUARD_CHECKS": "-reads,-pd"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "  reads: off (SGLANG_OOBGUARD_CHECKS) - a running request reads a slot given back" in proc.stdout
    assert "  pd: off (SGLANG_OOBGUARD_CHECKS) - PD disaggregation: " in proc.stdout
    assert "  liveness: on - " in proc.stdout
    import contextlib
    import io

    from sglang_oobguard.__main__ import main
    from sglang_oobguard.model.switches import NAMES

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["help"]) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("SGLANG_OOBGUARD_CHECKS: which checks run")
    assert [line.split()[0] for line in lines[1:]] == list(NAMES)
    assert any(line.startswith("  reads     default: on with SGLANG_OOBGUARD_LIVENESS=1 (needs liveness, map, owners, "
                               "history) - ") for line in lines)
