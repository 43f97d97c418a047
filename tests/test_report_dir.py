"""SGLANG_OOBGUARD_REPORT_DIR and `python -m sglang_oobguard report DIR`: guarded
processes (fresh interpreters, the guard activated as sglang activates it, real
pools) file JSON lines in the folder; the report command sums them up and gates."""

from __future__ import annotations

import dataclasses
import json
import socket
import subprocess
import sys

from helpers import GUARDED_WRITE, ROOT, SGLANG, run_python
from sglang_oobguard.model.targets import write_map_off
from sglang_oobguard.model.violation import Violation

VIOLATION_FIELDS = {f.name for f in dataclasses.fields(Violation)}


def report(folder, *extra: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_oobguard", "report", str(folder), *extra],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)


def records(path) -> list[dict]:
    """The file's activation and violation records (its counts records: tests/test_counts.py)."""
    return [record for record in map(json.loads, path.read_text().splitlines()) if record["kind"] != "counts"]


def final_counts(path) -> dict:
    """The counts record a process files at exit (an os._exit files none)."""
    last = json.loads(path.read_text().splitlines()[-1])
    return last["counts"] if last["kind"] == "counts" and last["final"] else {}


def guarded(folder, mode: str, ids: list[int], then: str = "") -> subprocess.CompletedProcess:
    """A fresh interpreter guarded in `mode` writes `ids` into a real pool, then runs
    `then`; warn mode's running-total line is held back (one warning line per run)."""
    return run_python(GUARDED_WRITE.format(ids=ids) + then,
                      {"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_REPORT_DIR": str(folder),
                       "SGLANG_OOBGUARD_WARN_INTERVAL_S": "3600"})


FORK = """
import os
pid = os.fork()
if pid == 0:  # a forked child inherits the guard: its reports go to a file of its own
    pool.set_kv_buffer(Layer, torch.tensor([3, 99]), k[:2], k[:2])
    os._exit(0)
os.waitpid(pid, 0)
print("CHILD", pid)
"""


def test_every_process_files_its_activation_and_each_violation(tmp_path):
    folder = tmp_path / "reports"
    warned = guarded(folder, "warn", [5, 6, -1], then="pool.set_kv_buffer(Layer, torch.tensor([-1, 2]), k[:2], k[:2])"
                                                      + FORK)
    assert warned.returncode == 0, warned.stderr[-3000:]
    clean = guarded(folder, "raise", [5, 6, 7])
    assert clean.returncode == 0, clean.stderr[-3000:]
    strict = guarded(folder, "strict", [5, 70])
    assert strict.returncode == 1 and "KVOutOfBoundsError" in strict.stderr
    host = socket.gethostname()
    child = int(warned.stdout.split("CHILD")[1])
    files = sorted(p.name for p in folder.iterdir())
    assert len(files) == 4 and f"oobguard-{host}-{child}.jsonl" in files

    by_mode: dict[str, list] = {}
    for path in folder.iterdir():
        lines = records(path)
        head = lines[0]
        assert head["kind"] == "activation" and head["sglang"] == SGLANG and head["host"] == host
        assert path.name == f"oobguard-{host}-{head['pid']}.jsonl"
        assert head["guarded"] == len(head["methods"]) > 0 and "MHATokenToKVPool.set_kv_buffer" in head["methods"]
        assert head["role"] is None and head["ranks"] == {}  # not one of sglang's own processes
        assert head["checks"] == (["bounds"] if write_map_off() else ["bounds", "map", "ownids", "positions"])  # on, named
        assert final_counts(path).get("bounds", {}).get("writes", 0) >= (0 if head["pid"] == child else 1)
        by_mode.setdefault(head["mode"], []).append(lines)
    assert sorted(by_mode) == ["raise", "strict", "warn"] and len(by_mode["warn"]) == 2
    assert len(by_mode["raise"][0]) == 1  # activation only
    (strict_lines,) = by_mode["strict"]
    assert [r["kind"] for r in strict_lines] == ["activation", "violation"]  # filed before it raised
    assert strict_lines[1]["violation"]["value"] == 70

    parent, forked = sorted(by_mode["warn"], key=lambda lines: lines[0]["pid"] == child)
    assert forked[0]["pid"] == child and [r["kind"] for r in forked] == ["activation", "violation"]
    assert forked[1]["violation"]["value"] == 99
    first, second = parent[1:]
    assert set(first["violation"]) == VIOLATION_FIELDS  # every field of the report, no other schema
    assert first["violation"] == {**first["violation"], "label": "set_kv_buffer (MHA)", "pool": "MHATokenToKVPool",
                                  "layer": 1, "high": 65, "pos": 2, "value": -1, "bad": 1, "calls": 1}
    assert (second["violation"]["pos"], second["violation"]["calls"], second["pool_key"]) == (0, 2, first["pool_key"])

    proc = report(folder)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    out = proc.stdout
    assert out.splitlines()[0] == f"sglang_oobguard report {folder}: 4 processes guarded, 3 with violations"
    assert ("set_kv_buffer (MHA) | MHATokenToKVPool | layer 1: 4 reports in 3 processes; first " in out
            and f"pid {parent[0]['pid']} on {host}: set_kv_buffer (MHA) layer 1: 1 of 3 slot ids outside [0, 65): "
                "loc[2] = -1 (pool MHATokenToKVPool)" in out), out
    lines = {int(line.split()[1]): line for line in out.splitlines() if line.startswith("  pid ")}
    assert lines.keys() == {lines[0]["pid"] for lines in (*by_mode["warn"], *by_mode["raise"], strict_lines)}
    assert lines[by_mode["raise"][0][0]["pid"]].endswith(f"-c): mode raise, {head['guarded']} guarded methods, "
                                                         f"sglang {SGLANG}: no violation")
    assert lines[parent[0]["pid"]].endswith(": 2 violation reports") and lines[child].endswith(": 1 violation report")
    assert out.rstrip().endswith("FAIL: KV-cache violations reported")

    as_json = json.loads(report(folder, "--json").stdout)
    assert as_json["exit_code"] == 1 and len(as_json["processes"]) == 4
    (group,) = as_json["groups"]
    assert (group["label"], group["pool"], group["layer"], group["reports"]) == \
        ("set_kv_buffer (MHA)", "MHATokenToKVPool", 1, 4)
    assert group["first"]["violation"] == first["violation"] and group["first"]["message"].startswith(
        "set_kv_buffer (MHA) layer 1: 1 of 3 slot ids outside [0, 65): loc[2] = -1")


def test_report_passes_a_clean_run_and_says_which_processes_were_guarded(tmp_path):
    proc = guarded(tmp_path, "warn", [5, 6])
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = report(tmp_path)
    assert out.returncode == 0, out.stdout
    assert "1 process guarded, 0 with violations" in out.stdout and ": no violation" in out.stdout
    assert out.stdout.rstrip().endswith("OK: no violation")


def test_a_folder_with_no_activation_record_fails_with_2(tmp_path):
    (tmp_path / "notes.txt").write_text("not a report")
    for folder in (tmp_path, tmp_path / "missing"):
        proc = report(folder)
        assert proc.returncode == 2
        assert "0 processes guarded" in proc.stdout and "processes: none" in proc.stdout
        assert proc.stdout.rstrip().endswith("FAIL: no process was guarded (no activation record)")
    assert f"unreadable: {tmp_path / 'missing'} is not a folder" in report(tmp_path / "missing").stdout


def test_an_unreadable_line_is_named_and_the_rest_still_counts(tmp_path):
    proc = guarded(tmp_path, "warn", [5, -1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    (path,) = tmp_path.iterdir()
    torn = len(path.read_text().splitlines()) + 1  # after the activation, the violation and the counts
    with path.open("a") as f:
        f.write('{"kind": "violation", "violation": {"label"\n')  # a torn line, from whatever wrote it
    out = report(tmp_path)
    assert out.returncode == 1 and f"unreadable: {path.name}:{torn}: not a report record" in out.stdout
    assert "set_kv_buffer (MHA) | MHATokenToKVPool | layer 1: 1 report in 1 process" in out.stdout


def test_an_unwritable_folder_warns_once_and_the_guard_goes_on(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    proc = guarded(blocker / "reports", "warn", [5, 6, -1],
                   then="pool.set_kv_buffer(Layer, torch.tensor([-1]), k[:1], k[:1])\n"
                        "print('ROWS', [i for i in range(65) if pool.k_buffer[1][i].abs().sum() > 0])")
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stderr.splitlines() if "cannot write reports to" in line]
    assert len(warnings) == 1 and f"{blocker / 'reports'} (" in warnings[0], proc.stderr[-3000:]
    assert "the guard goes on without a report file" in warnings[0]
    assert proc.stdout.split("ROWS")[1].strip() == "[0, 5, 6]"  # contained, as without the folder
    assert proc.stderr.count("sglang_oobguard: bad KV slot ids") == 1  # the warn line itself still came



SCHEDULER = """
import threading
def run_scheduler_process(server_args, port_args, gpu_id, tp_rank, moe_ep_rank, pp_rank, dp_rank, file):
    if dp_rank is None:  # sglang's forward thread files the counts: the entry is on the main thread
        worker = threading.Thread(target=file.counts, args=({}, False))
        worker.start()
        worker.join()
    else:
        file.counts({}, False)
"""


def test_a_process_entry_found_after_activation_is_filed_as_the_role(tmp_path):
    """A `.pth` install on a release without the plugin loader (before 0.5.11) activates
    while the spawned scheduler unpickles its entry, before run_scheduler_process runs: the
    activation names no role, and the first counts filed inside the entry add it, once."""
    from sglang_oobguard.report.files import ReportFile
    from sglang_oobguard.report.summary import read

    entry = {"__name__": "sglang.srt.managers.scheduler"}
    exec(SCHEDULER, entry)
    for name, dp_rank in (("main", 0), ("worker", None)):
        file = ReportFile(str(tmp_path / name), {"role": None, "ranks": {}})
        file.start()
        file.counts({}, False)  # outside the entry: still unknown
        entry["run_scheduler_process"](None, None, 0, 1, 0, 0, dp_rank, file)
        entry["run_scheduler_process"](None, None, 0, 1, 0, 0, dp_rank, file)
        kinds = [json.loads(line)["kind"] for line in next((tmp_path / name).iterdir()).read_text().splitlines()]
        assert kinds == ["activation", "counts", "role", "counts", "counts"], (name, kinds)
        (process,) = read(str(tmp_path / name)).processes
        expected = {"tp_rank": 1, "moe_ep_rank": 0, "pp_rank": 0, **({"dp_rank": 0} if dp_rank == 0 else {})}
        assert process.activation["role"] == "run_scheduler_process" and process.activation["ranks"] == expected
