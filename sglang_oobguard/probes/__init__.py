"""Probes: the host scan, the Triton kernels, the shadow, the record and its read-back, per-pool buffers, the device seam."""
