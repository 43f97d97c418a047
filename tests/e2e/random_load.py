"""Test support: a seeded random workload for the real sglang Engine (engine_run.py's
`random SEED`), run guarded and unguarded by tests/test_e2e_clean.py.

From the seed: 24 requests, each a shared prefix (one of four) cut at a random length
plus a random tail, so prompts share radix prefixes and leave pages half-filled; a
random max_new_tokens (1-24, EOS ignored); and about one in five aborted in flight,
after a random number (1-4) of its streamed chunks. The pool (engine_run.py: 384 slots,
32-token prefill chunks) is small enough that sglang evicts and retracts. Every request
is sent at once. Outputs are keyed by rid; an aborted request's are left out (where it
stops depends on timing), and so is any request whose run ended another way than by
its length.

A failure names its seed; `python tests/e2e/engine_run.py MODEL random SEED` reproduces it.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

from engine_run import PREFIXES

WORDS = "the quick brown fox jumps over a stale slot id in the radix cache of language models".split()
REQUESTS = 24


def draw(seed: int) -> list[dict[str, Any]]:
    """The seed's requests: rid, prompt, max_new_tokens, and after how many chunks it is aborted (0: never)."""
    rng = random.Random(seed)
    requests = []
    for i in range(REQUESTS):
        prefix = rng.choice(PREFIXES).split()
        words = prefix[:rng.randint(2, len(prefix))] + [rng.choice(WORDS) for _ in range(rng.randint(0, 12))]
        requests.append({"rid": f"s{seed}-{i}", "prompt": " ".join(words), "new": rng.randint(1, 24),
                         "abort_after": rng.randint(1, 4) if rng.random() < 0.2 else 0})
    return requests


def run_random(engine: Any, seed: int) -> dict[str, Any]:
    """Serve the seed's requests at once; {"by_rid": tokens of each request that ran to its length, "aborted": rids}."""
    requests = draw(seed)

    async def one(request: dict[str, Any]) -> tuple[str, Any]:
        params = {"temperature": 0, "max_new_tokens": request["new"], "ignore_eos": True}
        if not request["abort_after"]:
            return request["rid"], await engine.async_generate(request["prompt"], params, rid=request["rid"])
        stream = await engine.async_generate(request["prompt"], params, rid=request["rid"], stream=True)
        chunks = 0
        async for _ in stream:
            chunks += 1
            if chunks == request["abort_after"]:
                engine.tokenizer_manager.abort_request(rid=request["rid"])
        return request["rid"], None

    async def run() -> list:
        return await asyncio.gather(*(one(request) for request in requests), return_exceptions=True)

    outs = asyncio.get_event_loop().run_until_complete(run())
    by_rid, errors = {}, []
    for out in outs:
        if isinstance(out, BaseException):
            errors.append(repr(out))
            continue
        rid, answer = out
        if answer is not None and (answer["meta_info"].get("finish_reason") or {}).get("type") == "length":
            by_rid[rid] = answer["output_ids"]
    return {"seed": seed, "by_rid": by_rid, "aborted": [r["rid"] for r in requests if r["abort_after"]],
            "errors": errors}
