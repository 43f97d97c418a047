"""The pytest plugin, loaded by pytest from its `pytest11` entry point in a pytest
run of its own (pytester, in a subprocess): inert without `--oobguard`; with it,
every process the tests start is guarded and reports to the folder, and the run
fails on a violation anywhere or when nothing was guarded."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest

from helpers import SGLANG, SHIM

# Inner test files: a server-like subprocess writes a real sglang pool; WRITE_HERE
# writes one in the pytest process itself.
HEADER = SHIM + """
import subprocess
from helpers import GUARDED_WRITE


def start(ids):
    proc = subprocess.run([sys.executable, "-c", GUARDED_WRITE.format(ids=ids)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
"""
SUBPROCESS = HEADER + """
def test_a_subprocess_writes(): start({ids})
"""
WRITE_HERE = """
def test_this_process_writes():
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    class Layer:
        layer_id = 2

    pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 3, "cpu", False)  # 3 layers
    pool.set_kv_buffer(Layer, torch.tensor([7, 65]), torch.ones(2, 2, 4), torch.ones(2, 2, 4))
    assert pool.k_buffer[2][64].abs().sum() == 0  # contained: row 64 untouched
"""


def run(pytester, *args: str):
    return pytester.runpytest_subprocess(*args, timeout=600)


def reports(folder) -> dict[int, list[dict]]:
    return {int(p.stem.rsplit("-", 1)[1]): [json.loads(line) for line in p.read_text().splitlines()]
            for p in folder.iterdir()}


def test_warn_guards_subprocesses_and_this_process_and_fails_the_run(pytester, tmp_path):
    folder = tmp_path / "oobguard-report"
    pytester.makepyfile(SUBPROCESS.format(ids=[5, -1]) + WRITE_HERE)
    result = run(pytester, "--oobguard=warn", f"--oobguard-report-dir={folder}")
    result.assert_outcomes(passed=2)  # warn serves every write, yet the run fails
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    out = result.stdout.str()
    assert f"sglang_oobguard report {folder}: 2 processes guarded, 2 with violations" in out
    assert "set_kv_buffer (MHA) | MHATokenToKVPool | layer 1: 1 report in 1 process; first " in out
    assert "set_kv_buffer (MHA) | MHATokenToKVPool | layer 2: 1 report in 1 process; first " in out
    assert "loc[1] = 65 (pool MHATokenToKVPool)" in out and "FAIL: KV-cache violations reported" in out
    got = reports(folder)
    assert len(got) == 2 and all(lines[0]["mode"] == "warn" and lines[0]["host"] == socket.gethostname()
                                 for lines in got.values())
    here = [lines for lines in got.values() if "pytest" in lines[0]["argv"]]
    assert len(here) == 1 and here[0][1]["violation"]["layer"] == 2  # installed in the pytest process too


def test_strict_by_default_a_clean_run_passes_and_names_its_temporary_folder(pytester):
    pytester.makepyfile(SUBPROCESS.format(ids=[5, 6]))
    result = run(pytester, "--oobguard")
    assert result.ret == pytest.ExitCode.OK
    out = result.stdout.str()
    line = next(line for line in out.splitlines() if line.startswith("sglang_oobguard report "))
    folder = Path(line.split()[2].rstrip(":"))
    assert line.endswith(": 1 process guarded, 0 with violations") and "oobguard-report-" in folder.name
    assert "mode strict, " in out and f"sglang {SGLANG}: no violation" in out and "OK: no violation" in out
    ((pid, lines),) = reports(folder).items()
    assert [r["kind"] for r in lines if r["kind"] != "counts"] == ["activation"] and lines[0]["mode"] == "strict"
    assert lines[-1]["kind"] == "counts" and lines[-1]["final"]  # what each check did, filed at exit


def test_the_checks_option_reaches_every_guarded_process(pytester):
    """--oobguard-checks LIST is SGLANG_OOBGUARD_CHECKS for the session: the subprocess's
    activation record names the checks it ran, the one turned off not among them."""
    pytester.makepyfile(SUBPROCESS.format(ids=[5, 6]))
    result = run(pytester, "--oobguard", "--oobguard-checks=all,-reads")
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    folder = Path(next(line for line in result.stdout.str().splitlines()
                       if line.startswith("sglang_oobguard report ")).split()[2].rstrip(":"))
    ((pid, lines),) = reports(folder).items()
    activation = lines[0]
    assert activation["liveness"] and activation["finite"] and "reads" not in activation["checks"]
    assert {"bounds", "liveness", "history"} <= set(activation["checks"])


def test_a_run_in_which_nothing_was_guarded_fails(pytester):
    pytester.makepyfile("def test_nothing_to_do_with_sglang(): pass\n")
    result = run(pytester, "--oobguard=warn")
    result.assert_outcomes(passed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert "0 processes guarded" in result.stdout.str()
    assert "FAIL: no process was guarded (no activation record)" in result.stdout.str()


def test_without_the_option_it_is_inert(pytester):
    pytester.makepyfile("""
        import os, sys

        def test_nothing_set_or_loaded():
            assert not [name for name in os.environ if name.startswith("SGLANG_OOBGUARD")]
            assert not [name for name in sys.modules if name.startswith("sglang_oobguard.") and
                        name != "sglang_oobguard.pytest_plugin"]
    """)
    result = run(pytester)
    out = result.stdout.str()
    assert result.ret == pytest.ExitCode.OK and "sglang_oobguard report" not in out
    assert "plugins: sglang-oobguard-" in out  # loaded all the same, from its distribution's entry point
    assert "--oobguard=[MODE]" in run(pytester, "--help").stdout.str()
    # the option comes from the entry point named oobguard, and only from it
    assert run(pytester, "-p", "no:oobguard", "--oobguard").ret == pytest.ExitCode.USAGE_ERROR


def test_bad_options_are_usage_errors_that_say_what_to_do(pytester, tmp_path, monkeypatch):
    pytester.makepyfile("def test_x(): pass\n")
    alone = run(pytester, f"--oobguard-report-dir={tmp_path}")
    assert alone.ret == pytest.ExitCode.USAGE_ERROR
    assert "--oobguard-report-dir needs --oobguard[=strict|raise|warn]" in alone.stderr.str()
    (tmp_path / "oobguard-vm-1.jsonl").write_text("{}\n")
    earlier = run(pytester, "--oobguard", f"--oobguard-report-dir={tmp_path}")
    assert earlier.ret == pytest.ExitCode.USAGE_ERROR
    assert ("holds the reports of an earlier run (1 file, e.g. oobguard-vm-1.jsonl): remove them, or name an "
            "empty folder") in earlier.stderr.str()
    checks = run(pytester, "--oobguard-checks=all")
    assert checks.ret == pytest.ExitCode.USAGE_ERROR
    assert "--oobguard-checks needs --oobguard[=strict|raise|warn]" in checks.stderr.str()
    unknown = run(pytester, "--oobguard", "--oobguard-checks=all,-nope")
    assert unknown.ret == pytest.ExitCode.USAGE_ERROR
    assert "invalid SGLANG_OOBGUARD_CHECKS='all,-nope'" in unknown.stderr.str()
    loud = run(pytester, "--oobguard=loud")
    assert loud.ret == pytest.ExitCode.USAGE_ERROR and "invalid choice: 'loud'" in loud.stderr.str()
    monkeypatch.setenv("SGLANG_OOBGUARD_BACKEND", "gpu")
    backend = run(pytester, "--oobguard")
    assert backend.ret == pytest.ExitCode.USAGE_ERROR
    assert "invalid SGLANG_OOBGUARD_BACKEND='gpu'" in backend.stderr.str()
