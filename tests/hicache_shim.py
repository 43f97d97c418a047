"""Test-only CPU shim for HiCache's host pool (sglang 0.5.23), which does not start on a CPU.

It stands in for two CUDA-only parts, and nothing else:
- `sglang.srt.mem_cache.pool_host.common.ALLOC_MEMORY_FUNCS`: a device type it does not list
  defaults to `alloc_with_host_register`, which registers pinned host memory through CUDA
  ("Found no NVIDIA driver" on this machine). For "cpu" the shim allocates plain host memory
  (`alloc_plain`: pinning, too, needs CUDA).
- `sglang.srt.mem_cache.pool_host.mha.transfer_kv_direct` (and `mla`'s): sgl_kernel's transfer
  ops are imported for CUDA/HIP and XPU only, so the name does not exist on a CPU. The shim's
  is the same copy in torch for `io_backend="direct"`, `layout="layer_first"`: for each layer
  pair, dst[dst_indices] = src[src_indices] (page size 1; a page size above 1 raises).
"""

from __future__ import annotations

import torch


def transfer_kv_direct(src_layers, dst_layers, src_indices: torch.Tensor, dst_indices: torch.Tensor,
                       page_size: int) -> None:
    if page_size != 1:
        raise NotImplementedError("hicache_shim.transfer_kv_direct: page size 1 only")
    for src, dst in zip(src_layers, dst_layers):
        dst[dst_indices] = src[src_indices]


def alloc_plain(dims: tuple, dtype: torch.dtype, device: str, pin_memory: bool, allocator,
                registration_granularity_bytes=None) -> torch.Tensor:
    return torch.empty(dims, dtype=dtype, device=device)


def install(monkeypatch=None) -> None:
    """The shim for one test (pytest's monkeypatch undoes it), or, without one, for the whole
    process (the fault plugin, OOBGUARD_HICACHE_SHIM=1, in an engine's processes)."""
    from sglang.srt.mem_cache.pool_host import common, mha, mla

    if monkeypatch is None:
        common.ALLOC_MEMORY_FUNCS["cpu"] = alloc_plain
        mha.transfer_kv_direct = mla.transfer_kv_direct = transfer_kv_direct
        return
    monkeypatch.setitem(common.ALLOC_MEMORY_FUNCS, "cpu", alloc_plain)
    for module in (mha, mla):
        monkeypatch.setattr(module, "transfer_kv_direct", transfer_kv_direct, raising=False)
