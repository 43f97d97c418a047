#!/usr/bin/env bash
# The main job, set-up included: a stale slot id in a real sglang KV pool, on this CPU.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$(bash "$root/ci/setup-env.sh")"
cd "$root"
exec "$venv/bin/python" -W ignore -m sglang_oobguard demo "$@"
