"""Test support: run the real sglang Engine on the CPU with the tiny model, generate
greedily for a few concurrent prompts, print one JSON line, shut down. The prompts are
tokenized as one batch, so they are prefilled together and token i of every decode
step belongs to request i on every run.

    python tests/e2e/engine_run.py MODEL_DIR [batch|radix] [amx|eagle|ngram] [tp=2]
    python tests/e2e/engine_run.py MODEL_DIR serve [batch=8] [tokens=128] [contexts=512,4096] [cuda]
    python tests/e2e/engine_run.py MODEL_DIR decode [abort]
    python tests/e2e/engine_run.py MODEL_DIR random SEED [page=P]

Any workload also takes `page=P`, `chunk=N` (chunked_prefill_size), `pool=N`
(max_total_tokens), `radix=off` and `overlap=off` (the clean matrix's dimensions), and after
`eagle`, `steps=N` and `drafts=N` (speculative_num_steps, speculative_num_draft_tokens).

`decode`: PD disaggregation's decode side, fake transfer backend (see `decode`).

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

`random SEED` (tests/e2e/random_load.py): a seeded random workload with shared prefixes,
random lengths and max_new_tokens, aborts in flight and a small pool; outputs by rid.

`serve` (bench/engine.py): one engine that stays up and times rounds on command.
`batch=B` distinct prompts, greedy, `tokens=N` new tokens each (EOS ignored, so every
request makes exactly N). It warms up (one untimed round), prints `READY`, then for
each `round` line on stdin times two generate calls over the same prompts, N new
tokens and then 1 (the prefill and its one sampled token), and prints `ROUND {json}`
with both times (wall clock, and the CPU seconds of the engine's processes) and the
tokens; `quit` shuts the engine down. The scheduler sleeps when idle (`sleep_on_idle`),
so engines waiting their turn take no CPU from the one timed.
`contexts=C1,C2,...`: long contexts instead (bench/engine.py's cost per check): each
request's prompt is C token ids, one shared prefix of C - 1 (the same ids at every C)
and an id of its own, with the radix cache on, so the prefix is prefilled once (in the
warm-up: one request at the longest C, then the batch at every C) and each decode step
reads about C tokens per request. A `round batch=B context=C` line times B requests at
context C (B at most the engine's batch=, C one of its contexts).
`cuda`: sglang's defaults on a GPU instead of the CPU engine (CUDA graphs and the
overlap scheduler on; Triton attention, pytorch sampling).

Run by tests/test_e2e*.py in a subprocess; the environment decides guard and fault."""

from __future__ import annotations

import json
import os
import sys
from importlib.metadata import version

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
    # a sliding-window model (tests/e2e/tiny_model.py's Mellum): radix cache, 16-token prefill chunks and a pool
    # small enough that SWA slots leave the window, prefixes are evicted and requests retracted
    "swa": (RADIX_PROMPTS, dict(max_total_tokens=512, chunked_prefill_size=16)),
    "serve": ([], dict(disable_radix_cache=True, enable_tokenizer_batch_encode=True, sleep_on_idle=True)),
    # PD disaggregation's decode side with the fake transfer backend (no prefill engine): a pool of 128
    # slots, so that pages freed early are handed out again soon (`decode` below)
    "decode": (PROMPTS, dict(disaggregation_mode="decode", disaggregation_transfer_backend="fake",
                             disaggregation_decode_retraction_backup="cpu_tensor", max_total_tokens=128,
                             num_reserved_decode_tokens=8, disable_radix_cache=True)),
    # HiCache on the CPU (tests/hicache_shim.py through the fault plugin): `hicache` below
    "hicache": ([], dict(enable_hierarchical_cache=True, hicache_io_backend="direct", hicache_mem_layout="layer_first",
                         hicache_ratio=2.0,  # explicit: sized from free host memory it fails under load
                         max_total_tokens=768, chunked_prefill_size=512)),
    # tests/e2e/random_load.py: prompts and aborts drawn from the seed (the argument after the workload)
    "random": ([], dict(max_total_tokens=256, chunked_prefill_size=32, schedule_conservativeness=0.01)),
}
# the clean matrix's dimensions, on any workload: option=value -> the engine's setting
SETTINGS = {"page": ("page_size", int), "chunk": ("chunked_prefill_size", int), "pool": ("max_total_tokens", int),
            "radix": ("disable_radix_cache", lambda value: value == "off"),
            "overlap": ("disable_overlap_schedule", lambda value: value == "off"),
            "steps": ("speculative_num_steps", int), "drafts": ("speculative_num_draft_tokens", int)}
# `decode abort`: a 60-token request aborted 0.6 s after it was sent, then three of 24-34 tokens, more than
# the pool has left: the last takes pages the aborted one gave back
DECODE_ABORT = [" ".join([PROMPTS[i]] * n) for i, n in ((1, 12), (0, 8), (2, 8), (3, 8))]
# serve on a GPU: sglang's defaults (CUDA graphs, overlap scheduler), minus the backends
# that need wheels a bare GPU machine lacks (flashinfer; sgl_kernel's sampling)
CUDA = dict(attention_backend="triton", sampling_backend="pytorch", mem_fraction_static=0.1, log_level="info")


def serve_prompts(batch: int) -> list[str]:
    """`batch` distinct prompts of similar length (the batch workload's, numbered)."""
    return [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(batch)]


def engine_options(model: str, workload: str, extra: list[str]) -> dict:
    options = {**ENGINE, **WORKLOADS[workload][1]}
    if workload == "serve":
        batch, tokens = serve_size(extra)
        longest = max(serve_contexts(extra), default=0)
        # the pool is max_total_tokens; a larger static fraction only keeps sglang's start-up check (weights
        # against *available* memory) from failing when other work has taken memory: 0.05 did at 1.7 GB free
        options.update(max_total_tokens=max(2048, 2 * batch * (tokens + 32)), max_running_requests=batch,
                       context_length=max(512, tokens + 64), mem_fraction_static=0.5)
        if longest:  # the finished requests' tokens stay in the radix tree: room for many rounds before eviction
            options.update(max_total_tokens=longest + 32 * batch * (tokens + 2), context_length=longest + tokens + 64,
                           disable_radix_cache=False)
        if "cuda" in extra:
            options = {key: value for key, value in options.items() if key not in ("device", "disable_cuda_graph")}
            options.update(CUDA, cuda_graph_max_bs=batch)
        extra = [arg for arg in extra if arg != "cuda" and not arg.startswith(("batch=", "tokens=", "contexts="))]
    for arg in extra:
        if arg == "amx":  # plain decoding on intel_amx: its decode op writes K/V itself
            options.update(attention_backend="intel_amx", mem_fraction_static=0.3)
        elif arg in SPEC:
            options.update(SPEC[arg], attention_backend="intel_amx", mem_fraction_static=0.3)
            if arg == "eagle":
                options["speculative_draft_model_path"] = model
        elif arg == "abort" and workload == "decode":
            pass
        elif arg.partition("=")[0] in SETTINGS:  # page=P, chunk=N, pool=N, radix=off, overlap=off
            name, _, value = arg.partition("=")
            setting, parse = SETTINGS[name]
            options[setting] = parse(value)
        elif workload == "random" and arg.isdigit():  # its seed
            pass
        elif arg.startswith("tp="):
            options["tp_size"] = int(arg[3:])
            # one NUMA node here, so each rank's OpenMP threads are bound by hand; and an
            # unloadable NCCL, or the CUDA build of torch turns PyNccl on for the CPU ranks
            # ("Expected a cuda device"): all-reduce then goes over gloo
            os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", "|".join(map(str, range(options["tp_size"]))))
            os.environ.setdefault("SGLANG_NCCL_SO_PATH", "/nonexistent/libnccl.so")
        else:
            raise SystemExit(f"engine_run.py: unknown option {arg!r}; expected amx, eagle, ngram, tp=N, page=P, "
                             "chunk=N, pool=N, radix=off or overlap=off (serve: batch=B, tokens=N, cuda; random: SEED)")
    if version("sglang").startswith("0.4."):  # its batch encode calls TokenizerManager._validate_token_len, which
        options.pop("enable_tokenizer_batch_encode", None)  # 0.4.10.post2 lacks: one prompt at a time there
    return options


def serve_size(extra: list[str]) -> tuple[int, int]:
    values = {"batch": 8, "tokens": 128}
    for arg in extra:
        name, _, value = arg.partition("=")
        if name in values and value:
            values[name] = int(value)
    return values["batch"], values["tokens"]


def serve_contexts(extra: list[str]) -> list[int]:
    return [int(c) for arg in extra if arg.startswith("contexts=") for c in arg[len("contexts="):].split(",") if c]


def long_prompts(batch: int, context: int) -> list[list[int]]:
    """`batch` prompts of `context` token ids: one shared prefix (the same ids at every
    context, seeded), then an id of each request's own."""
    import random

    from tiny_model import VOCAB

    draw = random.Random(0)
    prefix = [draw.randrange(2, VOCAB) for _ in range(context - 1)]
    return [prefix + [2 + i % (VOCAB - 2)] for i in range(batch)]


def serve(engine, extra: list[str]) -> dict:
    """Rounds on command (stdin), one ROUND line each; see the module's docstring."""
    import time

    batch, tokens = serve_size(extra)
    contexts = serve_contexts(extra)
    prompts = serve_prompts(batch)

    import psutil

    me = psutil.Process()

    def cpu() -> float:
        """user + system seconds of this process and its children (scheduler, detokenizer)."""
        total = 0.0
        for proc in [me, *me.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                total += times.user + times.system
            except psutil.Error:
                pass
        return total

    def generate(new: int, size: int = batch, context: int = 0) -> tuple[float, float, list]:
        params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
        start, start_cpu = time.perf_counter(), cpu()
        if context:
            outs = engine.generate(input_ids=long_prompts(size, context), sampling_params=params)
        else:
            outs = engine.generate(prompts[:size], params)
        return time.perf_counter() - start, cpu() - start_cpu, outs

    for context in sorted(contexts, reverse=True) or [0]:  # warm-up, an untimed round each: first-call costs
        if context:  # (allocations, lazy imports) out of the rounds; the shared prefix prefilled once, longest first
            generate(1, 1, context)
        generate(tokens, batch, context)
        generate(1, batch, context)
    print("READY", flush=True)
    rounds = 0
    for line in sys.stdin:
        command, *asked = line.split() or [""]
        if command != "round":
            break
        size = dict(arg.split("=") for arg in asked)
        size, context = int(size.get("batch", batch)), int(size.get("context", 0))
        full, full_cpu, outs = generate(tokens, size, context)
        prefill, prefill_cpu, _ = generate(1, size, context)
        rounds += 1
        print("ROUND " + json.dumps({
            "round": rounds, "full_s": full, "prefill_s": prefill, "full_cpu_s": full_cpu, "prefill_cpu_s": prefill_cpu,
            "batch": size, "context": context, "tokens": tokens,
            "completion_tokens": [out["meta_info"].get("completion_tokens") for out in outs],
            "e2e_latency": [out["meta_info"].get("e2e_latency") for out in outs],
            "outputs": [out.get("output_ids") for out in outs]}), flush=True)
    return {"rounds": rounds}


def decode(engine, abort: bool) -> dict:
    """PD decode with the fake backend: every request carries the fake bootstrap host (one without
    kills the fake-mode scheduler) and a bootstrap room; outputs by rid (the first token is a hash of
    the rid: the pages hold no prefill KV). `abort`: DECODE_ABORT[0] as "victim", aborted 0.6 s after
    it was sent, then the other three at once."""
    import asyncio

    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    params = {"temperature": 0, "max_new_tokens": 8}

    def one(prompt: str, rid: str, room: int):
        return engine.async_generate(prompt, params, rid=rid, bootstrap_host=FAKE_BOOTSTRAP_HOST, bootstrap_room=room)

    async def run() -> list:
        if not abort:
            return await asyncio.gather(*(one(p, f"d{i}", 10 + i) for i, p in enumerate(PROMPTS)))
        victim = asyncio.ensure_future(one(DECODE_ABORT[0], "victim", 100))
        await asyncio.sleep(0.6)
        engine.tokenizer_manager.abort_request(rid="victim")
        followers = [one(p, f"follower{i}", 200 + i) for i, p in enumerate(DECODE_ABORT[1:])]
        return await asyncio.gather(victim, *followers, return_exceptions=True)

    outs = asyncio.get_event_loop().run_until_complete(run())
    return {"by_rid": {out["meta_info"]["id"]: out.get("output_ids") for out in outs if isinstance(out, dict)},
            "finish": {out["meta_info"]["id"]: out["meta_info"].get("finish_reason") for out in outs
                       if isinstance(out, dict)},
            "errors": [repr(out) for out in outs if not isinstance(out, dict)]}


def hicache(engine) -> dict:
    """A 400-token prompt, four more that evict it from the device pool (backed up to the host
    pool first), then the first again (rid "again") while another request ("runner", 96 tokens,
    EOS ignored) decodes: loaded back from the host beside a running request. Greedy; tokens and
    cached tokens of each of the six answers, and the runner's tokens."""
    import asyncio

    first = " ".join([PREFIXES[0]] * 12)
    others = [" ".join([prefix] * 12) for prefix in PREFIXES[1:]] + [" ".join([PREFIXES[2], PREFIXES[1]] * 6)]
    params = {"temperature": 0, "max_new_tokens": 8}
    outs = [engine.generate(prompt, params) for prompt in [first, *others]]

    async def beside() -> list:
        runner = await engine.async_generate("hierarchical caching keeps evicted prefixes in host memory",
                                             {"temperature": 0, "max_new_tokens": 96, "ignore_eos": True},
                                             rid="runner", stream=True)
        chunks = [await runner.__anext__(), await runner.__anext__()]  # its prefill, then a decode step
        again = asyncio.ensure_future(engine.async_generate(first, params, rid="again"))
        chunks += [chunk async for chunk in runner]
        return [await again, chunks[-1]]

    again, runner = asyncio.get_event_loop().run_until_complete(beside())
    outs.append(again)
    return {"outputs": [out["output_ids"] for out in outs],
            "cached": [out["meta_info"].get("cached_tokens") for out in outs],
            "prompt": [out["meta_info"].get("prompt_tokens") for out in outs],
            "runner": runner["output_ids"], "runner_finish": runner["meta_info"].get("finish_reason")}


def _main_loop() -> None:
    """sglang 0.4.x's Engine.generate asks for the main thread's event loop, which its uvloop
    policy no longer makes on first use (the later releases make their own): one is set here."""
    import asyncio

    try:
        asyncio.get_event_loop()
    except RuntimeError:
        asyncio.set_event_loop(asyncio.new_event_loop())


def main(model: str, workload: str = "batch", *extra: str) -> int:
    import sglang

    options = engine_options(model, workload, list(extra))
    if options["attention_backend"] == "intel_amx":
        from sglang.srt.runtime_context import override_platform

        override_platform(has_amx=True).install()  # this process's fact, read when the server args resolve
    engine = sglang.Engine(model_path=model, **options)
    _main_loop()
    result: dict = {}
    try:
        if workload == "serve":
            result.update(serve(engine, list(extra)))
        elif workload == "decode":
            result.update(decode(engine, "abort" in extra))
        elif workload == "hicache":
            result.update(hicache(engine))
        elif workload == "random":
            from random_load import run_random

            result.update(run_random(engine, int(next(arg for arg in extra if arg.isdigit()))))
        else:
            outs = engine.generate(WORKLOADS[workload][0], {"temperature": 0, "max_new_tokens": 16})
            result["outputs"] = [out["output_ids"] if "output_ids" in out else out["text"] for out in outs]  # 0.4.x: text
            result["finish"] = [out["meta_info"].get("finish_reason") for out in outs]
            result["spec_verify_ct"] = sum(out["meta_info"].get("spec_verify_ct") or 0 for out in outs)
    except Exception as exc:  # what the engine reports to its caller
        result["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if os.environ.get("SGLANG_OOBGUARD_REPORT_DIR"):  # a server idles before it is stopped: the schedulers'
            import time  # idle method files their counts (sglang's shutdown kills them; tests/test_e2e_clean.py)

            time.sleep(1.5)
        engine.shutdown()
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
