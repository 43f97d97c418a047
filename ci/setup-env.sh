#!/usr/bin/env bash
# Make the test environment for one sglang release (default 0.5.23): the real sglang on
# a CPU machine, with this plugin installed editable beside it. 0.5.23 lives in .venv,
# others in .venv-sglang-VERSION (override with OOBGUARD_VENV). Idempotent: a stamp of
# the pinned files skips the work when nothing changed. Prints the venv's path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-0.5.23}"
if [[ "$version" == 0.5.23 ]]; then default="$root/.venv"; else default="$root/.venv-sglang-$version"; fi
venv="${OOBGUARD_VENV:-$default}"
reqs="$root/ci/requirements-sglang-$version.txt"
want="$(cat "$reqs" "$root/pyproject.toml" "$root/tests/e2e/faultinject/pyproject.toml" "${BASH_SOURCE[0]}" \
  | sha256sum | cut -d' ' -f1)"
if [[ ! -f "$venv/.oobguard-stamp" || "$(cat "$venv/.oobguard-stamp")" != "$want" ]]; then
  echo "ci/setup-env.sh: building $venv for sglang $version (first run takes a few minutes)" >&2
  python3 -m venv "$venv"
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" -r "$reqs"
  # sglang's own requirements are GPU wheels that cannot install here.
  "${pip[@]}" --no-deps "sglang==$version"
  "${pip[@]}" -e "$root[test]"
  # Test support only: the fault injector the end-to-end tests load as a second plugin.
  "${pip[@]}" -e "$root/tests/e2e/faultinject"
  echo "$want" > "$venv/.oobguard-stamp"
fi
echo "$venv"
