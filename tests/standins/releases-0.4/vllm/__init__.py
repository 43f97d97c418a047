"""TEST-ONLY stand-in for `vllm`, which sglang 0.4.x imports on a CPU without CUDA or AMX:
its compiled custom ops at module level (`vllm._custom_ops`), and in the engine its
logger and its layernorm and activation layers (sglang's own need sgl_kernel or AMX). No
vllm wheel runs on a CPU here. Every name raises NotImplementedError when called (see
_standin), except the few the CPU engine calls: `vllm.logger`, and the layers of
`vllm.model_executor.layers` (layernorm, activation) as plain torch, the math of vLLM's
own `forward_native`. Put on PYTHONPATH for test processes only, never installed.
"""

from _standin import stand_in

stand_in(__name__)
