"""Shared fixtures: the real sglang 0.5.23 pool classes on the CPU.

Triton kernels (sglang's own MLA writes, and our probe when forced) run in Triton's
interpreter here, which must be chosen before triton is first imported.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from helpers import GUARD_VARS, Layer, mha, model_runner_class, shim_old_sglang  # noqa: E402

shim_old_sglang()
pytest_plugins = ["pytester"]  # the pytest plugin's own tests (tests/test_pytest_plugin.py)


@pytest.fixture(scope="session")
def mp():
    """sglang's memory_pool module, with the parallel context that MLA writes assert on
    where the release has one (0.5.16 and later; runtime_context itself is older)."""
    import importlib.util

    from sglang.srt.mem_cache import memory_pool

    if importlib.util.find_spec("sglang.srt.runtime_context"):
        from sglang.srt.runtime_context import get_parallel

        context = get_parallel()
        if hasattr(context, "override_permanently"):
            context.override_permanently(attn_dcp_size=1, attn_dcp_rank=0, dcp_enabled=False)
    return memory_pool


@pytest.fixture(autouse=True)
def clean_env(monkeypatch) -> Iterator[None]:
    for name in GUARD_VARS:
        monkeypatch.delenv(name, raising=False)
    yield
    import sglang_oobguard

    sglang_oobguard.uninstall()


@pytest.fixture
def runner(mp, monkeypatch, request):
    """sglang's ModelRunner with the guard's step hook around its forward (tp rank 1); the
    model itself is replaced (test-only) by a loop that writes each of the test module's
    LAYERS layers' KV at the batch's out_cache_loc through the real pool, as the attention
    backends do: ones, or `values(layer, ones)` -> (K, V) where given."""
    ModelRunner = model_runner_class()

    from helpers import as_write_loc

    layers_of_model = getattr(request.module, "LAYERS", 4)

    def make(pool, values=None):
        run = ModelRunner.__new__(ModelRunner)  # no model loaded: only what the hook reads
        run.token_to_kv_pool, run.tp_rank, run.pp_rank, run.dp_rank = pool, 1, 0, 0
        hooked = ModelRunner.__dict__["forward"]
        assert hasattr(hooked, "__wrapped__"), "the guard did not hook ModelRunner.forward"

        def layers(self, batch, *args, **kwargs):
            ones = torch.ones(batch.out_cache_loc.numel(), 2, 4)
            for layer in range(layers_of_model):
                k, v = (ones, ones) if values is None else values(layer, ones)
                self.token_to_kv_pool.set_kv_buffer(Layer(layer), as_write_loc(mp, batch.out_cache_loc), k, v)
            return "output"

        monkeypatch.setattr(hooked, "__wrapped__", layers)
        return run

    return make


@pytest.fixture
def sglang_first_write_made(mp):
    """sglang's first write of a process imports a module lazily, and that import's
    retained frames hold the first write's arguments (its pool, a guarded write's copy
    buffer) for the process: make that first write here, unguarded, in a test that
    checks what outlives its objects."""
    k = torch.ones(1, 2, 4)
    mha(mp).set_kv_buffer(Layer(0), torch.tensor([1]), k, k)


@pytest.fixture
def guard(monkeypatch):
    """install(mode, backend=..., liveness=...) for one test; the autouse fixture uninstalls."""
    import sglang_oobguard

    def _install(mode: str, backend: str = "auto", poll_every: int = 1, liveness: bool = False, finite: bool = False):
        monkeypatch.setenv("SGLANG_OOBGUARD_BACKEND", backend)
        monkeypatch.setenv("SGLANG_OOBGUARD_FINITE", "1" if finite else "0")
        monkeypatch.setenv("SGLANG_OOBGUARD_POLL_EVERY", str(poll_every))
        monkeypatch.setenv("SGLANG_OOBGUARD_LIVENESS", "1" if liveness else "0")
        sglang_oobguard.uninstall()
        return sglang_oobguard.install(mode)

    return _install




# The engine tests' shared runs (tests/test_e2e*.py): one tiny model and one unguarded
# reference of each workload per session, instead of one per test module.

@pytest.fixture(scope="session")
def model(tmp_path_factory):
    from e2e.tiny_model import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def mellum(tmp_path_factory):
    """A tiny sliding-window model (SWAKVPool, SWATokenToKVPoolAllocator)."""
    from helpers import needs

    needs("SWATokenToKVPoolAllocator")
    from e2e.tiny_model import build_tiny_mellum

    return build_tiny_mellum(tmp_path_factory.mktemp("tiny-mellum"))


@pytest.fixture(scope="session")
def clean(model):
    """Guard off, no fault, 4 concurrent prompts: the reference tokens."""
    from e2e.harness import reference_tokens

    return reference_tokens(model, "batch")


@pytest.fixture(scope="session")
def radix_clean(model):
    """Guard off, the 44-request radix workload: the reference tokens."""
    from e2e.harness import reference_tokens

    return reference_tokens(model, "radix")
