"""Test support: run the real sglang Engine on the CPU with the tiny model, generate
greedily for a few concurrent prompts, print one JSON line, shut down. The prompts are
tokenized as one batch, so they are prefilled together and token i of every decode
step belongs to request i on every run.

    python tests/e2e/engine_run.py MODEL_DIR [radix]

`radix`: the liveness workload instead: 44 prompts on 4 shared prefixes, the radix
cache on, a pool of 384 slots (so finished prefixes are evicted to make room) and
32-token prefill chunks.

Run by tests/test_e2e.py in a subprocess; the environment decides guard and fault."""

from __future__ import annotations

import json
import sys

PROMPTS = ["the quick brown fox", "a stale slot id writes", "sglang serves language models", "the radix cache"]
PREFIXES = [" ".join([sentence] * 3) for sentence in ("the quick brown fox jumps over the lazy dog.",
                                                       "a stale slot id writes into the wrong row of the kv cache.",
                                                       "sglang serves language models;",
                                                       "the radix cache shares prompt prefixes between requests.")]
RADIX_PROMPTS = [f"{prefix} request {i}" for prefix in PREFIXES for i in range(11)]
ENGINE = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
              mem_fraction_static=0.05, context_length=512, log_level="info")
WORKLOADS = {
    "batch": (PROMPTS, dict(max_total_tokens=2048, disable_radix_cache=True, enable_tokenizer_batch_encode=True)),
    "radix": (RADIX_PROMPTS, dict(max_total_tokens=384, chunked_prefill_size=32)),
}


def main(model: str, workload: str = "batch") -> int:
    import sglang

    prompts, options = WORKLOADS[workload]
    engine = sglang.Engine(model_path=model, **ENGINE, **options)
    result: dict = {}
    try:
        outs = engine.generate(prompts, {"temperature": 0, "max_new_tokens": 16})
        result["outputs"] = [out.get("output_ids") for out in outs]
        result["finish"] = [out["meta_info"].get("finish_reason") for out in outs]
    except Exception as exc:  # what the engine reports to its caller
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
