"""Finite: what the value check (SGLANG_OOBGUARD_FINITE) reads besides the pool methods.

A pool write method's values are read from its own signature (`checks.values.value_params`:
the floating arguments after its ids). A fused writer (`targets.FUSED_WRITERS`) is named
here by function: the arguments whose values it stores, or, where the guard cannot see
what it stores, why (`doctor` says it). Standard library only, as all of `model`.
"""

from __future__ import annotations

# The value dtypes the GPU value check reads: the model's, compiled at a pool's warm-up; a
# part of another dtype is left to a WARNING (doctor says so; the host scan reads FP8 too).
VALUE_DTYPES = ("float16", "bfloat16", "float32")

# function -> (position, name) of each argument whose values it stores
WRITER_VALUES: dict[str, tuple[tuple[int, str], ...]] = {
    "apply_rope_inplace_with_kvcache": ((1, "k"), (2, "v")),  # RoPE rotates K: a NaN or Inf stays one
    "fused_fp8_qkv_kv_cache": ((1, "k"), (2, "v"), (6, "k_scale"), (7, "v_scale")),
    "fused_store_index_k_cache": ((0, "key"),),
    "set_mla_kv_concat_q": ((2, "cache_k_nope"), (3, "cache_k_rope")),
    "set_mla_kv_concat_q_fp8": ((2, "cache_k_nope"), (3, "cache_k_rope")),
}
# function -> why its stored values are not seen
UNSEEN: dict[str, str] = {
    "fused_fp8_set_kv_buffer": "its value arguments were not read from 0.5.10 - 0.5.12 for this check",
    "fused_k_indexer_norm_rope_store": "it stores the LayerNorm + RoPE of its input, made inside the kernel",
}


def stored_values(function: str, names: list[str]) -> tuple[tuple[int, str], ...]:
    """The table's (position, name) pairs for `function`, where its signature (`names`, its
    parameters in order) has each name at its position; a release whose signature differs
    gets none: its values are not seen (`doctor` says so), never read at a wrong place."""
    table = WRITER_VALUES.get(function, ())
    return table if all(at < len(names) and names[at] == name for at, name in table) else ()
