#!/usr/bin/env bash
# The release sweep (outside the per-landing CI: it takes hours): for each sglang release
# from 0.4.10 to the newest on the registry (post releases included, pre-releases not), or
# for the releases given as arguments, in that order:
#   - its venv, by the existing mechanism (ci/setup-env.sh: the shared .venv-torch, a
#     temporary OOBGUARD_VENV deleted after the row), from ci/requirements/sglang-VERSION.txt
#     (written first by ci/make-requirements.py from the release's own pins if missing);
#   - the import of sglang.srt.mem_cache.memory_pool, alone and with the test-only
#     stand-ins on PYTHONPATH (sgl_kernel has no CPU build);
#   - `python -m sglang_oobguard doctor`: its rc and its guarded / not-guarded counts;
#   - the guard's tests as ci/test.sh runs its older cells (-m "not e2e and not bench",
#     stand-ins on PYTHONPATH), then the engine as they run it (tests/test_e2e_releases.py:
#     a double free reported, and a clean run with every check on: which checks counted work);
# and writes the release's row into docs/releases.md (write_row below). The next
# release's venv is built while the current one's tests run. Everything runs under
# nice -n 19. Logs: $OOBGUARD_SWEEP_LOGS (default /tmp/oobguard-sweep).
#     bash ci/sweep.sh                 # every release (hours)
#     bash ci/sweep.sh 0.5.24          # a new release: one command
#     OOBGUARD_SWEEP_ROWS_ONLY=1 bash ci/sweep.sh 0.5.20   # rewrite a row from the logs of a run
#     OOBGUARD_SWEEP_QUICK=1 bash ci/sweep.sh 0.5.1.post1   # the import and doctor only (minutes less a release)
#     OOBGUARD_SWEEP_ENGINE=1 bash ci/sweep.sh 0.5.20       # the engine without the tests (about 4 minutes,
#         not 15): the row keeps its tests' cells, and its swept cell gives both dates
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
logs="${OOBGUARD_SWEEP_LOGS:-/tmp/oobguard-sweep}"
mkdir -p "$logs"
work="$(mktemp -d "${TMPDIR:-/tmp}/oobguard-sweep.XXXXXX")"
trap 'rm -rf "$work"' EXIT
if [[ $# -gt 0 ]]; then versions=("$@"); else mapfile -t versions < <(python3 ci/make-requirements.py --list); fi

build() {  # build VERSION's venv in $work/VERSION; its log in $logs/VERSION.setup.log; rc in .setup.rc
  local version="$1"
  [[ -f "ci/requirements/sglang-$version.txt" ]] || nice -n 19 python3 ci/make-requirements.py "$version"
  OOBGUARD_VENV="$work/$version" nice -n 19 bash ci/setup-env.sh "$version" > "$logs/$version.setup.log" 2>&1
  echo $? > "$logs/$version.setup.rc"
}

row() {  # VERSION: test it in its venv and write its row
  local version="$1" venv="$work/$1" standins="$root/tests/standins"
  [[ "$version" == 0.4.* ]] && standins="$standins:$root/tests/standins/releases-0.4"
  local import_alone import_standins doctor_rc tests_rc
  # sglang's C++ radix tree builds at import into torch's extension cache, one folder per
  # name: two venvs sharing it rebuild it in turn (minutes each). One folder per release.
  export TORCH_EXTENSIONS_DIR="$work/$version.torch-extensions"
  if [[ "$(cat "$logs/$version.setup.rc")" != 0 ]]; then
    write_row "$version" setup-failed
    return
  fi
  local probe='import sglang.srt.mem_cache.memory_pool'
  nice -n 19 "$venv/bin/python" -c "$probe" > "$logs/$version.import.log" 2>&1; import_alone=$?
  PYTHONPATH="$standins" nice -n 19 "$venv/bin/python" -c "$probe" > "$logs/$version.import-standins.log" 2>&1
  import_standins=$?
  # doctor as a user runs it (no stand-ins), then with the stand-ins (the tests' environment)
  (cd "$work" && nice -n 19 "$venv/bin/python" -m sglang_oobguard doctor > "$logs/$version.doctor-alone.log" 2>&1)
  echo $? > "$logs/$version.doctor-alone.rc"
  (cd "$work" && PYTHONPATH="$standins" nice -n 19 "$venv/bin/python" -m sglang_oobguard doctor \
     > "$logs/$version.doctor.log" 2>&1)
  doctor_rc=$?
  if [[ -n "${OOBGUARD_SWEEP_QUICK:-}" ]]; then
    echo "quick sweep: the import and doctor only" > "$logs/$version.tests.log"
    tests_rc=quick
  else
    if [[ -n "${OOBGUARD_SWEEP_ENGINE:-}" ]]; then
      echo "engine sweep: the tests' cells are kept from the row" > "$logs/$version.tests.log"
      tests_rc=kept
    else
      PYTHONPATH="$standins" nice -n 19 "$venv/bin/python" -m pytest -m "not e2e and not bench" -q -rfE \
        -p no:cacheprovider > "$logs/$version.tests.log" 2>&1
      tests_rc=$?
    fi
    PYTHONPATH="$standins" nice -n 19 "$venv/bin/python" -m pytest -m e2e tests/test_e2e_releases.py -q -rA -s \
      -p no:cacheprovider > "$logs/$version.engine.log" 2>&1
  fi
  echo "$import_alone $import_standins $doctor_rc $tests_rc" > "$logs/$version.rcs"
  write_row "$version" "$import_alone" "$import_standins" "$doctor_rc" "$tests_rc"
}

write_row() {  # VERSION then setup-failed, or the rcs of: import alone, import with stand-ins, doctor, tests
  # one writer at a time (two sweeps may run side by side, each with its own releases)
  nice -n 19 flock "$logs/releases.md.lock" python3 - "$root/docs/releases.md" "$logs" "$@" <<'PY'
import re, sys
from pathlib import Path

doc, logs, version, *rcs = sys.argv[1:]
logs = Path(logs)
HEADER = """# sglang releases: what the guard does on each

Written by `ci/sweep.sh` (`bash ci/sweep.sh VERSION...` tries releases and rewrites their
rows; with no argument, every release from 0.4.10 on the registry). Each release: its own
venv from `ci/requirements/sglang-VERSION.txt` (its own pins, by `ci/make-requirements.py`),
sglang installed with `--no-deps`, torch 2.14.1 shared. *memory_pool import*: `import
sglang.srt.mem_cache.memory_pool` alone, and with the test-only stand-ins (`tests/standins`:
`sgl_kernel` has no CPU build) where alone fails. *doctor*: `python -m sglang_oobguard doctor`
with the stand-ins on PYTHONPATH, its rc (and alone where that differs) and its method counts.
*tests*: the guard's tests as `ci/test.sh` runs its older cells (`-m "not e2e and not bench"`,
stand-ins on PYTHONPATH; `OOBGUARD_SWEEP_QUICK=1`: none, the row says so). *engine*: the CPU
engine as `ci/test.sh` runs it on its older cells (`tests/test_e2e_releases.py`, the guard
installed as a user installs it): a double free reported, and a clean run with every check on
that names the checks that counted work and those that did not run, with why (on the release
whose cell runs the clean matrix, that matrix instead). A row is the test suite of the day in
its *swept* column; rows swept before the engine column say so; an engine sweep's row
(`OOBGUARD_SWEEP_ENGINE=1`: the engine without the unit tests) gives both days, `tests DAY,
engine DAY`.

| release | memory_pool import | doctor rc | guarded methods | not guarded methods | tests passed / failed / skipped | first failure or upstream cause | engine (every check on) | swept |
|---|---|---|---|---|---|---|---|---|
"""
BEFORE_ENGINE = "not swept with the engine (swept before the column)"


def key(v):
    release, _, post = v.partition(".post")
    return tuple(int(p) for p in release.split(".")) + (int(post) if post else -1,)


def last_line(path, pattern=None):
    lines = [l.strip() for l in path.read_text(errors="replace").splitlines() if l.strip()] if path.exists() else []
    if pattern:
        lines = [l for l in lines if re.search(pattern, l)]
    return (lines[-1] if lines else "").replace("|", "/")[:180]


def cell(text):
    return text.replace("|", "/").replace("\n", " ")


def engine_cell(version, tests_rc):
    """What tests/test_e2e_releases.py showed: its outcomes, the smoke run's ENGINE line, skips' reasons."""
    log = logs / f"{version}.engine.log"
    if tests_rc == "quick" or not log.exists():
        return "not run (quick sweep)" if tests_rc == "quick" else "not run"
    text = log.read_text(errors="replace")
    parts = ["double free reported" if re.search(r"^PASSED \S+double_free", text, re.M) else "double free: not shown"]
    parts += ["failed: " + l.split(" - ", 1)[-1][:160] for l in text.splitlines() if l.startswith(("FAILED ", "ERROR "))]
    parts += re.findall(r"ENGINE: (.*)", text)  # (printed after pytest's progress dot)
    parts += ["skipped: " + l.split(": ", 2)[-1][:200] for l in text.splitlines() if l.startswith("SKIPPED ")]
    return "; ".join(parts)


import datetime
today = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
if rcs == ["setup-failed"]:
    why = last_line(logs / f"{version}.setup.log", r"ERROR|Error|error")
    fields = [f"not installed: {why}", "", "", "", "", "venv set-up failed (see the import cell)", ""]
else:
    alone, standins, doctor_rc, tests_rc = rcs
    if alone == "0":
        imported = "ok"
    elif standins == "0":
        imported = "ok with stand-ins; alone: " + last_line(logs / f"{version}.import.log")
    else:
        imported = "error: " + last_line(logs / f"{version}.import-standins.log")
    out = (logs / f"{version}.doctor.log").read_text(errors="replace")
    alone_rc = (logs / f"{version}.doctor-alone.rc").read_text().strip()
    rc = doctor_rc + ("" if alone_rc == doctor_rc else f" (alone: {alone_rc})")
    g = re.search(r"^guarded \((\d+) methods", out, re.M)
    n = re.search(r"^not guarded \((\d+) methods\)", out, re.M)
    guarded = g.group(1) if g else "-"
    not_guarded = n.group(1) if n else ("0" if re.search(r"^not guarded: none", out, re.M) else "-")
    if n:
        names = re.findall(r"^  (\S+)", out[n.end():].split("\n\n")[0].split("\nleft alone")[0], re.M)
        not_guarded += " (" + ", ".join(names[:6]) + (", ..." if len(names) > 6 else "") + ")"
    if doctor_rc != "0" and not g:
        guarded = "- (" + cell(out.strip().splitlines()[-1][:160] if out.strip() else "no output") + ")"
    log = (logs / f"{version}.tests.log").read_text(errors="replace")
    summary = [l for l in log.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?|deselected)", l)]
    counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
    if summary:
        for num, what in re.findall(r"(\d+) (passed|failed|skipped|errors?)", summary[-1]):
            counts[what.rstrip("s") if what.startswith("error") else what] = int(num)
    tests = f"{counts['passed']} / {counts['failed'] + counts['error']} / {counts['skipped']}"
    if not summary:
        tests = "not run (quick sweep: the import and doctor only)" if tests_rc == "quick" else f"did not run (rc {tests_rc})"
    first = next((l for l in log.splitlines() if l.startswith(("FAILED ", "ERROR "))), "")
    if not first and tests_rc not in ("0", "5", "quick"):
        first = f"pytest rc {tests_rc}: " + last_line(logs / f"{version}.tests.log")
    fields = [imported, rc, guarded, not_guarded, tests, cell(first[:300]) or "none", engine_cell(version, tests_rc)]
row = "| " + " | ".join([version] + [cell(f) for f in fields] + [today]) + " |"

path = Path(doc)
text = path.read_text() if path.exists() else HEADER
body = text.partition("|---|")[2].split("\n", 1)[1]
rows = {l.split("|")[1].strip(): l for l in body.splitlines() if l.startswith("| ")}
if rcs[3:] == ["kept"] and version in rows:  # an engine sweep: the tests' cells and their date from the row
    old, new = rows[version].split(" | "), row.split(" | ")
    tested = old[-1].rstrip(" |").split("tests ")[-1].split(",")[0]
    row = " | ".join(new[:5] + old[5:7] + new[7:8]) + f" | tests {tested}, engine {today} |"
for v, old in rows.items():  # a row of the table before the engine column: its cell says so
    if old.count(" | ") == 7:
        rows[v] = old.rsplit(" | ", 1)[0] + f" | {BEFORE_ENGINE} | " + old.rsplit(" | ", 1)[1]
head = HEADER
rows[version] = row
path.write_text(head + "\n".join(rows[v] for v in sorted(rows, key=key)) + "\n")
PY
}

if [[ -n "${OOBGUARD_SWEEP_ROWS_ONLY:-}" ]]; then  # rewrite the rows of these releases from their logs
  for version in "${versions[@]}"; do
    if [[ "$(cat "$logs/$version.setup.rc")" != 0 ]]; then write_row "$version" setup-failed; continue; fi
    write_row "$version" $(cat "$logs/$version.rcs")
  done
  exit 0
fi

next_build=""
for i in "${!versions[@]}"; do
  version="${versions[$i]}"
  echo "=== sglang $version ($(date -u +%H:%M:%S))"
  if [[ -n "$next_build" ]]; then wait "$next_build"; else build "$version"; fi
  next_build=""
  if [[ $((i + 1)) -lt ${#versions[@]} ]]; then
    build "${versions[$((i + 1))]}" & next_build=$!
  fi
  row "$version"
  rm -rf "${work:?}/$version" "${work:?}/$version.torch-extensions"
  grep -F "| $version |" docs/releases.md
done
[[ -n "$next_build" ]] && wait "$next_build"
exit 0
