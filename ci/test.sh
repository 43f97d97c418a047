#!/usr/bin/env bash
# The whole test suite, set-up included, on each release of the matrix: the full suite
# on sglang 0.5.23, then on each older release in ci/matrix the guard's unit and loader
# tests (no benchmarks, no GPU-check dry run) and the engine with every check on
# (tests/test_e2e_releases.py). Arguments go to every pytest run (and leave out the
# older releases' engine run).
# OOBGUARD_MATRIX="0.5.23" runs one cell.
#
# Two at a time: the runs are jobs, taken in order by two workers (xargs -P), each job
# building its release's venv first if it is missing (the 0.5.23 venv, and with it the
# shared torch, is built before any job starts). A pytest process is mostly one busy
# core, so two jobs fill this 2-core machine. Without arguments the 0.5.23 cell is three
# jobs: its engine tests and benchmarks (-m "(e2e or bench) and not matrix"), the clean
# matrix (-m matrix) and the rest (-m "not e2e and not bench"): together exactly the full suite. Each job's output is printed whole
# when it ends (OOBGUARD_JOBS_DIR keeps the logs), then a table of every job's result
# and minutes; any job failing fails the run. OOBGUARD_WORKERS=1 runs them one by one.
# Every job runs with OMP_NUM_THREADS=1 unless it is set: with two OpenMP threads per
# process and both cores busy, torch's parallel ops wait on descheduled threads.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"

job_log() {  # job_log VERSION MARKERS: the job's log path, without suffix
  echo "$OOBGUARD_JOBS_DIR/$1${2:+.$(tr -c 'a-z0-9' '-' <<< "$2" | sed 's/-*$//')}"
}

run_job() {  # run_job VERSION MARKERS [pytest args]: set-up, then pytest
  local version="$1" markers="$2" venv standins
  shift 2
  # one set-up at a time: two at once could both find torch's stamp changed and both reinstall it
  venv="$(flock "$OOBGUARD_JOBS_DIR/.setup.lock" bash ci/setup-env.sh "$version")" || return
  echo "=== sglang $version ($venv)${markers:+ -m \"$markers\"}"
  if [[ "$version" == 0.5.23 ]]; then
    "$venv/bin/python" -m pytest --durations=12 ${markers:+-m "$markers"} "$@"
  else  # older releases import sgl_kernel (0.4.x also vllm) on the CPU write path: test-only stand-ins
    standins="$root/tests/standins"
    [[ "$version" == 0.4.* ]] && standins="$standins:$root/tests/standins/releases-0.4"
    export PYTHONPATH="$standins${PYTHONPATH:+:$PYTHONPATH}"
    if [[ "$markers" != engine ]]; then
      "$venv/bin/python" -m pytest -m "${markers:-not e2e and not bench}" "$@" || return
      (($#)) && return  # an argument narrowed the run: no engine
    fi
    # the engine on this release with every check on, the guard installed as a user installs it (issue #43)
    "$venv/bin/python" -m pytest -m e2e tests/test_e2e_releases.py "$@"
  fi
}

if [[ "${1:-}" == --job ]]; then  # one job, as the workers below run it: --job [pytest args] VERSION MARKERS
  version="${*: -2:1}" markers="${*: -1}"
  args=("${@:2:$#-3}")
  log="$(job_log "$version" "$markers")"
  start=$(date +%s)
  rc=0
  run_job "$version" "$markers" "${args[@]}" > "$log.log" 2>&1 || rc=$?
  seconds=$(($(date +%s) - start))
  # CPU seconds (user + system) of everything the job ran and waited for: bash's `times`, children's line
  times > "$log.times"  # in this shell, not a pipeline's subshell (whose children's times start at zero)
  cpu=$(tail -1 "$log.times" | awk '{gsub(/s/, ""); split($1, u, "m"); split($2, s, "m"); printf "%d", u[1] * 60 + u[2] + s[1] * 60 + s[2]}')
  printf '%s\t%s\t%s\n' "$rc" "$seconds" "$cpu" > "$log.result"
  {  # whole, never interleaved with the other worker's output
    flock 9
    cat "$log.log"
    echo "=== sglang $version${markers:+ -m \"$markers\"}: rc=$rc after $((seconds / 60)) m $((seconds % 60)) s"
  } 9> "$OOBGUARD_JOBS_DIR/.print.lock"
  exit $((rc == 0 ? 0 : 1))
fi

matrix="${OOBGUARD_MATRIX:-$(grep -v '^#' ci/matrix | xargs)}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
export OOBGUARD_JOBS_DIR="${OOBGUARD_JOBS_DIR:-$(mktemp -d)}"
mkdir -p "$OOBGUARD_JOBS_DIR"
rm -f "$OOBGUARD_JOBS_DIR"/*.result
began=$(date +%s)
first="${matrix%% *}"
bash ci/setup-env.sh "${first%%:*}" > /dev/null  # torch (shared by every venv) and the first venv, before any job
jobs=()  # VERSION<TAB>MARKERS, longest first
for entry in $matrix; do  # VERSION, or VERSION:engine (that release's engine tests alone)
  version="${entry%%:*}"
  if [[ "$entry" == *:engine ]]; then
    jobs+=("$version	engine")
  elif [[ "$version" == 0.5.23 ]]; then
    if (($#)); then jobs+=("$version	"); else
      jobs+=("$version	(e2e or bench) and not matrix" "$version	matrix" "$version	not e2e and not bench"); fi
  else
    jobs+=("$version	")
  fi
done
echo "=== ci/test.sh: ${#jobs[@]} jobs, ${OOBGUARD_WORKERS:-2} at a time (set-up $(($(date +%s) - began)) s); logs in $OOBGUARD_JOBS_DIR"
status=0
printf '%s\n' "${jobs[@]}" | tr '\t' '\n' | xargs -d '\n' -n 2 -P "${OOBGUARD_WORKERS:-2}" bash "$0" --job "$@" \
  || status=1
echo "=== ci/test.sh: every job (rc, wall, CPU user + system), $(( ($(date +%s) - began) / 60 )) m $(( ($(date +%s) - began) % 60 )) s in all"
for job in "${jobs[@]}"; do
  version="${job%%	*}" markers="${job#*	}"
  result="$(job_log "$version" "$markers").result"
  if [[ -f "$result" ]]; then
    IFS=$'\t' read -r rc seconds cpu < "$result"
    printf '  sglang %-13s %-24s rc=%s  %d m %02d s, CPU %d m %02d s (%s cores)\n' "$version" "${markers:-all}" "$rc" \
      $((seconds / 60)) $((seconds % 60)) $((cpu / 60)) $((cpu % 60)) "$(awk -v c="$cpu" -v s="$seconds" 'BEGIN {printf "%.2f", c / (s > 0 ? s : 1)}')"
  else
    printf '  sglang %-13s %-24s did not run\n' "$version" "${markers:-all}"
    status=1
  fi
done
exit "$status"
