"""The GPU check's two Python steps (ci/gpu-check.sh runs the parts, this reads them).

    python bench/gpu_report.py env --json PATH     # the environment part: one line, and PATH
    python bench/gpu_report.py write WORK OUTDIR   # report.md and report.json from WORK

`env` imports what the check needs and says what it found: GPU, torch, triton, sglang,
whether sglang's pool modules import (with the error), where `sgl_kernel` comes from,
and on CUDA whether sglang's JIT store_cache kernel (the path set_kv_buffer takes)
builds, and in how long. It exits 1 when memory_pool does not import.

`write` reads, for each part NAME that gpu-check.sh ran, WORK/NAME.cmd, .rc, .seconds
and .log (an absent .rc is a skipped part, its .log says why), plus OUTDIR/junit.xml,
OUTDIR/bench.json and OUTDIR/env.json where they exist.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import shutil
import sys
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

PARTS = ("install", "env", "tests", "bench", "reads", "engine")  # reads: issue 33; engine: issue 24
POOL_MODULES = ("sglang.srt.mem_cache.memory_pool", "sglang.srt.mem_cache.allocator",
                "sglang.srt.utils.async_probe", "sglang.srt.model_executor.runner")
VERSIONS = ("torch", "triton", "transformers", "numpy", "sglang", "apache-tvm-ffi", "pydantic", "typing_extensions",
            "anyio", "wrapt", "pytest")
ROW_BYTES = 8 * 128 * 2  # the pools of tests/test_gpu.py and bench/gpu_probe.py: bf16, 8 KV heads x 128
TAIL_LINES = 25


def version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def store_cache_jit() -> dict:
    """Build (or load) sglang's JIT store_cache kernel as set_kv_buffer would, timed."""
    from sglang.kernels.ops.kvcache.kvcache import can_use_store_cache

    t0 = time.perf_counter()
    ok = can_use_store_cache(ROW_BYTES)  # logs sglang's own warning when the build fails
    return {"ok": ok, "seconds": round(time.perf_counter() - t0, 1), "nvcc": shutil.which("nvcc"),
            "CUDA_HOME": os.environ.get("CUDA_HOME"), "cache": os.environ.get("SGLANG_JIT_CACHE_DIR")}


def environment() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    env: dict = {
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name() if cuda else None,
        "versions": {name: version(name) for name in VERSIONS},
        "imports": {},
    }
    for name in POOL_MODULES:
        try:
            importlib.import_module(name)
            env["imports"][name] = "ok"
        except Exception as exc:  # the report names it; the other parts then fail on their own
            env["imports"][name] = f"{type(exc).__name__}: {exc}"
    kernel = sys.modules.get("sgl_kernel")
    env["sgl_kernel"] = getattr(kernel, "__file__", None) if kernel else None
    if cuda and env["imports"][POOL_MODULES[0]] == "ok":
        env["store_cache_jit"] = store_cache_jit()
    return env


def env_line(env: dict) -> str:
    v = env["versions"]
    pool = env["imports"][POOL_MODULES[0]]
    jit = env.get("store_cache_jit")
    jit_text = ("n/a (no CUDA)" if jit is None else
                f"{'built/loaded' if jit['ok'] else 'FAILED (sglang falls back to index_put)'} in {jit['seconds']} s")
    return (f"env: GPU {env['gpu'] or 'none'} | python {env['python']} | torch {v['torch']} | triton {v['triton']} "
            f"| sglang {v['sglang']} | memory_pool imports: {'yes' if pool == 'ok' else 'NO: ' + pool} "
            f"| store_cache JIT: {jit_text}")


def cmd_env(args: argparse.Namespace) -> int:
    env = environment()
    env["line"] = env_line(env)
    print(env["line"])
    print(json.dumps(env, indent=1))
    args.json.write_text(json.dumps(env, indent=1))
    return 0 if env["imports"][POOL_MODULES[0]] == "ok" else 1


def junit_counts(path: Path) -> dict | None:
    """pytest's junit xml: counts and every case that did not pass, with its message."""
    if not path.exists():
        return None
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    if suite is None:
        return None
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    cases = []
    for case in suite.iter("testcase"):
        outcome = next((c for c in case if c.tag in ("failure", "error", "skipped")), None)
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        cases.append({"name": f"{case.get('classname')}::{case.get('name')}", "time": float(case.get("time", 0)),
                      "outcome": "passed" if outcome is None else outcome.tag,
                      "message": None if outcome is None else (outcome.get("message") or "")[:500],
                      "properties": props})
    return {"counts": counts, "cases": cases}


def read_part(work: Path, name: str) -> dict:
    def text(suffix: str) -> str | None:
        p = work / f"{name}.{suffix}"
        return p.read_text(errors="replace").strip() if p.exists() else None

    rc = text("rc")
    log = text("log") or ""
    part = {"name": name, "command": text("cmd"), "rc": None if rc is None else int(rc),
            "seconds": float(text("seconds") or 0), "tail": "\n".join(log.splitlines()[-TAIL_LINES:])}
    if rc is None:
        part["status"] = "skip"
    elif int(rc) in (124, 137):
        part["status"] = "timeout"
    else:
        part["status"] = "pass" if int(rc) == 0 else "fail"
    return part


def bench_text(work: Path) -> str:
    """The benchmark's printed tables, as it printed them."""
    log = (work / "bench.log").read_text(errors="replace") if (work / "bench.log").exists() else ""
    start = log.find("Probes alone")
    return log[start:].strip() if start >= 0 else ""


def reads_text(work: Path) -> str:
    """bench/history_reads.py --gpu's table (or its line that no GPU was there)."""
    log = (work / "reads.log").read_text(errors="replace") if (work / "reads.log").exists() else ""
    for marker in ("| batch | context |", "read kernel: no CUDA device"):
        start = log.find(marker)
        if start >= 0:
            return log[start:].strip()
    return ""


def engine_text(work: Path) -> str:
    """bench/engine.py's table as it printed it (or its dry run's plan, or why it was skipped)."""
    log = (work / "engine.log").read_text(errors="replace") if (work / "engine.log").exists() else ""
    for marker in ("sglang-oobguard engine benchmark", "bench/engine.py dry run", "skipped:"):
        start = log.find(marker)
        if start >= 0:
            return log[start:].strip()
    return ""


def cmd_write(args: argparse.Namespace) -> int:
    work, out = args.work, args.outdir
    out.mkdir(parents=True, exist_ok=True)
    parts = [read_part(work, name) for name in PARTS]
    tests = junit_counts(out / "junit.xml")
    if tests:
        next(p for p in parts if p["name"] == "tests")["counts"] = tests["counts"]
    loaded = {name: json.loads((out / f"{name}.json").read_text())
              for name in ("env", "bench", "engine") if (out / f"{name}.json").exists()}
    report = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"), "dry_run": args.dry_run,
              "parts": parts, "env": loaded.get("env"), "tests": tests, "bench": loaded.get("bench"),
              "engine": loaded.get("engine")}
    (out / "report.json").write_text(json.dumps(report, indent=1))
    (out / "report.md").write_text(markdown(report, bench_text(work), engine_text(work), reads_text(work)))
    print(f"gpu-check: report in {out}/report.md and report.json")
    for p in parts:
        print(f"  {p['name']:8s} {p['status']:8s} rc={p['rc']} {p['seconds']:.1f} s")
    return 0


def markdown(report: dict, bench: str, engine: str = "", reads: str = "") -> str:
    title = "GPU check (DRY RUN on a CPU: nothing here is a GPU result)" if report["dry_run"] else "GPU check"
    lines = [f"# {title}, {report['when']}", ""]
    if report["env"]:
        lines += [report["env"]["line"], ""]
    lines += ["| part | result | rc | seconds | counts | command |", "|---|---|---|---|---|---|"]
    for p in report["parts"]:
        counts = ", ".join(f"{k} {v}" for k, v in p.get("counts", {}).items())
        lines.append(f"| {p['name']} | {p['status']} | {p['rc']} | {p['seconds']:.1f} | {counts} | "
                     f"`{p['command'] or ''}` |")
    tests = report["tests"]
    if tests:
        lines += ["", "## Tests", "", "| test | outcome | seconds | detail |", "|---|---|---|---|"]
        for c in tests["cases"]:
            detail = "; ".join(f"{k}={v}" for k, v in c["properties"].items()) or (c["message"] or "")
            detail = detail.replace("|", "\\|").replace("\n", " ")[:300]
            lines.append(f"| {c['name']} | {c['outcome']} | {c['time']:.2f} | {detail} |")
    if bench:
        lines += ["", "## Benchmark (bench/gpu_probe.py)", "", bench]
    if reads:
        lines += ["", "## Read kernel (bench/history_reads.py --gpu)", "", reads]
    if engine:
        lines += ["", "## Engine benchmark (bench/engine.py --device cuda)", "", engine]
    for p in report["parts"]:
        if p["status"] != "pass":
            lines += ["", f"## {p['name']}: {p['status']}, last lines", "", "```", p["tail"], "```"]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    env = sub.add_parser("env", help="the environment part")
    env.add_argument("--json", type=Path, required=True)
    write = sub.add_parser("write", help="report.md and report.json")
    write.add_argument("work", type=Path, help="where gpu-check.sh left each part's cmd, rc, seconds and log")
    write.add_argument("outdir", type=Path)
    write.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    return cmd_env(args) if args.command == "env" else cmd_write(args)


if __name__ == "__main__":
    sys.exit(main())
