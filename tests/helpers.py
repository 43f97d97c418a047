"""Test helpers: the six guarded sites on real sglang pools, and fresh interpreters."""

from __future__ import annotations

import functools
import inspect
import os
import runpy
import subprocess
import sys
from importlib.metadata import version
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch


GUARD_VARS = ("SGLANG_ENABLE_ASYNC_ASSERT", "SGLANG_INVARIANT_CHECK", "SGLANG_OOBGUARD_MODE",
              "SGLANG_OOBGUARD_BACKEND", "SGLANG_OOBGUARD_POLL_EVERY", "SGLANG_OOBGUARD_WARN_INTERVAL_S",
              "SGLANG_OOBGUARD_LIVENESS", "SGLANG_OOBGUARD_REPORT_DIR", "SGLANG_OOBGUARD_OWN_TIME",
              "SGLANG_OOBGUARD_FINITE")
ROOT = Path(__file__).resolve().parent.parent
SGLANG = version("sglang")
# The sites' pool classes that not every release of the matrix has: tag in the label -> class.
FP4_POOLS = {"MHA-FP4": "MHATokenToKVPoolFP4", "MLA-FP4": "MLATokenToKVPoolFP4"}


def shim_old_sglang() -> None:
    """sglang 0.4.x's torch name (tests/standins/releases-0.4/sitecustomize.py, the one copy),
    set in this process, which may not have started with that folder on PYTHONPATH."""
    runpy.run_path(str(ROOT / "tests" / "standins" / "releases-0.4" / "sitecustomize.py"))


# The release facts the tests rely on, in one place: fact -> (how to see it on the
# installed sglang, the release it arrived in). Each is detected on the sglang at hand,
# never inferred from its version number; `needs(fact)` skips a test where it is absent.
MEMORY_POOL = "sglang.srt.mem_cache.memory_pool"
SPECULATIVE = "sglang.kernels.ops.speculative"


def _module(name: str):
    """The module `name`, or None where this sglang has no such module."""
    import importlib
    import importlib.util

    try:
        if importlib.util.find_spec(name) is None:
            return None
    except ModuleNotFoundError:  # a parent package is missing
        return None
    return importlib.import_module(name)


def _has(module: str, path: str) -> Callable[[], bool]:
    """Detects attribute `path` (dotted: Class.method) of `module`."""

    def detect() -> bool:
        target = _module(module)
        for part in path.split("."):
            if target is None or not hasattr(target, part):
                return False
            target = getattr(target, part)
        return True

    return detect


def _kvwriteloc_physical() -> bool:
    """KVWriteLoc's `physical` field (0.5.22): a dataclass field, or a constructor argument."""
    import dataclasses

    cls = getattr(_module(MEMORY_POOL), "KVWriteLoc", None)
    if cls is None:
        return False
    if dataclasses.is_dataclass(cls):
        return "physical" in {field.name for field in dataclasses.fields(cls)}
    return "physical" in inspect.signature(cls).parameters


def _imports_here(module: str) -> Callable[[], bool]:
    """Detects that `module` imports in this process. False only for the known causes
    outside the guard, kept in `detect.failure` for the skip's reason: an AssertionError
    under Triton's interpreter (sglang checking for a compiled Triton function), or a
    missing optional dependency that sglang falls back to on this machine (vllm, on a
    CPU without AMX). Any other failure raises."""

    def detect() -> bool:
        try:
            _module(module)
        except (AssertionError, ModuleNotFoundError) as exc:
            interpreter = isinstance(exc, AssertionError) and os.environ.get("TRITON_INTERPRET")
            optional = isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "vllm"
            if not (interpreter or optional):
                raise
            detect.failure = type(exc).__name__ + (f": {exc}" if str(exc) else "")  # type: ignore[attr-defined]
            return False
        return True

    return detect


@dataclass(frozen=True)
class Fact:
    detect: Callable[[], bool]
    since: str  # the release it arrived in (for the skip's reason; the detection decides); a name in
    # sglang_oobguard.model.transfertargets: read at the skip (importing the guard here would import it
    # in every fresh interpreter that runs SHIM, before the test chose which copy of the guard to import)
    why: str = ""  # the skip's reason where it is absent for another cause than age


FACTS: dict[str, Fact] = {
    # memory_pool
    "MHATokenToKVPoolFP4": Fact(_has(MEMORY_POOL, "MHATokenToKVPoolFP4"), "0.5.8"),
    "MLATokenToKVPoolFP4": Fact(_has(MEMORY_POOL, "MLATokenToKVPoolFP4"), "0.5.8"),
    "NoOpMHATokenToKVPool": Fact(_has(MEMORY_POOL, "NoOpMHATokenToKVPool"), "0.5.12"),
    "maybe_detect_oob": Fact(_has(MEMORY_POOL, "maybe_detect_oob"), "0.5.13"),  # upstream's probe
    "DSATokenToKVPool": Fact(_has(MEMORY_POOL, "DSATokenToKVPool"), "0.5.13"),
    "NSATokenToKVPool.set_index_k_and_scale_buffer": Fact(
        _has(MEMORY_POOL, "NSATokenToKVPool.set_index_k_and_scale_buffer"), "0.5.3",
        "NSATokenToKVPool.set_index_k_and_scale_buffer is the name of 0.5.3 - 0.5.7 (set_index_k_scale_buffer since)"),
    "AscendMLAPagedTokenToKVPool.set_index_k_buffer": Fact(
        _has(MEMORY_POOL, "AscendMLAPagedTokenToKVPool.set_index_k_buffer"), "0.5.3",
        "AscendMLAPagedTokenToKVPool is the NPU MLA pool of 0.5.3 - 0.5.7 (NPUMLATokenToKVPool since)"),
    "KVWriteLoc": Fact(_has(MEMORY_POOL, "KVWriteLoc"), "0.5.14"),
    "MHATokenToKVPool.set_kv_buffer_prefix_valid": Fact(_has(MEMORY_POOL, "MHATokenToKVPool.set_kv_buffer_prefix_valid"),
                                                        "0.5.16"),
    "MLATokenToKVPool._write_loc_dcp_span": Fact(_has(MEMORY_POOL, "MLATokenToKVPool._write_loc_dcp_span"), "0.5.19"),
    "KVWriteLoc.physical": Fact(_kvwriteloc_physical, "0.5.22"),
    "KVCache._check_physical_write_loc": Fact(_has(MEMORY_POOL, "KVCache._check_physical_write_loc"), "0.5.22"),
    # other modules
    "ModelRunner": Fact(_imports_here("sglang.srt.model_executor.model_runner"), "0.4.10",
                        "model_runner does not import in this process, for a cause outside the guard (0.5.3 - 0.5.4: "
                        "its LoRA kernels assert a compiled Triton function, and the tests run Triton's interpreter; "
                        "0.5.6 - 0.5.7: on a CPU without AMX it imports vllm's activations)"),
    "plugin loader": Fact(lambda: _module("sglang.srt.plugins") is not None, "0.5.11"),  # sglang.srt.plugins
    "dsa_cache_layer_split": Fact(lambda: _module("sglang.srt.mem_cache.dsa_cache_layer_split") is not None, "0.5.16"),
    "SWATokenToKVPoolAllocator": Fact(_has("sglang.srt.mem_cache.allocator.swa", "SWATokenToKVPoolAllocator"), "0.5.16"),
    "PureSWATokenToKVPoolAllocator": Fact(_has("sglang.srt.mem_cache.allocator.swa", "PureSWATokenToKVPoolAllocator"),
                                          "0.5.16"),
    "free_swa_out_of_window_slots": Fact(_has("sglang.srt.mem_cache.common", "free_swa_out_of_window_slots"),
                                         "? (checked on 0.5.23)"),
    "ReqKvInfo": Fact(_has("sglang.srt.managers.schedule_batch", "ReqKvInfo"), "? (checked on 0.5.23)"),
    "DeepSeekV4SingleKVPool": Fact(_has("sglang.srt.mem_cache.deepseek_v4_memory_pool", "DeepSeekV4SingleKVPool"),
                                   "0.5.12"),
    "PagedTokenToKVPoolAllocator.free_segment": Fact(  # 0.5.17-0.5.19: it releases pages itself
        _has("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator.free_segment"), "0.5.17"),
    "PagedTokenToKVPoolAllocator.free_page_ids": Fact(
        _has("sglang.srt.mem_cache.allocator", "PagedTokenToKVPoolAllocator.free_page_ids"), "0.5.20"),
    # PD disaggregation's decode side: the queue methods the KV transfer check hooks
    "DecodePreallocQueue._send_kv_metadata": Fact(
        _has("sglang.srt.disaggregation.decode", "DecodePreallocQueue._send_kv_metadata"), "TRANSFER_SINCE"),
    "SchedulerDisaggregationPrefillMixin._send_kv_chunk": Fact(
        _has("sglang.srt.disaggregation.prefill", "SchedulerDisaggregationPrefillMixin._send_kv_chunk"),
        "TRANSFER_SINCE"),
    # every release of a request's KV (the leaks check's double release)
    "release_kv_cache": Fact(_has("sglang.srt.mem_cache.common", "release_kv_cache"), "0.5.10"),
    # HiCache's host pool (the CPU shim tests/hicache_shim.py stands in for its CUDA-only parts)
    "MHATokenToKVPoolHost.load_to_device_per_layer": Fact(
        _has("sglang.srt.mem_cache.pool_host.mha", "MHATokenToKVPoolHost.load_to_device_per_layer"), "HICACHE_SINCE"),
    # the speculative CPU ops the stand-in comparisons (tests/test_standins.py) run
    "assign_req_to_token_pool": Fact(_has("sglang.srt.mem_cache.allocation", "assign_req_to_token_pool"), "0.5.16"),
    "assign_extend_cache_locs": Fact(_has(f"{SPECULATIVE}.cache_locs", "assign_extend_cache_locs"), "0.5.16"),
    "assign_draft_cache_locs_contiguous": Fact(_has(f"{SPECULATIVE}.cache_locs", "assign_draft_cache_locs_contiguous"),
                                               "0.5.16"),
    "fill_bonus_tokens": Fact(_has(f"{SPECULATIVE}.eagle", "fill_bonus_tokens"), "0.5.16"),
    "fill_accept_out_cache_loc": Fact(_has(f"{SPECULATIVE}.eagle", "fill_accept_out_cache_loc"), "0.5.16"),
    "reconstruct_indices_from_tree_mask_triton": Fact(
        _has(f"{SPECULATIVE}.reconstruct_tree", "reconstruct_indices_from_tree_mask_triton"), "0.5.21"),
    "TreeMaskMode": Fact(_has(f"{SPECULATIVE}.spec_tree", "TreeMaskMode"), "0.5.23"),
    "sgl_build_tree_kernel_triton": Fact(_has(f"{SPECULATIVE}.spec_tree", "sgl_build_tree_kernel_triton"), "0.5.23"),
    "verify_tree_greedy_triton": Fact(_has(f"{SPECULATIVE}.spec_tree", "verify_tree_greedy_triton"), "0.5.23"),
}


@functools.lru_cache(maxsize=None)
def has(fact: str) -> bool:
    """Whether the installed sglang has `fact` (a key of FACTS; a KeyError for any other)."""
    return FACTS[fact].detect()


def needs(*facts) -> None:
    """Skip a test that uses release facts this sglang does not have: `needs("KVWriteLoc",
    ...)`, each a key of FACTS. (The older form `needs(obj, name, since)` still works.)"""
    import pytest

    if len(facts) == 3 and not isinstance(facts[0], str):  # needs(obj, name, since)
        obj, name, since = facts
        if not hasattr(obj, name):
            pytest.skip(f"{name} does not exist in sglang {SGLANG} (it arrived in {since})")
        return
    for fact in facts:
        if not has(fact):
            why, failure = FACTS[fact].why, getattr(FACTS[fact].detect, "failure", "")
            if why:
                pytest.skip(f"sglang {SGLANG}: {why}" + (f": {failure}" if failure else ""))
            since = FACTS[fact].since
            if since.endswith("_SINCE"):
                from sglang_oobguard.model import transfertargets

                since = getattr(transfertargets, since)
            pytest.skip(f"sglang {SGLANG} lacks {fact} (it arrived in {since})")


def model_runner_class() -> type:
    """sglang's ModelRunner, the step hook's host, or a skip where this process cannot
    import it (FACTS["ModelRunner"])."""
    needs("ModelRunner")
    from sglang.srt.model_executor.model_runner import ModelRunner

    return ModelRunner


def needs_site(mp, label: str) -> None:
    """Skip a site whose pool class this release does not have (the FP4 pools arrived in 0.5.8)."""
    for tag, name in FP4_POOLS.items():
        if f"({tag})" in label:
            needs(name)


def as_write_loc(mp, loc: torch.Tensor):
    """A KVWriteLoc (0.5.14+) around `loc`, or `loc` itself on older releases."""
    return mp.KVWriteLoc(loc) if hasattr(mp, "KVWriteLoc") else loc


def sglang_can_write(mp, label: str) -> None:
    """Skip where this release lacks the site's pool class, or where sglang's own write
    of that pool fails on the CPU in this release (e.g. the FP4 writes of 0.5.12)."""
    import pytest

    needs_site(mp, label)
    make, method, payload = site_cases(mp)[label]
    pool = make()
    try:
        getattr(pool, method)(Layer(0), torch.tensor([1]), *payload(1))
    except Exception as exc:  # sglang's, not ours: the guard is not installed here
        pytest.skip(f"sglang {SGLANG}'s own {type(pool).__name__}.{method} fails on the CPU: "
                    f"{type(exc).__name__}: {exc}")


class Layer:
    """What a pool reads of sglang's RadixAttention: its layer id."""

    def __init__(self, layer_id: int) -> None:
        self.layer_id = layer_id


# The six sites: (label, class, method, pool factory, payload factory).
def mha(mp, size=64, page_size=1, dtype=torch.float32):
    return mp.MHATokenToKVPool(size, page_size, dtype, 2, 4, 4, "cpu", False)


def decode_batch(loc: torch.Tensor):
    """A decode ForwardBatch of one token per request at `loc` (the step hook's view of a
    step: no req_to_token, so bounds only), its requests named r0, r1, ..."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    size = loc.numel()
    seq_lens = [4] * size
    batch = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=size, input_ids=torch.zeros(size, dtype=torch.int64),
                         req_pool_indices=torch.arange(size), seq_lens=torch.tensor(seq_lens),
                         out_cache_loc=loc, seq_lens_sum=sum(seq_lens))
    batch.seq_lens_cpu, batch.rids = torch.tensor(seq_lens), [f"r{i}" for i in range(size)]
    return batch


def cuda_pool(mp, size: int = 64, layers: int = 4):
    """The GPU tests' pool: sglang's MHA pool on CUDA, bf16, 8 KV heads x 128."""
    return mp.MHATokenToKVPool(size, 1, torch.bfloat16, 8, 128, layers, "cuda", False)


def cuda_kv(n: int) -> torch.Tensor:
    """K or V for n tokens of cuda_pool."""
    return torch.randn(n, 8, 128, dtype=torch.bfloat16, device="cuda")


def swa_pool(page_size: int = 1, size: int = 64, size_swa: int = 32, full_layers=(1, 3)):
    """sglang's SWAKVPool on the CPU: model layers 0 and 2 sliding (size_swa rows), the
    others full (size rows), 2 KV heads x 4."""
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    swa_layers = [i for i in range(4) if i not in full_layers]
    return SWAKVPool(size=size, size_swa=size_swa, page_size=page_size, dtype=torch.float32, head_num=2, head_dim=4,
                     swa_attention_layer_ids=swa_layers, full_attention_layer_ids=list(full_layers), device="cpu",
                     enable_memory_saver=False)


def swa_allocator(pool):
    """sglang's SWATokenToKVPoolAllocator over an SWAKVPool (page-1 or paged sub-allocators)."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

    return SWATokenToKVPoolAllocator(pool.size, pool.size_swa, page_size=pool.page_size, dtype=torch.float32,
                                     device="cpu", kvcache=pool, need_sort=False)


def token_allocator(allocators, pool):
    """sglang's TokenToKVPoolAllocator over `pool` (0.4.x has no need_sort)."""
    cls = allocators.TokenToKVPoolAllocator
    extra = (False,) if "need_sort" in inspect.signature(cls).parameters else ()
    return cls(pool.size, torch.float32, str(pool.device), pool, *extra)


def paged_allocator(allocators, pool):
    cls = allocators.PagedTokenToKVPoolAllocator
    extra = (False,) if "need_sort" in inspect.signature(cls).parameters else ()
    return cls(pool.size, pool.page_size, torch.float32, str(pool.device), pool, *extra)


def site_cases(mp):
    fp4 = torch.float4_e2m1fn_x2
    bf16 = torch.bfloat16

    def kv(n):
        return (torch.randn(n, 2, 4), torch.randn(n, 2, 4))

    def kv32(n):
        return (torch.randn(n, 2, 32, dtype=bf16), torch.randn(n, 2, 32, dtype=bf16))

    def mla_k(n):
        return (torch.randn(n, 1, 32, dtype=bf16), None)

    def mla_parts(n):
        return (torch.randn(n, 1, 16, dtype=bf16), torch.randn(n, 1, 16, dtype=bf16))

    return {
        "set_kv_buffer (MHA)": (lambda: mha(mp), "set_kv_buffer", kv),
        "set_kv_buffer (MHA-FP4)": (lambda: mp.MHATokenToKVPoolFP4(64, 1, fp4, 2, 32, 2, "cpu", False),
                                    "set_kv_buffer", kv32),
        "set_kv_buffer (MLA)": (lambda: mp.MLATokenToKVPool(64, 1, bf16, 16, 16, 2, "cpu", False),
                                "set_kv_buffer", mla_k),
        "set_mla_kv_buffer (MLA)": (lambda: mp.MLATokenToKVPool(64, 1, bf16, 16, 16, 2, "cpu", False),
                                    "set_mla_kv_buffer", mla_parts),
        "set_kv_buffer (MLA-FP4)": (lambda: mp.MLATokenToKVPoolFP4(64, 1, fp4, 16, 16, 2, "cpu", False),
                                    "set_kv_buffer", mla_k),
        "set_mla_kv_buffer (MLA-FP4)": (lambda: mp.MLATokenToKVPoolFP4(64, 1, fp4, 16, 16, 2, "cpu", False),
                                        "set_mla_kv_buffer", mla_parts),
    }


def run_python(code: str, env: dict[str, str | None], timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `code` in a fresh interpreter of this venv with exactly the guard variables
    given; a variable given as None is removed."""
    full = {k: v for k, v in os.environ.items() if k not in GUARD_VARS}
    full.update(env)
    full = {k: v for k, v in full.items() if v is not None}
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


# Python source that a fresh interpreter (or a pytest run of its own) runs first: these
# helpers importable, and sglang 0.4.x's torch shim applied.
SHIM = f"import sys; sys.path.insert(0, {str(ROOT / 'tests')!r}); from helpers import shim_old_sglang; shim_old_sglang()\n"

# Python source for a fresh interpreter: activate the guard the way sglang's own processes
# do on this release (its plugin loader, 0.5.11+; before, the .pth hook at memory_pool's
# first import), then write slot ids {ids} into a real MHATokenToKVPool at layer 1
# (size 64: ids must lie in [0, 65)). Format with ids=[...].
GUARDED_WRITE = SHIM + """
import importlib.util, site, torch
if importlib.util.find_spec("sglang.srt.plugins"):
    from sglang.srt.plugins import load_plugins
    load_plugins()
else:
    site.addsitedir(%r)  # the folder that holds sglang_oobguard.pth
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

class Layer:
    layer_id = 1

pool = MHATokenToKVPool(64, 1, torch.float32, 2, 4, 2, "cpu", False)
k = torch.ones(len({ids}), 2, 4)
pool.set_kv_buffer(Layer, torch.tensor({ids}), k, k)
""" % str(ROOT)


class DecodeSide:
    """sglang's decode-side KV send over a real allocator: a `DecodePreallocQueue` built
    without its constructor (which needs a scheduler, a transfer backend and process
    groups; only the attributes `_send_kv_metadata` reads are set), a real ReqToTokenPool,
    the fake backend's real manager and receivers. `request` allocates a request's slots
    into its row; `send` sends them as the prealloc does (page size 1, no prefix)."""

    def __init__(self, allocator, rows: int = 4, context: int = 32) -> None:
        from types import SimpleNamespace

        from sglang.srt.disaggregation import decode
        from sglang.srt.disaggregation.fake.conn import FakeKVManager
        from sglang.srt.disaggregation.utils import ReqToMetadataIdxAllocator
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        self.decode, self.alloc = decode, allocator
        self.rows = ReqToTokenPool(rows, context, "cpu", False)
        self.queue = object.__new__(decode.DecodePreallocQueue)
        self.queue.__dict__.update(token_to_kv_pool_allocator=allocator, req_to_token_pool=self.rows,
                                   _num_published_destinations=0, transfer_queue=SimpleNamespace(enable_staging=False),
                                   req_to_metadata_buffer_idx_allocator=ReqToMetadataIdxAllocator(1 << 20))
        self.manager = FakeKVManager(None, None, None)

    def request(self, rid: str, row: int, room: int, tokens: int):
        from types import SimpleNamespace

        from sglang.srt.disaggregation.fake.conn import FakeKVReceiver

        slots = self.alloc.alloc(tokens)
        self.rows.req_to_token[row, :tokens] = slots
        req = SimpleNamespace(rid=rid, kv=SimpleNamespace(req_pool_idx=row), origin_input_ids=list(range(tokens)),
                              bootstrap_room=room,
                              time_stats=SimpleNamespace(set_decode_transfer_queue_entry_time=lambda: None))
        return self.decode.DecodeRequest(req=req, kv_receiver=FakeKVReceiver(self.manager, "2.2.2.2", room)), slots

    def send(self, decode_req, ids) -> None:
        self.queue._send_kv_metadata(decode_req, ids, 1, None, decode_prefix_len=0)
