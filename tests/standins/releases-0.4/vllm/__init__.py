"""TEST-ONLY stand-in for `vllm`, whose compiled custom ops sglang 0.4.x's layers
import at module level on a CPU without CUDA or AMX (`vllm._custom_ops`, layernorm
and activation classes). No vllm wheel runs on a CPU here. Every name raises
NotImplementedError when called (see _standin); the pool-level tests of the 0.4.x
cell call none. Put on PYTHONPATH for test processes only, never installed.
"""

from _standin import stand_in

stand_in(__name__)
