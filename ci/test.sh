#!/usr/bin/env bash
# The whole test suite, set-up included, on each release of the matrix: the full suite
# on sglang 0.5.23, then the guard's unit and loader tests (no engine, no benchmarks,
# no GPU-check dry run) on each older release in ci/matrix. Arguments go to every
# pytest run.
# OOBGUARD_MATRIX="0.5.23" runs one cell.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
matrix="${OOBGUARD_MATRIX:-$(grep -v '^#' ci/matrix | xargs)}"
for version in $matrix; do
  venv="$(bash ci/setup-env.sh "$version")"
  echo "=== sglang $version ($venv)"
  if [[ "$version" == 0.5.23 ]]; then
    "$venv/bin/python" -m pytest "$@"
  else  # older releases import sgl_kernel (0.4.x also vllm) on the CPU write path: test-only stand-ins
    standins="$root/tests/standins"
    [[ "$version" == 0.4.* ]] && standins="$standins:$root/tests/standins/releases-0.4"
    PYTHONPATH="$standins${PYTHONPATH:+:$PYTHONPATH}" \
      "$venv/bin/python" -m pytest -m "not e2e and not bench" "$@"
  fi
done
