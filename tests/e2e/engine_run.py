"""Test support: run the real sglang Engine on the CPU with the tiny model, generate
greedily for a few concurrent prompts, print one JSON line, shut down. The prompts are
tokenized as one batch, so they are prefilled together and token i of every decode
step belongs to request i on every run.

    python tests/e2e/engine_run.py MODEL_DIR [batch|radix] [amx|eagle|ngram] [tp=2]

`radix`: the liveness workload instead: 44 prompts on 4 shared prefixes, the radix
cache on, a pool of 384 slots (so finished prefixes are evicted to make room) and
32-token prefill chunks.

`amx`: plain decoding on the `intel_amx` backend (same platform fact and stand-ins as
below), whose decode op writes K/V itself, outside the pool methods.
`eagle` / `ngram`: speculative decoding, greedy, the tiny model as its own EAGLE
draft (topk 1). Both need the `intel_amx` attention backend (torch_native has no
verify path), which sglang replaces by torch_native on a CPU without AMX unless the
launching process states the platform fact: done here, for this test engine only;
its ops are the test-only stand-ins in tests/standins/sgl_kernel. `tp=2`: two
tensor-parallel ranks, with the two variables that needs on this machine.

Run by tests/test_e2e*.py in a subprocess; the environment decides guard and fault."""

from __future__ import annotations

import json
import os
import sys

PROMPTS = ["the quick brown fox", "a stale slot id writes", "sglang serves language models", "the radix cache"]
PREFIXES = [" ".join([sentence] * 3) for sentence in ("the quick brown fox jumps over the lazy dog.",
                                                       "a stale slot id writes into the wrong row of the kv cache.",
                                                       "sglang serves language models;",
                                                       "the radix cache shares prompt prefixes between requests.")]
RADIX_PROMPTS = [f"{prefix} request {i}" for prefix in PREFIXES for i in range(11)]
ENGINE = dict(device="cpu", attention_backend="torch_native", sampling_backend="pytorch", disable_cuda_graph=True,
              mem_fraction_static=0.05, context_length=512, log_level="info")
SPEC = {
    "eagle": dict(speculative_algorithm="EAGLE", speculative_num_steps=2, speculative_eagle_topk=1,
                  speculative_num_draft_tokens=3),
    "ngram": dict(speculative_algorithm="NGRAM", speculative_ngram_capacity=100_000),
}
WORKLOADS = {
    "batch": (PROMPTS, dict(max_total_tokens=2048, disable_radix_cache=True, enable_tokenizer_batch_encode=True)),
    "radix": (RADIX_PROMPTS, dict(max_total_tokens=384, chunked_prefill_size=32)),
    # three concurrent requests (ownership faults: token 0's request, the next one, and one untouched)
    "three": (PROMPTS[:3], dict(max_total_tokens=2048, disable_radix_cache=True, enable_tokenizer_batch_encode=True)),
    # chunked prefill mixed with the running decodes (ForwardMode.MIXED): 16-token chunks
    "mixed": (RADIX_PROMPTS[::4], dict(max_total_tokens=2048, chunked_prefill_size=16, enable_mixed_chunk=True,
                                       disable_radix_cache=True)),
    # a pool too small for what the scheduler admits (aggressive admission): decode runs out, sglang retracts
    "retract": (RADIX_PROMPTS, dict(max_total_tokens=384, disable_radix_cache=True, schedule_conservativeness=0.01)),
}


def engine_options(model: str, workload: str, extra: list[str]) -> dict:
    options = {**ENGINE, **WORKLOADS[workload][1]}
    for arg in extra:
        if arg == "amx":  # plain decoding on intel_amx: its decode op writes K/V itself
            options.update(attention_backend="intel_amx", mem_fraction_static=0.3)
        elif arg in SPEC:
            options.update(SPEC[arg], attention_backend="intel_amx", mem_fraction_static=0.3)
            if arg == "eagle":
                options["speculative_draft_model_path"] = model
        elif arg.startswith("tp="):
            options["tp_size"] = int(arg[3:])
            # one NUMA node here, so each rank's OpenMP threads are bound by hand; and an
            # unloadable NCCL, or the CUDA build of torch turns PyNccl on for the CPU ranks
            # ("Expected a cuda device"): all-reduce then goes over gloo
            os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(map(str, range(options["tp_size"]))))
            os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
        else:
            raise SystemExit(f"engine_run.py: unknown option {arg!r}; expected amx, eagle, ngram or tp=N")
    return options


def main(model: str, workload: str = "batch", *extra: str) -> int:
    import sglang

    options = engine_options(model, workload, list(extra))
    if options["attention_backend"] == "intel_amx":
        from sglang.srt.runtime_context import override_platform

        override_platform(has_amx=True).install()  # this process's fact, read when the server args resolve
    engine = sglang.Engine(model_path=model, **options)
    result: dict = {}
    try:
        outs = engine.generate(WORKLOADS[workload][0], {"temperature": 0, "max_new_tokens": 16})
        result["outputs"] = [out.get("output_ids") for out in outs]
        result["finish"] = [out["meta_info"].get("finish_reason") for out in outs]
        result["spec_verify_ct"] = sum(out["meta_info"].get("spec_verify_ct") or 0 for out in outs)
    except Exception as exc:  # what the engine reports to its caller
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
