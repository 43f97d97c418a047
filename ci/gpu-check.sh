#!/usr/bin/env bash
# The one command of the GPU check, run from the repo root on the GPU machine with
# .gpukit/ carried (bash ci/gpu-kit.sh makes it):
#
#   bash ci/gpu-check.sh            # install the kit, then five parts, then the report
#   bash ci/gpu-check.sh --dry-run  # here, on a CPU: the repo's .venv (or OOBGUARD_PYTHON),
#                                   # no kit; the GPU tests skip, the benchmark runs its dry run
#
# Parts, each with its own hard time limit, each reported whatever the others did:
#   install  the kit's wheels into /tmp/site (--no-deps, beside the machine's torch)
#   env      bench/gpu_report.py env: GPU, versions, pool imports, sglang's JIT kernel
#   tests    pytest tests/test_gpu.py tests/test_gpu_observer.py tests/test_gpu_timing.py -v, junit xml
#   bench    bench/gpu_probe.py --json
#   reads    bench/history_reads.py --gpu: the read kernel per step, batch 1-256 x context 512-8k
#   engine   bench/engine.py --device cuda (a real sgl_kernel only)
# then bench/gpu_report.py write: report.md, report.json (plus junit.xml, env.json,
# bench.json) in OOBGUARD_GPU_REPORT_DIR, else $OUT, else bench/results/.
# The limits add up to 500 s; 400 s where the engine part is skipped (it is, with the kit's
# sgl_kernel stand-in), so the whole check ends in under 9 minutes, under 7 without the engine.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
dry=0
[[ "${1:-}" == --dry-run ]] && dry=1
out="${OOBGUARD_GPU_REPORT_DIR:-${OUT:-$root/bench/results}}"
mkdir -p "$out"
rm -f "$out"/{report.md,report.json,junit.xml,env.json,bench.json}  # never report an earlier run's files
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
export PYTHONUNBUFFERED=1 SGLANG_JIT_CACHE_DIR=/tmp/sglang-jit
# sgl_kernel: sglang imports it at load time on CUDA; its wheel (373 MB) cannot be
# carried, so the test-only stand-in (raises if called) stands in for it.
export PYTHONPATH="$root:$root/tests/standins${PYTHONPATH:+:$PYTHONPATH}"

part() {  # part NAME LIMIT_S COMMAND...: run it under timeout, keep its cmd, rc, seconds and log
  local name="$1" limit="$2" start rc
  shift 2
  echo "=== gpu-check: $name (limit ${limit} s): $*"
  echo "$*" > "$work/$name.cmd"
  start=$(date +%s.%N)
  timeout -k 5 "$limit" "$@" 2>&1 | tee "$work/$name.log"
  rc=${PIPESTATUS[0]}
  echo "$rc" > "$work/$name.rc"
  awk -v a="$start" -v b="$(date +%s.%N)" 'BEGIN {printf "%.1f\n", b - a}' > "$work/$name.seconds"
  echo "=== gpu-check: $name rc=$rc after $(cat "$work/$name.seconds") s"
}

if ((dry)); then
  python="${OOBGUARD_PYTHON:-$root/.venv/bin/python}"
  [[ -x "$python" ]] || python="$(bash ci/setup-env.sh)/bin/python"
  echo "install skipped: dry run, the repo's .venv ($python)" > "$work/install.log"
  echo "(none: dry run)" > "$work/install.cmd"
  bench_args=(--dry-run)
  report_args=(--dry-run)
else
  python=python3
  part install 50 "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .gpukit/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
  bench_args=()
  report_args=()
fi
part env 70 "$python" bench/gpu_report.py env --json "$out/env.json"
part tests 170 "$python" -m pytest tests/test_gpu.py tests/test_gpu_observer.py tests/test_gpu_timing.py -v --junitxml "$out/junit.xml"
part bench 110 "$python" bench/gpu_probe.py "${bench_args[@]}" --json "$out/bench.json"
part reads 60 "$python" bench/history_reads.py --gpu  # the read kernel's time per step (issue 33); no GPU: says so

# Engine benchmark (issue 24): the real sglang Engine on the GPU with sglang's defaults
# (CUDA graphs and the overlap scheduler on), off / upstream's probe alone / the guard
# strict, strict + liveness, warn / the guard + upstream, interleaved round by round
# (bench/engine.py --device cuda). Its forward calls sgl_kernel's compiled ops (RMSNorm,
# activation, rotary), which the kit's stand-in cannot run: where sgl_kernel is the
# stand-in the part is skipped and its log says why. Dry run: the plan, no engine.
engine_cmd=("$python" bench/engine.py --device cuda --batch 8 --new-tokens 256 --layers 8 --rounds 5 --start 6
            --json "$out/engine.json")
real_path="$(tr ':' '\n' <<< "$PYTHONPATH" | grep -vx "$root/tests/standins" | paste -sd: -)"  # no stand-in
if ((dry)); then
  part engine 60 "${engine_cmd[@]}" --dry-run
elif PYTHONPATH="$real_path" "$python" -c \
     'import sgl_kernel, sys; sys.exit("standin" in getattr(sgl_kernel, "__version__", "standin"))' 2>/dev/null; then
  PYTHONPATH="$real_path" part engine 100 "${engine_cmd[@]}"
else
  echo "${engine_cmd[*]}" > "$work/engine.cmd"
  echo "skipped: no real sgl_kernel here (the kit has only the test-only stand-in; the wheel is 373 MB), and" \
    "the engine's CUDA forward calls its compiled ops" | tee "$work/engine.log"
fi

"$python" bench/gpu_report.py write "$work" "$out" "${report_args[@]}"
