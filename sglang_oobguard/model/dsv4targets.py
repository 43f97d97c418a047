"""DeepSeek-V4 targets: the DeepSeek-V4 pools' bound, and the writes of the family not guarded by a rule.

Part of the targets table (`targets` imports the bound for its DeepSeek-V4 rules,
`discover` the rest), beside `swatargets` and `transfertargets`: sglang serves
DeepSeek-V4 from `deepseek_v4_memory_pool`, whose leaf pools hold pages of token rows
and whose HiSparse device pool (`HiSparseC4DevicePool`, a `DeepSeekV4SingleKVPool`)
translates its ids and passes them on.
"""

from __future__ import annotations


def dsv4_slots(pool: object) -> int:
    """The leaf pools' bound: every layer's buffer holds deepseek_v4_memory_pool's
    _num_dsv4_physical_kv_pages(size, page_size, global_page_size) pages of token rows."""
    page = int(getattr(pool, "page_size"))
    rows = int(getattr(pool, "size")) + int(getattr(pool, "global_page_size", page) or page)
    return -(-rows // page) * page


# The family's write methods that take no ids of their own to bound, with why (doctor names them so).
DSV4_FORWARDED: dict[tuple[str, str], str] = {
    ("HiSparseC4DevicePool", method): f"translates its ids to the device pool's rows and passes them on to "
                                      f"DeepSeekV4SingleKVPool.{method}, guarded there"
    for method in ("set_key_buffer", "set_key_buffer_fused")}
# DeepSeek-V4's composite pool writes through sub-pools and fused kernels whose id spaces
# (compressed ratios, per-request windows) have not been read yet: named, with why.
DSV4_UNREAD = "DeepSeek-V4 composite pool: compressed / per-request-window id spaces not read yet (no bound rule)"
