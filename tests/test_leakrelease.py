"""Release completeness (`checks.leakrelease`, issue #44 item 1) against sglang's own paged
allocator: what a free group holds back until free_group_end counts as freed, in both of
the forms sglang keeps it (token ids in `free_group`; 0.5.20+, page ids in
`free_page_ids_group`), and nothing once the group ends. Without the page-id form, every
release inside the overlap scheduler's free group at page size > 1 looked like a leak (the
clean matrix's page 4, 16 and 64 rows, 2026-12-07). The check itself runs in the engine:
tests/test_e2e_leaks.py (a release that frees nothing, strict and warn) and the clean matrix."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from helpers import has, mha, paged_allocator
from sglang_oobguard.checks.leakrelease import _pending

PAGE = 4


def test_a_free_group_s_token_and_page_ids_count_as_freed_until_it_ends(mp):
    from sglang.srt.mem_cache import allocator as allocators

    allocator = paged_allocator(allocators, mha(mp, size=64, page_size=PAGE))
    tree = SimpleNamespace(token_to_kv_pool_allocator=allocator)  # what the check reads of a tree here
    ids = allocator.alloc(4 * PAGE)
    pages = sorted({int(i) // PAGE for i in ids})
    assert len(pages) == 4 and _pending(tree, PAGE).size == 0
    allocator.free_group_begin()
    allocator.free(ids[:PAGE])  # token ids: the group's free() form
    expected = {pages[0]}
    if has("PagedTokenToKVPoolAllocator.free_page_ids"):
        allocator.free_page_ids(torch.tensor([pages[2]], dtype=torch.int64))  # page ids (free_kv_row's segments)
        expected.add(pages[2])
    assert set(_pending(tree, PAGE).tolist()) == expected
    allocator.free_group_end()
    assert _pending(tree, PAGE).size == 0
