"""TEST-ONLY stand-in for `sgl_kernel`, sglang's compiled CUDA kernel package.

No sgl_kernel wheel runs on a CPU (the PyPI builds need libcuda.so.1), yet sglang
imports names from it at load time (the engine; 0.5.10's and 0.4.x's CPU write
paths). ci/gpu-check.sh uses it on the GPU machine too: there sglang 0.5.23's pool
modules import it under CUDA, and the real wheel (sglang-kernel 0.4.10, 373 MB) is
too big to carry; no pool write or allocator path there calls it. Every name here
raises NotImplementedError when called (see _standin), except the pure-torch CPU ops
that speculative decoding on the CPU engine needs (spec_ops, attention_ops,
speculative: each test-only, each raising for the modes it does not implement). Put
on PYTHONPATH for test processes only, never installed.
"""

from _standin import stand_in

from . import attention_ops  # noqa: F401  (registers torch.ops.sgl_kernel.{extend,decode}_attention_cpu)
from .spec_ops import (  # noqa: F401
    assign_draft_cache_locs_contiguous_cpu,
    assign_extend_cache_locs_cpu,
    assign_req_to_token_pool_cpu,
    build_draft_decode_metadata_cpu,
    build_tree_kernel_efficient_cpu,
    copy_all_layer_kv_cache_cpu,
    fill_accept_out_cache_loc_cpu,
    fill_bonus_tokens_cpu,
    verify_tree_greedy_cpu,
)

__version__ = "0.0.0+cpu-test-standin"
stand_in(__name__)
