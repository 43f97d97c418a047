"""The benchmarks stay runnable: the CPU set in its quick form, the GPU script in its
CPU dry run. They assert the scripts execute and print every row; the numbers
themselves are benchmark output, read in the README, never asserted here."""

from __future__ import annotations

import re
import subprocess
import sys

from helpers import ROOT


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cpu_benchmark_prints_every_row():
    out = run("bench/run.py", "--quick")
    for n in (1, 16, 256, 4096):
        assert re.search(rf"^\| {n} \| [\d.]+ us \| [\d.]+ us \| [\d.]+x .* \| [\d.]+ us \| [\d.]+x", out, re.M), out
    assert re.search(r"load\(\) takes [\d.]+ us", out)
    assert "Modules imported beyond the standard library: sglang_oobguard, sglang_oobguard.plugin." in out
    assert re.search(r"load_plugins\(\): ([1-9]\d*) of \1 write methods are the original function objects", out), out
    assert re.search(r"the .pth hook at interpreter start: -?[\d.]+ us", out)


def test_gpu_benchmark_dry_run_executes():
    out = run("bench/gpu_probe.py", "--dry-run")
    for n in (1, 64, 1024, 8192):
        assert re.search(rf"^\| {n} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ us .* \| [\d.]+ us \| [\d.]+x \|$", out,
                         re.M), out
    assert re.search(r"Decode step in a CUDA graph \(4 layer writes, 64 tokens\): unguarded [\d.]+ us; .*"
                     r"ours with liveness \+-?[\d.]+%", out), out
