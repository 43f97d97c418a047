"""Test support: a PD disaggregation pair on the CPU, a prefill server and a decode server
(`sglang.launch_server`, harness.start_server) over mooncake's TCP transport, the real transfer
path: the prefill side's transfer engine writes each request's KV into the pages the decode
side allocated and sent.

Mooncake's non-CUDA wheel (`mooncake-transfer-engine-non-cuda`, ci/requirements) links Debian's
libibverbs and libnl; ci/setup-env.sh unpacks them into the venv (`mooncake-libs`, not installed
system-wide) and the servers get them on LD_LIBRARY_PATH (OOBGUARD_MOONCAKE_LIBS: another folder).
The prefill side's send needs tests/pd_shim.py on a CPU (its docstring says what it stands in for),
loaded by the fault plugin (OOBGUARD_PD_SHIM=1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Optional

from e2e.harness import Run, free_port, generate, start_server, stop_server, wait_up

LIBS = Path(os.environ.get("OOBGUARD_MOONCAKE_LIBS", Path(sys.prefix) / "mooncake-libs"))


def pair_env(env: dict[str, str]) -> dict[str, str]:
    """Both servers' environment: mooncake's libraries, its TCP transport, the CPU shim."""
    folders = [str(LIBS / sub) for sub in ("usr/lib/x86_64-linux-gnu", "lib/x86_64-linux-gnu") if (LIBS / sub).is_dir()]
    path = os.pathsep.join(filter(None, [*folders, os.environ.get("LD_LIBRARY_PATH")]))
    return {**env, "LD_LIBRARY_PATH": path, "MOONCAKE_PROTOCOL": "tcp", "OOBGUARD_PD_SHIM": "1"}


HOW = ("mooncake's non-CUDA wheel links Debian's libibverbs1, libnl-3-200 and libnl-route-3-200: "
       "`bash ci/setup-env.sh 0.5.23` unpacks them into the venv (ci/mooncake-libs.sh: apt-get download), or "
       "`apt-get install` them, or set OOBGUARD_MOONCAKE_LIBS to a folder they are unpacked into")


def under_ci() -> bool:
    """Whether a CI job runs the tests (CI=true, as CI services set it): there a missing set-up fails."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def mooncake_missing() -> Optional[str]:
    """Why mooncake's transfer engine does not import here (its last error line), or None."""
    proc = subprocess.run([sys.executable, "-c", "from mooncake.engine import TransferEngine"],
                          env={**os.environ, **pair_env({})}, capture_output=True, text=True, timeout=120)
    return None if proc.returncode == 0 else (proc.stderr.strip().splitlines() or ["no output"])[-1]


def serve_pair(model: Path, env: dict[str, str], folder: Path, prompts: list[str], tokens: int = 16,
               timeout: float = 240) -> Run:
    """Both servers up, each prompt sent to both at once with its bootstrap room (as sglang's
    router sends it), greedy; then both stopped. result: each side's tokens per prompt (the
    decode side's are the answer). log: the prefill server's, then the decode server's."""
    bootstrap = free_port()
    common = ("--disaggregation-transfer-backend", "mooncake", "--disable-radix-cache")
    sides = {"prefill": (*common, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                         str(bootstrap)),
             "decode": (*common, "--disaggregation-mode", "decode", "--disaggregation-decode-retraction-backup",
                        "cpu_tensor")}
    result, servers, leftovers = None, {}, []
    with ExitStack() as logs:
        try:
            for side, extra in sides.items():
                servers[side] = start_server(model, pair_env(env), logs.enter_context(open(folder / f"{side}.log", "w")),
                                             extra)
            deadline = time.monotonic() + timeout
            for proc, _, base in servers.values():
                wait_up(proc, base, deadline)
            bodies = [{"text": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": tokens}, "rid": f"pd{i}",
                       "bootstrap_host": "127.0.0.1", "bootstrap_port": bootstrap, "bootstrap_room": 1000 + i}
                      for i, prompt in enumerate(prompts)]
            with ThreadPoolExecutor(2 * len(bodies)) as pool:
                asked = {side: [pool.submit(generate, servers[side][2], body) for body in bodies] for side in sides}
                result = {side: [answer.result()["output_ids"] for answer in answers] for side, answers in asked.items()}
        finally:
            for proc, marker, _ in servers.values():
                leftovers += stop_server(proc, marker)
    log = "".join(f"=== {side} server\n" + (folder / f"{side}.log").read_text() for side in sides)
    codes = [proc.returncode for proc, _, _ in servers.values()]
    return Run(next((code for code in codes if code), 0), result, log, leftovers)  # 0: both shut down cleanly
