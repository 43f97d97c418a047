"""TEST-ONLY, pure-torch stand-in for `sgl_kernel.speculative`: the one op sglang
0.5.23's NGRAM worker imports from it on a CPU, `reconstruct_indices_from_tree_mask`.
Follows the contract sglang states for its Triton twin (kernels/ops/speculative/
reconstruct_tree.py); tests/test_standins.py checks it against that twin. Any other
name of the module raises NotImplementedError when called (the package's stand-in).
Put on PYTHONPATH for test processes only, never installed.
"""

from __future__ import annotations

import torch
from _standin import missing_names


def reconstruct_indices_from_tree_mask(tree_mask: torch.Tensor, verified_seq_len: torch.Tensor,
                                       positions: torch.Tensor, retrieve_index: torch.Tensor,
                                       retrieve_next_token: torch.Tensor, retrieve_next_sibling: torch.Tensor,
                                       batch_size: int, draft_token_num: int) -> None:
    """From request b's [n, n] ancestor mask (mask[i, j]: j is an ancestor of i, j < i):
    positions = depth + verified_seq_len, retrieve_index = b * n + i, first child and
    next sibling (-1 where none; a root has no sibling)."""
    n = draft_token_num
    below = torch.ones(n, n, dtype=torch.bool).tril(-1)
    nodes = torch.arange(n)
    for b in range(batch_size):
        ancestors = tree_mask.view(batch_size, n, n)[b].bool() & below
        parent = torch.where(ancestors, nodes, -1).amax(dim=1)
        first_child = torch.where(ancestors, nodes[:, None], n).amin(dim=0)
        later_sibling = (parent[:, None] == parent[None, :]) & (nodes[:, None] > nodes[None, :])
        sibling = torch.where(later_sibling, nodes[:, None], n).amin(dim=0)
        rows = slice(b * n, (b + 1) * n)
        positions.view(-1)[rows] = ancestors.sum(dim=1) + verified_seq_len[b]
        retrieve_index.view(-1)[rows] = nodes + b * n
        retrieve_next_token.view(-1)[rows] = torch.where(first_child < n, first_child, -1)
        retrieve_next_sibling.view(-1)[rows] = torch.where((parent >= 0) & (sibling < n), sibling, -1)


missing_names(__name__)
