#!/usr/bin/env bash
# Debian's libibverbs1, libnl-3-200 and libnl-route-3-200, which mooncake's non-CUDA transfer
# engine links (the PD pair test, tests/test_e2e_pd_pair.py: CI's only real KV transport), unpacked
# into VENV/mooncake-libs (or $OOBGUARD_MOONCAKE_LIBS), not installed system-wide.
#   bash ci/mooncake-libs.sh VENV
# Idempotent: nothing is fetched where the libraries are there already (or installed system-wide).
# Where they cannot be fetched (`apt-get download` failed: no Debian archive, no network), it says
# what is missing and how to get it; under CI (CI=true) it then exits 1, since the test would
# only skip and CI would stay green without it. Elsewhere it exits 0 and the test skips by name.
set -euo pipefail
venv="${1:?usage: ci/mooncake-libs.sh VENV}"
libs="${OOBGUARD_MOONCAKE_LIBS:-$venv/mooncake-libs}"
packages=(libibverbs1 libnl-3-200 libnl-route-3-200)
sonames=(libibverbs.so.1 libnl-3.so.200 libnl-route-3.so.200)

missing() {  # the sonames found neither under $libs nor in the system's linker cache
  local cache name
  cache="$(ldconfig -p 2> /dev/null || true)"
  for name in "${sonames[@]}"; do
    if [[ -z "$(find "$libs" -name "$name" -print -quit 2> /dev/null)" ]] && ! grep -qF " $name " <<< "$cache"; then
      echo "$name"
    fi
  done
}

[[ -z "$(missing)" ]] && exit 0
debs="$(mktemp -d)"
trap 'rm -rf "$debs"' EXIT
if (cd "$debs" && apt-get download "${packages[@]}" > "$debs/apt.log" 2>&1); then
  mkdir -p "$libs"
  for deb in "$debs"/*.deb; do dpkg -x "$deb" "$libs"; done
fi
lacking="$(missing | xargs)"
[[ -z "$lacking" ]] && exit 0
why="$(grep -v '^\s*$' "$debs/apt.log" 2> /dev/null | tail -1 || true)"
{
  echo "ci/mooncake-libs.sh: mooncake's transfer engine (the PD pair test) needs $lacking, not found in $libs"
  echo "  nor installed: \`apt-get download ${packages[*]}\` failed${why:+ ($why)}."
  echo "  To get them: run \`apt-get update\` and rerun ci/setup-env.sh; or \`apt-get install ${packages[*]}\`;"
  echo "  or unpack those Debian packages (dpkg -x) into a folder and set OOBGUARD_MOONCAKE_LIBS to it."
} >&2
case "${CI:-}" in
  true | TRUE | True | 1 | yes)
    echo "ci/mooncake-libs.sh: CI=$CI: failing the set-up; without them tests/test_e2e_pd_pair.py would only skip" >&2
    exit 1 ;;
esac
echo "ci/mooncake-libs.sh: tests/test_e2e_pd_pair.py skips here (under CI=true this fails the set-up)" >&2
