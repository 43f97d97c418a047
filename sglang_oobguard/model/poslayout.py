"""Position layout: the position sglang rotates each token of a forward at, where the batch
alone says it (sglang 0.5.23, read from its source; measured on the CPU engine).

For token i of request r, the write map's p (`writemap`) is where its slot sits in the
request's req_to_token row; `positions[i]` is where its K is rotated:

- extend / mixed / draft extend: `ForwardBatch.init_new`'s compute_position gives
  extend_prefix_lens[r] + j = p;
- decode: clamp_position(seq_lens) = seq_lens[r] - 1 = p;
- EAGLE draft decode, draft step s (`EagleDraftWorker.draft_forward` adds 1 to positions
  after each step): seq_lens[r] + s on every lane; the write map then finds the slot from
  s, so that a wrong position is reported as a position, not as another request's slot;
- target verify, a chain (EAGLE topk 1): seq_lens[r] + j = p;
- target verify, a tree (EAGLE topk > 1, NGRAM): seq_lens[r] + the token's depth in the
  draft tree, which the tree's own kernel computes: only bounded here, the root exactly
  and every other token within [seq_lens[r], seq_lens[r] + j] (a parent comes before its
  children in the window).

Where the batch does not say it (`NOT_DERIVED`), the check skips the forward by name.
"""

from __future__ import annotations

from typing import Any, Union

EXACT, TREE = 1, 2  # Rule.expect: positions[i] == the token's position; within its tree bounds
KNOWN_SPEC = ("NONE", "EAGLE", "EAGLE3", "STANDALONE", "NEXTN", "NGRAM")  # the layouts above
TREES = "NGRAM"  # always a tree; EAGLE's is one when topk > 1
# What the position check leaves out, and why (doctor's lines; the reasons `layout` gives)
NOT_DERIVED = (
    ("mrope models", "their rotary positions are mrope_positions (3 per token), the model's own"),
    ("encoder-decoder models", "req_to_token counts the encoder's tokens, positions do not"),
    ("dllm", "a denoised block's positions are its own (the write map has no layout for it either)"),
    ("other speculative algorithms", "DFLASH, UNO, DSPARK, FROZEN_KV_MTP, multi-layer EAGLE and plugins' "
                                     "lay out their draft and verify positions their own way"),
    ("an EAGLE draft step whose step is not known", "a draft decode forward is counted by its batch: the "
                                                   "same batch again is the next step (CUDA graphs replay "
                                                   "without ModelRunner.forward, as for the write map)"),
)


def algorithm(runner: Any) -> str:
    """The runner's speculative algorithm's name, upper case ("NONE": none)."""
    spec = getattr(runner, "spec_algorithm", None)
    name = getattr(spec, "name", None)
    if isinstance(name, str):
        return name.upper()
    named = getattr(getattr(runner, "server_args", None), "speculative_algorithm", None)
    return str(named or "NONE").upper()


def layout(family: str, batch: Any, runner: Any, draft_step: int) -> Union[int, str]:
    """EXACT or TREE for this forward of the write map's `family`, or which of
    NOT_DERIVED it is (the caller skips it by that name)."""
    if getattr(getattr(runner, "model_config", None), "model_is_mrope", False):
        return NOT_DERIVED[0][0]
    if getattr(batch, "encoder_lens", None) is not None:
        return NOT_DERIVED[1][0]
    spec = algorithm(runner)
    args = getattr(runner, "server_args", None)
    if spec not in KNOWN_SPEC or getattr(args, "enable_multi_layer_eagle", False):
        return NOT_DERIVED[3][0]
    if family == "draft":
        return EXACT if draft_step >= 0 else NOT_DERIVED[4][0]
    if family == "verify" and (spec == TREES or getattr(args, "speculative_eagle_topk", 1) != 1):
        return TREE
    return EXACT
