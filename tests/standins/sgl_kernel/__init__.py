"""TEST-ONLY stand-in for `sgl_kernel`, sglang's compiled CUDA kernel package.

No sgl_kernel wheel runs on a CPU (the PyPI builds need libcuda.so.1), yet sglang
imports names from it at load time (the engine; 0.5.10's and 0.4.x's CPU write
paths). ci/gpu-check.sh uses it on the GPU machine too: there sglang 0.5.23's pool
modules import it under CUDA, and the real wheel (sglang-kernel 0.4.10, 373 MB) is
too big to carry; no pool write or allocator path there calls it. Every name here
raises NotImplementedError when called (see _standin). Put on PYTHONPATH for test
processes only, never installed.
"""

from _standin import stand_in

__version__ = "0.0.0+cpu-test-standin"
stand_in(__name__)
