"""ci/gpu-check.sh stays runnable: its CPU dry run writes a well-formed report with
every part (the GPU tests skip, the benchmark runs its dry run). The numbers are
meaningless here and never asserted; ci/gpu-check.sh on the GPU machine makes the
real report."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest

from helpers import ROOT

pytestmark = pytest.mark.bench


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-report")
    env = {**os.environ, "OOBGUARD_GPU_REPORT_DIR": str(out), "OOBGUARD_PYTHON": sys.executable}
    proc = subprocess.run(["bash", "ci/gpu-check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc.stdout


def test_every_part_is_reported_with_its_result(report):
    out, _ = report
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "engine.json", "env.json", "junit.xml",
                                                     "report.json", "report.md"]
    data = json.loads((out / "report.json").read_text())
    assert data["dry_run"] is True
    parts = {p["name"]: p for p in data["parts"]}
    assert list(parts) == ["install", "env", "tests", "bench", "reads", "engine"]
    assert (parts["install"]["status"], parts["install"]["rc"]) == ("skip", None)
    for name in ("env", "tests", "bench", "reads", "engine"):
        assert (parts[name]["status"], parts[name]["rc"]) == ("pass", 0), parts[name]["tail"]
        assert parts[name]["seconds"] > 0 and sys.executable in parts[name]["command"]


def test_the_gpu_tests_are_counted_and_skip_here(report):
    out, _ = report
    data = json.loads((out / "report.json").read_text())
    suite = ET.parse(out / "junit.xml").getroot().find("testsuite")
    counts = data["tests"]["counts"]
    assert counts == {"tests": int(suite.get("tests")), "failures": 0, "errors": 0,
                      "skipped": counts["tests"], "passed": 0}
    assert counts["tests"] >= 15
    assert {c["outcome"] for c in data["tests"]["cases"]} == {"skipped"}
    assert counts == next(p for p in data["parts"] if p["name"] == "tests")["counts"]


def test_the_environment_line_names_versions_and_pool_imports(report):
    out, stdout = report
    env = json.loads((out / "env.json").read_text())
    assert set(env["imports"].values()) == {"ok"}
    assert env["gpu"] is None and "store_cache_jit" not in env
    assert re.search(r"^env: GPU none \| python [\d.]+ \| torch \S+ \| triton \S+ \| sglang [\d.]+ "
                     r"\| memory_pool imports: yes \| store_cache JIT: n/a \(no CUDA\)$", env["line"]), env["line"]
    assert env["line"] in stdout and env["line"] in (out / "report.md").read_text()


def test_the_benchmark_numbers_are_in_both_files(report):
    out, _ = report
    bench = json.loads((out / "bench.json").read_text())
    assert bench["dry_run"] is True
    assert [r["n"] for r in bench["probes"]] == [r["n"] for r in bench["writes"]] == [1, 64, 1024]
    for row in bench["probes"]:
        for key in ("launches_ours", "eager_ours", "host_ours", "host_theirs", "graph_ours", "graph_live"):
            assert row[key] > 0, (key, row)
    for row in bench["writes"]:
        for variant in ("unguarded", "guarded", "liveness", "upstream", "finite"):
            assert row[f"host_{variant}"] > 0 and row[f"eager_{variant}"] > 0 and row[f"launches_{variant}"] > 0
    assert {"unguarded", "ours", "upstream", "liveness"} <= set(bench["decode"])
    md = (out / "report.md").read_text()
    for n in (1, 64, 1024):  # the probe table, then the public-path table
        assert re.search(rf"^\| {n} \| [\d.]+ \| [\d.]+ \| [\d.]+ \| [\d.]+ us .* \| [\d.]+x \|$", md, re.M), md
        assert re.search(rf"^\| {n} \| [\d.]+ us \| [\d.]+ us \(.*\| [\d.]+ \|$", md, re.M), md
    assert re.search(r"Decode step in a CUDA graph \(4 layer writes, 64 tokens\): unguarded [\d.]+ us; .*"
                     r"ours with liveness \+-?[\d.]+%", md), md


def test_the_engine_benchmark_plans_sglang_defaults_on_the_gpu(report):
    """Dry run: bench/engine.py --device cuda prints its plan (no engine starts): every
    configuration, and the engine options of a GPU run, CUDA graphs and overlap on."""
    out, _ = report
    assert json.loads((out / "engine.json").read_text()) == {
        "dry_run": True, "configs": ["off", "upstream", "strict", "liveness", "warn", "both"]}
    md = (out / "report.md").read_text()
    section = md[md.index("## Engine benchmark (bench/engine.py --device cuda)"):]
    options = json.loads(re.search(r"^engine options: (\{.*\})$", section, re.M).group(1))
    assert "device" not in options and "disable_cuda_graph" not in options  # sglang's defaults on a GPU
    assert "disable_overlap_schedule" not in options and options["cuda_graph_max_bs"] == 8
    assert "SGLANG_PLUGINS=faultinject" in section


def test_the_read_kernel_part_says_what_it_timed(report):
    out, _ = report
    md = (out / "report.md").read_text()
    section = md[md.index("## Read kernel (bench/history_reads.py --gpu)"):]
    assert "read kernel: no CUDA device here" in section  # a dry run on a CPU times nothing, and says so
