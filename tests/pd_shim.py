"""Test-only CPU shim for the PD prefill side over mooncake (sglang 0.5.23), which does not send on a CPU.

It stands in for one CUDA-only part, and nothing else:
- `sglang.srt.disaggregation.mooncake.conn.MooncakeKVSender.supports_host_tensor_indices`
  (True upstream). With it, `SchedulerDisaggregationPrefillMixin._send_kv_chunk` copies the
  page ids into pinned host memory and records a `torch.cuda.Event` for the transfer worker
  to wait on ("Found no NVIDIA driver" on this machine: the prefill scheduler dies at its first
  send). Set to False, `_send_kv_chunk` takes its other path, upstream's too: the page ids
  computed on the host (`kv_to_page_indices`) and handed to the same `send`.
"""

from __future__ import annotations


def install() -> None:
    """For the whole process (the fault plugin, OOBGUARD_PD_SHIM=1, in an engine's processes)."""
    from sglang.srt.disaggregation.mooncake import conn

    conn.MooncakeKVSender.supports_host_tensor_indices = False
