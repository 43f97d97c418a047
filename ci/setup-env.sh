#!/usr/bin/env bash
# Make the test environment for one sglang release (default 0.5.23): the real sglang on
# a CPU machine, with this plugin installed editable beside it. 0.5.23 lives in .venv,
# others in .venv-sglang-VERSION (override with OOBGUARD_VENV). torch is installed once,
# into .venv-torch, and each venv reads it through a .pth file: four copies of its CUDA
# libraries filled a CI machine's disk. Idempotent: a stamp of the pinned files skips
# the work when nothing changed. Prints the venv's path.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
version="${1:-0.5.23}"
if [[ "$version" == 0.5.23 ]]; then default="$root/.venv"; else default="$root/.venv-sglang-$version"; fi
venv="${OOBGUARD_VENV:-$default}"
torch_dir="$root/.venv-torch"
torch_reqs="$root/ci/requirements/torch.txt"
reqs="$root/ci/requirements/sglang-$version.txt"
export PIP_NO_CACHE_DIR=1  # every wheel is installed once; a cache would only hold a second copy
stamp() { cat "$@" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1; }

want_torch="$(stamp "$torch_reqs")"
if [[ ! -f "$torch_dir/.oobguard-stamp" || "$(cat "$torch_dir/.oobguard-stamp")" != "$want_torch" ]]; then
  echo "ci/setup-env.sh: installing torch into $torch_dir (first run takes a few minutes)" >&2
  rm -rf "$torch_dir"
  python3 -m pip install --quiet --disable-pip-version-check --target "$torch_dir" -r "$torch_reqs"
  echo "$want_torch" > "$torch_dir/.oobguard-stamp"
fi

want="$(stamp "$torch_reqs" "$reqs" "$root/pyproject.toml" "$root/tests/e2e/faultinject/pyproject.toml")"
if [[ ! -f "$venv/.oobguard-stamp" || "$(cat "$venv/.oobguard-stamp")" != "$want" ]]; then
  echo "ci/setup-env.sh: building $venv for sglang $version (first run takes a few minutes)" >&2
  rm -rf "$venv"
  python3 -m venv "$venv"
  site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$torch_dir" > "$site/oobguard-shared-torch.pth"  # after the venv's own packages on sys.path
  pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
  "${pip[@]}" -r "$reqs"
  # sglang's own requirements are GPU wheels that cannot install here.
  "${pip[@]}" --no-deps "sglang==$version"
  "${pip[@]}" -e "$root[test]"
  # Test support only: the fault injector the end-to-end tests load as a second plugin.
  "${pip[@]}" -e "$root/tests/e2e/faultinject"
  "$venv/bin/python" -c 'import torch, sys; sys.exit(0 if torch.__file__.startswith(sys.argv[1]) else f"torch in {torch.__file__}, not the shared {sys.argv[1]}")' "$torch_dir"
  echo "$want" > "$venv/.oobguard-stamp"
fi
if [[ "$version" == 0.5.23 ]]; then
  # mooncake's transfer engine (the PD pair's engine test) links Debian's libibverbs and libnl, unpacked
  # into the venv; outside the stamp, so a failed fetch is retried alone. Under CI=true a failure fails here.
  bash "$root/ci/mooncake-libs.sh" "$venv" >&2
fi
echo "$venv"
