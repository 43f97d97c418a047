#!/usr/bin/env bash
# The write map's reach-back (issue #43, docs/checks.md): for each sglang release given, the
# write map's checks opened there (tests/standins/measure-map: test-only, as if the release
# were in model/maptargets.WRITE_MAP_MEASURED) and the CPU engine run with every check on: the
# as-installed smoke run (tests/test_e2e_releases.py) and the clean matrix's rows an older CPU
# engine runs (tests/test_e2e_clean.py less EAGLE, NGRAM and PD, and before 0.5.16 less SWA and
# HiCache: docs/checks.md says why; OOBGUARD_REACH_ROWS: another -k expression). A release whose runs all pass may go into WRITE_MAP_MEASURED, by hand, with its
# log. Each release's venv is temporary (ci/setup-env.sh, OOBGUARD_VENV); logs in
# $OOBGUARD_REACH_LOGS (default /tmp/oobguard-reach).
#     bash ci/reach-back.sh 0.5.16 0.5.19
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
logs="${OOBGUARD_REACH_LOGS:-/tmp/oobguard-reach}"
mkdir -p "$logs"
for version in "$@"; do
  rows="not eagle and not ngram and not pd"
  python3 -c "import sys; sys.exit(tuple(map(int, '$version'.split('.post')[0].split('.'))) >= (0, 5, 16))" \
    && rows="$rows and not swa and not hicache"
  rows="${OOBGUARD_REACH_ROWS:-$rows}"
  work="$(mktemp -d "${TMPDIR:-/tmp}/oobguard-reach.XXXXXX")"
  [[ -f "ci/requirements/sglang-$version.txt" ]] || python3 ci/make-requirements.py "$version"
  if OOBGUARD_VENV="$work/venv" bash ci/setup-env.sh "$version" > "$logs/$version.setup.log" 2>&1; then
    TORCH_EXTENSIONS_DIR="$work/torch-extensions" \
      PYTHONPATH="$root/tests/standins/measure-map:$root/tests/standins" \
      "$work/venv/bin/python" -m pytest -m e2e -q -rfE -p no:cacheprovider tests/test_e2e_releases.py \
      tests/test_e2e_clean.py -k "$rows" > "$logs/$version.log" 2>&1
    echo "sglang $version: rc=$? $(tail -1 "$logs/$version.log")"
  else
    echo "sglang $version: set-up failed (see $logs/$version.setup.log)"
  fi
  rm -rf "$work"
done
