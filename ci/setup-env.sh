#!/usr/bin/env bash
# Make .venv: the real sglang 0.5.23 on a CPU machine, with this plugin installed
# editable beside it. Idempotent: a stamp of the pinned files skips the work when
# nothing changed. Override the location with OOBGUARD_VENV.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${OOBGUARD_VENV:-$root/.venv}"
reqs="$root/ci/requirements-sglang-0.5.23.txt"
want="$(cat "$reqs" "$root/pyproject.toml" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "$venv/.oobguard-stamp" && "$(cat "$venv/.oobguard-stamp")" == "$want" ]]; then
  exit 0
fi
echo "ci/setup-env.sh: building $venv (first run takes a few minutes)" >&2
python3 -m venv "$venv"
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
"${pip[@]}" -r "$reqs"
# sglang's own requirements are GPU wheels that cannot install here.
"${pip[@]}" --no-deps sglang==0.5.23
"${pip[@]}" -e "$root[test]"
# Test support only: the fault injector the end-to-end tests load as a second plugin.
"${pip[@]}" -e "$root/tests/e2e/faultinject"
echo "$want" > "$venv/.oobguard-stamp"
