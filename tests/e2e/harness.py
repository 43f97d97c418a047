"""Test support: run tests/e2e/engine_run.py (the real sglang Engine on the CPU) in a
subprocess with a chosen environment, bounded in time, and check it left no process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "sgl_kernel_standin"
CLEARED = ("SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_INVARIANT_CHECK", "SGLANG_OOBGUARD_MODE", "SGLANG_OOBGUARD_BACKEND",
           "SGLANG_OOBGUARD_POLL_EVERY", "SGLANG_OOBGUARD_WARN_INTERVAL_S", "OOBGUARD_FAULT", "TRITON_INTERPRET",
           "SGLANG_PLUGINS")


@dataclass
class Run:
    returncode: int
    result: Optional[dict]  # the script's RESULT line; None when the process died first
    log: str  # stdout and stderr of every process of the engine
    leftovers: list[int]  # pids still alive after it ended


def engine_env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    env.update(SGLANG_USE_CPU_ENGINE="1", PYTHONPATH=os.pathsep.join(filter(None, [str(STANDIN),
                                                                                    env.get("PYTHONPATH")])))
    env.update(extra)
    return env


def marked_processes(marker: str) -> list[int]:
    """Pids whose environment carries this run's marker (`OOBGUARD_E2E_RUN=<id>`)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def run_engine(model: Path, env: dict[str, str], timeout: float = 240) -> Run:
    marker = f"OOBGUARD_E2E_RUN={uuid.uuid4().hex}"
    full = engine_env(env)
    full["OOBGUARD_E2E_RUN"] = marker.split("=", 1)[1]
    proc = subprocess.Popen([sys.executable, str(HERE / "engine_run.py"), str(model)], env=full,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        log += f"\n[harness] timed out after {timeout} s: killed"
    result = None
    for line in log.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    leftovers = marked_processes(marker)  # alive or zombie: either way nobody cleaned up
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    return Run(proc.returncode, result, log, leftovers)
