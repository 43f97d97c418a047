"""Test support: run the real sglang Engine on the CPU with the tiny model, generate
greedily for a few concurrent prompts, print one JSON line, shut down. The prompts are
tokenized as one batch, so they are prefilled together and token i of every decode
step belongs to request i on every run.

    python tests/e2e/engine_run.py MODEL_DIR

Run by tests/test_e2e.py in a subprocess; the environment decides guard and fault."""

from __future__ import annotations

import json
import sys

PROMPTS = ["the quick brown fox", "a stale slot id writes", "sglang serves language models", "the radix cache"]


def main(model: str) -> int:
    import sglang

    engine = sglang.Engine(model_path=model, device="cpu", attention_backend="torch_native",
                           sampling_backend="pytorch", disable_cuda_graph=True, max_total_tokens=2048,
                           mem_fraction_static=0.05, context_length=512, log_level="info",
                           disable_radix_cache=True, enable_tokenizer_batch_encode=True)
    result: dict = {}
    try:
        outs = engine.generate(PROMPTS, {"temperature": 0, "max_new_tokens": 16})
        result["outputs"] = [out.get("output_ids") for out in outs]
        result["finish"] = [out["meta_info"].get("finish_reason") for out in outs]
    except Exception as exc:  # what the engine reports to its caller
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
