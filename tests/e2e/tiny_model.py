"""Test support: a tiny randomly initialised Llama (or sliding-window Mellum) and a locally
trained byte-level BPE tokenizer, saved to a directory (no download is possible on the
test machines). Seeded, so every build is the same model."""

from __future__ import annotations

import json
from pathlib import Path

VOCAB = 1000
_TEXT = ("the quick brown fox jumps over the lazy dog. a stale slot id writes into the wrong row of the kv cache. "
         "sglang serves language models; the radix cache shares prompt prefixes between requests. ") * 50


def build_tiny_llama(path: Path, layers: int = 2, positions: int = 512) -> Path:
    """Build once per directory; later calls return at once. `positions`: the longest
    context it serves (max_position_embeddings)."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    _tokenizer(path)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=positions,
                         bos_token_id=0, eos_token_id=1, torch_dtype="float32", tie_word_embeddings=False,
                         initializer_range=0.5)  # large weights: a corrupted KV row visibly changes tokens
    _save(LlamaForCausalLM(config), path)
    return path


def build_tiny_mellum(path: Path) -> Path:
    """A sliding-window model sglang serves from SWAKVPool with SWATokenToKVPoolAllocator:
    4 layers, sliding / full / sliding / full, a window of 8 tokens, dense MLPs."""
    path = Path(path)
    if (path / "config.json").exists() and (path / "tokenizer.json").exists():
        return path
    import torch
    from transformers import MellumConfig, MellumForCausalLM

    _tokenizer(path)
    torch.manual_seed(0)
    config = MellumConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          layer_types=["sliding_attention", "full_attention"] * 2, sliding_window=8,
                          mlp_layer_types=["dense"] * 4, num_local_experts=2, num_experts_per_tok=1,
                          moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          max_position_embeddings=512, bos_token_id=0, eos_token_id=1, torch_dtype="float32",
                          tie_word_embeddings=False, initializer_range=0.5)
    _save(MellumForCausalLM(config), path)
    return path


def _tokenizer(path: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB - 3, special_tokens=["<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_TEXT], trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.save_pretrained(path)


def _save(model, path: Path) -> None:
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))


if __name__ == "__main__":
    import sys

    build = build_tiny_mellum if sys.argv[2:] == ["mellum"] else build_tiny_llama
    print(build(Path(sys.argv[1])))
