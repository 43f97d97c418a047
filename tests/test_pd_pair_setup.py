"""The PD pair test's set-up fails under CI rather than letting the test skip: ci/mooncake-libs.sh
(called by ci/setup-env.sh) exits non-zero under CI=true where Debian's libibverbs / libnl cannot
be fetched, and tests/test_e2e_pd_pair.py fails, not skips, under CI=true where mooncake's transfer
engine does not import. Outside CI both say what is missing and the test skips by name.

The script runs with test-only stand-ins first on its PATH: `apt-get` (Debian's archive, which a
test cannot make unreachable or reachable at will: it fails as `apt-get download` does offline, or
lays out the three packages' libraries as `dpkg -x` would), `dpkg` (unpacks those stand-in .debs)
and `ldconfig` (the system's linker cache, shown empty so that libraries installed system-wide on
the test machine do not decide the case)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import ROOT

SCRIPT = ROOT / "ci" / "mooncake-libs.sh"
OFFLINE = "#!/bin/sh\necho \"$*\" >> \"$CALLS\"\necho 'E: Unable to locate package libibverbs1' >&2\nexit 100\n"
ONLINE = "#!/bin/sh\necho \"$*\" >> \"$CALLS\"\nfor p in $(echo \"$*\" | cut -d' ' -f2-); do echo \"$p\" > \"$p.deb\"; done\n"
# dpkg -x DEB DIR: the package's library, where Debian puts it
DPKG = ("#!/bin/sh\ncase \"$(cat \"$2\")\" in\n  libibverbs1) f=usr/lib/x86_64-linux-gnu/libibverbs.so.1;;\n"
        "  libnl-3-200) f=lib/x86_64-linux-gnu/libnl-3.so.200;;\n"
        "  *) f=usr/lib/x86_64-linux-gnu/libnl-route-3.so.200;;\nesac\nmkdir -p \"$3/$(dirname $f)\" && touch \"$3/$f\"\n")


def fetch(tmp_path: Path, apt: str, ci: str | None) -> tuple[subprocess.CompletedProcess, Path, list[str]]:
    """ci/mooncake-libs.sh VENV under the stand-ins; returns its run, the libs folder, apt-get's calls."""
    bin_dir, venv = tmp_path / "bin", tmp_path / "venv"
    bin_dir.mkdir(exist_ok=True)
    venv.mkdir(exist_ok=True)
    for name, text in (("apt-get", apt), ("dpkg", DPKG), ("ldconfig", "#!/bin/sh\n")):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "OOBGUARD_MOONCAKE_LIBS")}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", CALLS=str(calls), **({"CI": ci} if ci is not None else {}))
    run = subprocess.run(["bash", str(SCRIPT), str(venv)], env=env, capture_output=True, text=True, timeout=60)
    return run, venv / "mooncake-libs", calls.read_text().splitlines() if calls.exists() else []


def test_under_ci_a_failed_fetch_fails_the_set_up_naming_what_is_missing_and_how_to_get_it(tmp_path):
    run, _, calls = fetch(tmp_path, OFFLINE, ci="true")
    assert run.returncode == 1, run.stderr
    assert calls == ["download libibverbs1 libnl-3-200 libnl-route-3-200"]
    assert "needs libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200" in run.stderr
    assert "(E: Unable to locate package libibverbs1)" in run.stderr
    assert "apt-get install libibverbs1 libnl-3-200 libnl-route-3-200" in run.stderr
    assert "OOBGUARD_MOONCAKE_LIBS" in run.stderr and "CI=true: failing the set-up" in run.stderr


def test_outside_ci_a_failed_fetch_is_said_and_the_set_up_goes_on(tmp_path):
    run, _, _ = fetch(tmp_path, OFFLINE, ci=None)
    assert run.returncode == 0, run.stderr
    assert "needs libibverbs.so.1" in run.stderr and "tests/test_e2e_pd_pair.py skips here" in run.stderr


def test_a_fetch_unpacks_the_libraries_once(tmp_path):
    run, libs, calls = fetch(tmp_path, ONLINE, ci="true")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert (libs / "usr/lib/x86_64-linux-gnu/libibverbs.so.1").exists()
    assert (libs / "lib/x86_64-linux-gnu/libnl-3.so.200").exists()
    again, _, calls = fetch(tmp_path, OFFLINE, ci="true")  # there already: apt-get is not asked again
    assert again.returncode == 0 and calls == ["download libibverbs1 libnl-3-200 libnl-route-3-200"]


def test_setup_env_runs_the_fetch_for_0_5_23_and_stops_on_its_failure():
    """Read from the script (running it would rebuild a venv): the call is outside the stamp's block,
    and `set -e` makes its exit status the set-up's."""
    text = (ROOT / "ci" / "setup-env.sh").read_text()
    assert text.startswith("#!/usr/bin/env bash") and "set -euo pipefail" in text
    block_end = text.index('  echo "$want" > "$venv/.oobguard-stamp"\nfi\n')
    call = text.index('bash "$root/ci/mooncake-libs.sh" "$venv"')
    assert call > block_end and "apt-get download" not in text


def pd_pair_outcome(tmp_path: Path, ci: str | None) -> subprocess.CompletedProcess:
    """tests/test_e2e_pd_pair.py in a fresh pytest with mooncake's libraries pointed at an empty folder."""
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    env.update(OOBGUARD_MOONCAKE_LIBS=str(tmp_path / "none"), **({"CI": ci} if ci is not None else {}))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider",
                           str(ROOT / "tests" / "test_e2e_pd_pair.py")], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def no_system_ibverbs():
    cache = subprocess.run(["sh", "-c", "ldconfig -p 2>/dev/null || /sbin/ldconfig -p"], capture_output=True,
                           text=True).stdout
    if "libibverbs.so.1 " in cache:
        pytest.skip("libibverbs is installed system-wide here: mooncake imports without the venv's copy")


@pytest.mark.parametrize("ci", ["true", None], ids=["CI=true", "no CI"])
def test_the_pd_pair_test_fails_under_ci_and_skips_elsewhere_when_mooncake_does_not_import(tmp_path, ci,
                                                                                           no_system_ibverbs):
    pytest.importorskip("mooncake")
    run = pd_pair_outcome(tmp_path, ci)
    tail = run.stdout.strip().splitlines()[-1]
    if ci:
        assert run.returncode != 0 and "1 error" in tail and "skipped" not in tail, run.stdout[-2000:]
        assert "CI=true, and the PD pair test cannot run: mooncake's transfer engine does not import" in run.stdout
    else:
        assert run.returncode == 0 and "1 skipped" in tail, run.stdout[-2000:]
    assert "libibverbs" in run.stdout and "OOBGUARD_MOONCAKE_LIBS" in run.stdout
