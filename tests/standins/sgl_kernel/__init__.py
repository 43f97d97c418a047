"""TEST-ONLY stand-in for `sgl_kernel`, sglang's compiled CUDA kernel package.

No sgl_kernel wheel runs on a CPU (the PyPI builds need libcuda.so.1), yet sglang
imports names from it at load time (the engine; 0.5.10's and 0.4.x's CPU write
paths). Every name here raises NotImplementedError when called (see _standin). Put
on PYTHONPATH for test processes only, never installed.
"""

from _standin import stand_in

__version__ = "0.0.0+cpu-test-standin"
stand_in(__name__)
