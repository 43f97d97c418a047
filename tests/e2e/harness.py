"""Test support: run tests/e2e/engine_run.py (the real sglang Engine on the CPU) in a
subprocess with a chosen environment, bounded in time, and check it left no process."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from importlib.metadata import version
from typing import Optional

from helpers import GUARD_VARS

HERE = Path(__file__).resolve().parent
STANDIN = HERE.parent / "standins"
SITEINSTALL = HERE / "siteinstall"  # the guard as a regular install's .pth arms it, in every process
RADIX_POOL = 384  # the radix workload's max_total_tokens (engine_run.py)
RETRACTED = re.compile(r"(?:KV cache pool is full\. Retract requests\.|Testing retraction\.) #retracted_reqs: (\d+)")
PREFILL = re.compile(r"Prefill batch, #new-seq: (\d+), #new-token: (\d+), #cached-token: (\d+)")
CLEARED = (*GUARD_VARS, "OOBGUARD_FAULT", "OOBGUARD_COUNT", "OOBGUARD_TRANSFER", "OOBGUARD_HICACHE_SHIM",
           "OOBGUARD_HICACHE_FAULT", "OOBGUARD_SWA_READS", "OOBGUARD_PD_SHIM", "OOBGUARD_POSITIONS", "TRITON_INTERPRET",
           "SGLANG_PLUGINS", "OOBGUARD_SITE_DIR", "OOBGUARD_FAULT_PLUGIN")


@dataclass
class Run:
    returncode: int
    result: Optional[dict]  # the script's RESULT line; None when the process died first
    log: str  # stdout and stderr of every process of the engine
    leftovers: list[int]  # pids still alive after it ended
    counts: dict[int, dict] = field(default_factory=dict)  # pid -> the fault plugin's tally (count=True)

    def tally(self, rank: int) -> dict[str, int]:
        """Writes, moves and frees that rank's scheduler made, the guard's write probes
        and the forward steps that wrote KV (all its processes summed)."""
        mine = [c for c in self.counts.values() if c["rank"] == rank]
        return {kind: sum(c[kind] for c in mine) for kind in ("writes", "moves", "frees", "probes", "steps")}


@functools.lru_cache(maxsize=None)
def old_torch_names() -> bool:
    """Whether the engine needs tests/standins/releases-0.4 (the torch name its sitecustomize
    gives back, and the stand-ins beside it): 0.4.x, and any later sglang whose source still
    asks torch for `_C._cpu._is_amx_tile_supported` (0.5.1's custom_op does at import)."""
    import importlib.util

    if version("sglang").startswith("0.4."):
        return True
    srt = Path(importlib.util.find_spec("sglang").origin).parent / "srt"
    return any("torch._C._cpu._is_amx_tile_supported" in path.read_text(errors="replace") for path in srt.rglob("*.py"))


def engine_env(extra: dict[str, str], cpu: bool = True) -> dict[str, str]:
    """cpu=False (bench/engine.py on a GPU): neither the CPU engine nor the stand-ins.
    OOBGUARD_SITE_DIR in `extra`: the guard as a regular install arms it (tests/e2e/siteinstall)."""
    env = {k: v for k, v in os.environ.items() if k not in CLEARED}
    # no py-spy and no CUDA here: sglang's crash diagnostics would only wait 65 s before its exit
    env.update(SGLANG_PYSPY_DUMP_BEFORE_CRASH="0", SGLANG_CUDA_COREDUMP_BEFORE_CRASH="0")
    first = [str(SITEINSTALL)] if extra.get("OOBGUARD_SITE_DIR") else []
    if cpu:
        first += [str(STANDIN)] + ([str(STANDIN / "releases-0.4")] if old_torch_names() else [])
        env.update(SGLANG_USE_CPU_ENGINE="1")
    if first:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*first, env.get("PYTHONPATH")]))
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


def _start(args: list[str], env: dict[str, str], log_to=subprocess.PIPE, stdin=None,
           cpu: bool = True) -> tuple[subprocess.Popen, str]:
    marker = uuid.uuid4().hex
    full = engine_env(env, cpu)
    full["OOBGUARD_E2E_RUN"] = marker
    proc = subprocess.Popen([sys.executable, *args], env=full, stdout=log_to, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, stdin=stdin)
    return proc, f"OOBGUARD_E2E_RUN={marker}"


def run_engine(model: Path, env: dict[str, str], timeout: float = 240, workload: str = "batch",
               options: tuple[str, ...] = (), count: bool = False) -> Run:
    """options: engine_run.py's `eagle`, `ngram`, `tp=2`. count: the fault plugin
    tallies the guarded methods' calls in each process (Run.counts)."""
    with tempfile.TemporaryDirectory(prefix="oobguard-count-") as folder:
        if count:
            env = {**env, "OOBGUARD_COUNT": folder}
        proc, marker = _start([str(HERE / "engine_run.py"), str(model), workload, *options], env)
        try:
            log, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            log, _ = proc.communicate()
            log += f"\n[harness] timed out after {timeout} s: killed"
        leftovers = marked_processes(marker)  # alive or zombie: either way nobody cleaned up
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        counts = {int(path.stem): json.loads(path.read_text()) for path in Path(folder).glob("*.json")}
    result = None
    for line in log.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT "):])
    return Run(proc.returncode, result, log, leftovers, counts)


class Served:
    """engine_run.py's `serve` workload (bench/engine.py): one engine kept up between
    timed rounds. A reader thread keeps its log drained, so an engine waiting its turn
    never blocks on a full pipe."""

    def __init__(self, model: Path, env: dict[str, str], options: tuple[str, ...] = ()):
        self.proc, self.marker = _start([str(HERE / "engine_run.py"), str(model), "serve", *options], env,
                                        stdin=subprocess.PIPE, cpu="cuda" not in options)
        self._stdin = self.proc.stdin
        self.lines: list[str] = []
        self._new = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._new:
                self.lines.append(line.rstrip("\n"))
                self._new.notify_all()
        with self._new:
            self._new.notify_all()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)

    def _expect(self, prefix: str, since: int, timeout: float) -> str:
        """The first line from `since` on that starts with prefix; an error naming the
        log's tail when the engine exits or the time runs out first."""
        deadline = time.monotonic() + timeout
        with self._new:
            while True:
                for line in self.lines[since:]:
                    if line.startswith(prefix):
                        return line[len(prefix):]
                since = len(self.lines)
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    why = "timed out" if left <= 0 else f"exited {self.proc.returncode}"
                    raise RuntimeError(f"engine {why} before {prefix.strip()!r}:\n" + "\n".join(self.lines[-60:]))
                self._new.wait(min(left, 1.0))

    def ready(self, timeout: float = 300) -> None:
        self._expect("READY", 0, timeout)

    def round(self, timeout: float = 600, **size: int) -> dict:
        """One timed round; `size`: batch=B, context=C (engine_run.py's serve workload)."""
        since = len(self.lines)
        self._stdin.write(" ".join(["round", *(f"{key}={value}" for key, value in size.items())]) + "\n")
        self._stdin.flush()
        # the object alone: under load another process's output was once seen glued after it on its line
        return json.JSONDecoder().raw_decode(self._expect("ROUND ", since, timeout))[0]

    def close(self, timeout: float = 120) -> Run:
        """quit, a bounded wait, then anything of this run still alive is killed."""
        try:
            self._stdin.write("quit\n")
            self._stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self._reader.join(timeout=10)
        leftovers = marked_processes(self.marker)
        for pid in leftovers:
            os.kill(pid, signal.SIGKILL)
        result = None
        for line in self.lines:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT "):])
        return Run(self.proc.returncode, result, self.log, leftovers)


_RUNS: dict[tuple, Run] = {}


def run_once(model: Path, env: dict[str, str], workload: str = "batch", options: tuple[str, ...] = ()) -> Run:
    """One engine run per test session and (model, environment, workload, options), for tests
    that only read its log and result: tests that ask the same run share it (an engine start is
    most of a test's time)."""
    key = (str(model), workload, tuple(options), tuple(sorted(env.items())))
    if key not in _RUNS:
        _RUNS[key] = run_engine(model, env, workload=workload, options=options, timeout=300)
    return _RUNS[key]


def reference_run(model: Path, workload: str, options: tuple[str, ...] = (), env: Optional[dict] = None) -> Run:
    """Guard off, no fault: the run a guarded one must reproduce; made once per test session
    and configuration (the clean matrix and the fault tests share it)."""
    run = run_once(model, dict(env or {}), workload, options)
    assert run.returncode == 0 and run.result and not run.result.get("error"), run.log[-3000:]
    assert not run.leftovers
    return run


def reference_tokens(model: Path, workload: str, options: tuple[str, ...] = ()) -> list[list[int]]:
    """Guard off, no fault: the tokens a guarded run must reproduce."""
    return reference_run(model, workload, options).result["outputs"]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(model: Path, env: dict[str, str], log_file, extra: tuple[str, ...] = ()) -> tuple:
    """`python -m sglang.launch_server --device cpu` on 127.0.0.1 (`extra`: more of its flags):
    (process, its marker, its base URL)."""
    port = free_port()
    args = ["-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
            "--disable-cuda-graph", "--max-total-tokens", "2048", "--mem-fraction-static", "0.05",
            "--context-length", "512", *extra]
    proc, marker = _start(args, env, log_to=log_file)
    return proc, marker, f"http://127.0.0.1:{port}"


def wait_up(proc: subprocess.Popen, base: str, deadline: float) -> None:
    """Until the server answers /health (or dies, or the deadline passes)."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            urllib.request.urlopen(base + "/health", timeout=2)
            return
        except OSError:
            time.sleep(1)


def generate(base: str, body: dict, timeout: float = 60) -> dict:
    request = urllib.request.Request(base + "/generate", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.loads(answer.read())


def stop_server(proc: subprocess.Popen, marker: str) -> list[int]:
    """SIGTERM to the server and a bounded wait (a group SIGKILL only as the fallback);
    returns the pids it left, killed."""
    if proc.poll() is None:  # the server alone: it stops its own children
        os.kill(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    time.sleep(1)
    leftovers = marked_processes(marker)
    for pid in leftovers:
        os.kill(pid, signal.SIGKILL)
    return leftovers


def serve_once(model: Path, env: dict[str, str], log_path: Path, timeout: float = 240) -> Run:
    """The server (`start_server`): wait for /health, one /generate, then `stop_server`;
    result holds the /generate answer."""
    result = None
    with open(log_path, "w") as log_file:
        proc, marker, base = start_server(model, env, log_file)
        try:
            wait_up(proc, base, time.monotonic() + timeout)
            result = generate(base, {"text": "the quick brown fox",
                                     "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
        finally:
            leftovers = stop_server(proc, marker)
    return Run(proc.returncode, result, log_path.read_text(), leftovers)


def assert_radix_reused(run: Run) -> None:
    """The radix workload did what it is for: all 44 requests served, prefixes from the
    radix cache, 32-token chunks, and more KV written (prefill + one slot per decoded
    token) than the pool holds while the tree keeps every finished sequence: so slots
    were evicted, freed and handed out again."""
    assert len(run.result["outputs"]) == 44 and all(run.result["outputs"])
    prefills = [tuple(map(int, found)) for found in PREFILL.findall(run.log)]
    assert sum(cached for _, _, cached in prefills) > 0
    assert max(new for _, new, _ in prefills) == 32
    written = sum(new for _, new, _ in prefills) + sum(len(tokens) for tokens in run.result["outputs"])
    assert written > 2 * RADIX_POOL
