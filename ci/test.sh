#!/usr/bin/env bash
# The whole test suite, set-up included: builds .venv on the first run (ci/setup-env.sh).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/ci/setup-env.sh"
cd "$root"
exec "${OOBGUARD_VENV:-$root/.venv}/bin/python" -m pytest "$@"
