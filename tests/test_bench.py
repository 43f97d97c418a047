"""The CPU benchmark stays runnable, in its quick form (the GPU one's dry run is
tests/test_gpu_check.py's). It asserts the script executes and prints every row; the
times themselves are benchmark output, read in the README, never asserted here; the
probe counts per step are counts, and are."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from helpers import ROOT

pytestmark = pytest.mark.bench


def run(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-W", "ignore", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_cpu_benchmark_prints_every_row():
    out = run("bench/run.py", "--quick")
    for n in (1, 16, 256, 4096):
        assert re.search(rf"^\| {n} \| [\d.]+ us \| [\d.]+ us \| [\d.]+x .* \| [\d.]+ us \| [\d.]+x", out, re.M), out
    for layers in (1, 80):  # probes per step: one per layer before the step check, one after
        assert re.search(rf"^\| {layers} \| {layers} \| 1 \| \d+ us \| \d+ us \| [\d.]+x \|$", out, re.M), out
    assert re.search(r"load\(\) takes [\d.]+ us", out)
    assert "Modules imported beyond the standard library: sglang_oobguard, sglang_oobguard.plugin." in out
    assert re.search(r"load_plugins\(\): ([1-9]\d*) of \1 write methods are the original function objects", out), out
    assert re.search(r"the .pth hook at interpreter start: -?[\d.]+ us", out)

