#!/usr/bin/env bash
# Gather .gpukit/: the wheels the GPU machine (Python 3.12, x86-64, torch 2.11.0+cu130,
# triton 3.6.0, transformers 5.17.0, no network) lacks for ci/gpu-check.sh, pinned in
# ci/gpu-kit.txt. Prints the kit's size plus the tracked tree's and fails over 64 MiB
# (what one device call may carry).
#
#   bash ci/gpu-kit.sh            # .gpukit/ (cp312 manylinux wheels)
#   bash ci/gpu-kit.sh --verify   # also the same set as cp311 wheels, installed with
#                                 # --no-deps beside torch 2.11 on this CPU machine:
#                                 # import the pool modules, run pool tests
#
# What was found (sglang 0.5.23, read in its source and run on this machine's CPU):
# - sglang 0.5.23 is the release: it is what the CPU matrix tests in full, and its
#   memory_pool, allocator and async_probe import and run beside torch 2.11.0,
#   torchvision 0.26.0, transformers 5.17.0 and triton 3.6.0 although it pins torch
#   2.14.1 (--verify shows it). Its wheel is platform-specific (rust extensions,
#   37 MiB of the kit).
# - On CUDA the import chain also reaches `sgl_kernel` (module-level `if _is_cuda:`
#   imports in quantization and fused_moe modules). Its wheel (sglang-kernel 0.4.10)
#   is 373 MB, far over what a call carries, so gpu-check.sh puts the repo's
#   test-only stand-in (tests/standins/sgl_kernel: raises if called) on PYTHONPATH;
#   no pool write or allocator path calls it. --verify imports the pools with CUDA
#   simulated on this CPU, with the stand-in.
# - MHATokenToKVPool.set_kv_buffer on CUDA goes through _set_kv_buffer_impl, which asks
#   can_use_store_cache(): a JIT build of sglang.kernels' store_cache
#   (csrc/elementwise/kvcache.cuh) by load_jit: tvm-ffi's headers and libtvm_ffi (the
#   apache-tvm-ffi wheel), nvcc from CUDA_HOME or PATH, ninja and a host C++
#   compiler; no download, so it can work offline (the image has nvcc 13.0 and
#   ninja). It caches under SGLANG_JIT_CACHE_DIR (gpu-check.sh: /tmp/sglang-jit).
#   If the build fails sglang logs a warning and falls back to index_put, whose
#   get_is_capture_mode import reaches sglang.srt.model_executor.runner, hence openai,
#   xgrammar and partial-json-parser in the kit. gpu-check.sh's environment part
#   reports which path ran and how long the build took.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
limit=$((64 * 1024 * 1024))

download() {  # download PYTHON_VERSION DEST: every wheel of ci/gpu-kit.txt, no deps
  local platforms=() n
  for n in 34 28 27 24 17; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$1" --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$2" -r "$root/ci/gpu-kit.txt" 2> >(grep -v "^WARNING: Location" >&2)
}

kit="$root/.gpukit"
rm -rf "$kit"
download 3.12 "$kit"
kit_bytes=$(stat -c %s "$kit"/*.whl | awk '{s += $1} END {print s}')
tree_bytes=$(cd "$root" && git ls-files -z | xargs -0 stat -c %s 2>/dev/null | awk '{s += $1} END {print s}')
total=$((kit_bytes + tree_bytes))
ls -1 "$kit"
awk -v n="$(ls "$kit"/*.whl | wc -l)" -v k="$kit_bytes" -v t="$tree_bytes" 'BEGIN {
  m = 1048576; printf "gpu-kit: %d wheels, %.1f MiB; tracked tree %.1f MiB; total %.1f MiB (limit 64 MiB)\n", n, k / m, t / m, (k + t) / m }'
if ((total > limit)); then
  echo "gpu-kit: over the 64 MiB a device call carries" >&2
  exit 1
fi
[[ "${1:-}" == --verify ]] || exit 0

# --verify: a throwaway venv like the device's Python (3.11 here), then the kit's
# packages as cp311 wheels installed the way gpu-check.sh installs them.
venv="${OOBGUARD_GPUKIT_VENV:-$root/.venv-gpukit}"
if [[ ! -x "$venv/bin/python" ]]; then
  python3 -m venv "$venv"
  # What the device's image has, at its versions where they matter; pip fetches torch's
  # CUDA 13 libraries from PyPI (about 3 GB).
  "$venv/bin/python" -m pip install -q torch==2.11.0 torchvision==0.26.0 transformers==5.17.0 triton==3.6.0 \
    aiohttp requests psutil pyyaml pillow sentencepiece einops rich click httpx numpy pytest hypothesis wrapt
fi
scratch="$(mktemp -d)"
trap 'rm -rf "$scratch"' EXIT
download 3.11 "$scratch/kit"
"$venv/bin/python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$scratch/site" \
  "$scratch"/kit/*.whl
export PYTHONPATH="$scratch/site:$root"
"$venv/bin/python" -W ignore - <<'EOF'
import sglang, torch, transformers, triton
import sglang.srt.mem_cache.allocator, sglang.srt.mem_cache.memory_pool, sglang.srt.model_executor.runner
import sglang.srt.utils.async_probe
print(f"gpu-kit verify: sglang {sglang.__version__} pools import beside torch {torch.__version__}, "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
EOF
# The same imports as sglang makes them on CUDA (is_cuda() true; torch's device queries
# answered as an H200's), with the sgl_kernel stand-in that gpu-check.sh uses.
PYTHONPATH="$PYTHONPATH:$root/tests/standins" "$venv/bin/python" -W ignore - <<'EOF'
import sys
import torch

class H200:
    major, minor, name, total_memory, multi_processor_count, gcnArchName = 9, 0, "H200", 141 << 30, 132, ""

torch.cuda.is_available = lambda: True
torch.cuda.device_count = lambda: 1
torch.cuda.current_device = lambda: 0
torch.cuda.get_device_capability = lambda *a, **k: (9, 0)
torch.cuda.get_device_name = lambda *a, **k: "H200 (simulated)"
torch.cuda.get_device_properties = lambda *a, **k: H200()
import sglang.srt.mem_cache.allocator, sglang.srt.mem_cache.memory_pool, sglang.srt.model_executor.runner
from sglang.srt.utils.common import is_cuda

assert is_cuda(), "the simulation did not take"
print(f"gpu-kit verify: the same imports under simulated CUDA, sgl_kernel from {sys.modules['sgl_kernel'].__file__}")
EOF
# The host-path pool tests. The cases that force our kernel into triton 3.6's CPU
# interpreter are left out: that interpreter fails on its `range(0, n, BLOCK)` loop
# ("only 0-dimensional arrays can be converted to Python scalars"), a CPU-only path.
"$venv/bin/python" -m pytest -q -k "not triton" tests/test_sites.py tests/test_liveness.py tests/test_gpu.py
