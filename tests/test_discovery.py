"""Every KV write method that discovery finds on the installed sglang release.

One test per discovered (method, id parameter): a valid id and an out-of-range one,
and the guard must agree with the oracle [0, high) of that method's own bound rule.
Then the rules around it: pools that write nothing are left alone, methods with no
rule are named, a super() call is probed once, wrapper pools are checked at their
own door, and classes that sglang defines after install are guarded too.
"""

from __future__ import annotations

import gc
import inspect
import logging
import traceback

import pytest
import torch

import sglang_oobguard
from helpers import SGLANG, Layer, mha, needs
from sglang_oobguard import KVOutOfBoundsError
from sglang_oobguard.probes import kernels
from sglang_oobguard.model.discover import Found, Skipped, import_pool_modules
from sglang_oobguard.model.discover import coverage
from sglang_oobguard.model.violation import site_label

import_pool_modules()  # every pool module that imports here, so that discovery sees every class
ENTRIES = coverage()
CASES = [(e, k) for e in ENTRIES if isinstance(e, Found) for k in range(len(e.rule.ids))]

# What the bound rules read: distinct values, so that a rule reading the wrong one fails.
BOUND_ATTRS = {"size": 61, "page_size": 4, "size_swa": 29, "index_size": 40, "index_page_size": 4,
               "index_page_padding": 2}


def bare(cls: type):
    """An instance of the real sglang class with its storage not built (most of these
    pools need a GPU, an NPU or a model config to build), carrying the attributes the
    bound rules read. The guard decides at the door, before sglang's body runs: a
    valid call enters the body (and stops at its first use of storage), a bad call
    never does. Real pools are written to in the tests further down."""
    pool = object.__new__(cls)
    pool.__dict__.update(BOUND_ATTRS)
    return pool


def args_for(found: Found, bad_at: int, value: int) -> list:
    """Every required positional argument: the layer, valid ids (1), `value` at id
    parameter `bad_at`; payloads None (never reached when bad)."""
    rule = found.rule
    params = list(inspect.signature(found.original).parameters.values())[1:]
    required = [p for p in params if p.default is p.empty and p.kind is p.POSITIONAL_OR_KEYWORD]
    positions = [ids.position for ids in rule.ids] + [p for p in (rule.layer, rule.lens) if p is not None]
    args: list = [None] * max(max(positions) + 1, len(required))
    if found.layer_name is not None:
        args[rule.layer] = 1 if found.layer_name == "layer_id" else Layer(1)
    for number, ids in enumerate(rule.ids):
        ident = value if number == bad_at else 1
        args[ids.position] = torch.tensor([[ident]]) if rule.lens is not None else torch.tensor([ident])
    if rule.lens is not None:
        args[rule.lens] = torch.tensor([1], dtype=torch.int32)
    return args


def entered(exc: BaseException, function) -> bool:
    return any(frame.f_code is function.__code__ for frame, _ in traceback.walk_tb(exc.__traceback__))


@pytest.mark.parametrize("found,bad_at", CASES, ids=[f"{e.qualname}-{e.id_names[k]}" for e, k in CASES])
def test_each_discovered_method_agrees_with_the_oracle(mp, guard, found, bad_at):
    guard("raise")
    pool = bare(found.owner)
    method = getattr(pool, found.method)
    high = found.rule.ids[bad_at].bound.high(pool)
    # size + page_size, size_swa + page_size, the NPU index span (DCP span 1), DeepSeek-V4's whole pages
    assert high in (65, 33, 48, 68)
    with pytest.raises(KVOutOfBoundsError) as info:
        method(*args_for(found, bad_at, high))
    error = info.value
    assert (error.label, error.value, error.high, error.pos) == (site_label(found.sites[bad_at]), high, high, 0)
    assert error.layer == (-1 if found.layer_name is None else 1)
    assert not entered(error, found.original)  # refused before sglang's own code ran
    for good in (0, high - 1):
        try:
            method(*args_for(found, bad_at, good))
        except KVOutOfBoundsError as exc:
            pytest.fail(f"valid id {good} refused: {exc}")
        except Exception as exc:  # sglang's body ran and stopped at the storage a bare pool lacks
            assert entered(exc, found.original), exc
    assert sglang_oobguard.violations() and all(v.value == high for v in sglang_oobguard.violations())


def test_pools_that_write_nothing_are_left_alone(mp, guard):
    needs("NoOpMHATokenToKVPool")
    alone = {e.qualname: e.reason for e in ENTRIES if isinstance(e, Skipped) and e.by_design}
    assert alone["NoOpMHATokenToKVPool.set_kv_buffer"] == "raises RuntimeError by design"
    assert alone["NoOpMHATokenToKVPool.move_kv_cache"] == "does nothing by design"
    guard("strict")
    for method in ("set_kv_buffer", "move_kv_cache"):
        assert not hasattr(mp.NoOpMHATokenToKVPool.__dict__[method], "__wrapped__")


def test_methods_without_a_rule_are_named_at_activation(mp, guard, caplog):
    unruled = [e for e in ENTRIES if isinstance(e, Skipped) and not e.by_design]
    if not unruled:
        pytest.skip(f"every write method of sglang {SGLANG} has a rule")
    caplog.set_level(logging.INFO, logger="sglang_oobguard")
    guard("strict")
    (line,) = [r.getMessage() for r in caplog.records if "not guarded:" in r.getMessage()]
    for entry in unruled:
        assert f"{entry.qualname} ({entry.reason})" in line
        assert not hasattr(entry.owner.__dict__[entry.method], "__wrapped__")


def count_launches(monkeypatch) -> list:
    launches: list = []
    real = kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda *a, **k: (launches.append(a[2]), real(*a, **k))[1])
    return launches


def test_super_call_with_the_same_ids_is_probed_once(mp, guard, monkeypatch):
    """DSATokenToKVPool.move_kv_cache calls super().move_kv_cache(tgt_loc, src_loc):
    two guarded methods, one probe per id parameter."""
    needs("DSATokenToKVPool")
    try:
        pool = mp.DSATokenToKVPool(64, 64, 16, torch.bfloat16, 16, 2, "cpu", 128, False, 32)
    except TypeError as exc:
        pytest.skip(f"DSATokenToKVPool's constructor differs in sglang {SGLANG}: {exc}")
    guard("raise", backend="triton")
    launches = count_launches(monkeypatch)
    assert "move_kv_cache" in type(pool).__dict__ and "move_kv_cache" in mp.MLATokenToKVPool.__dict__
    # Token slots 1 and 0 (and tgt 1 below): valid ids, and also rows of the index-K buffer, which has one
    # row per page (2 rows here). sglang 0.5.13-0.5.22's move copies index-K rows at the
    # token ids themselves (memory_pool.py / index_key_cache.py `index_k[tgt_loc_flat] =
    # index_k[src_loc_flat]`), its own bug, fixed in 0.5.23 (page and offset of each token):
    # there, valid token ids 3 and 2 raise IndexError inside sglang after our probes pass.
    pool.move_kv_cache(torch.tensor([1]), torch.tensor([0]))
    assert [site_label(s) for s in launches] == ["move_kv_cache tgt_loc", "move_kv_cache src_loc"]
    with pytest.raises(KVOutOfBoundsError, match=r"move_kv_cache src_loc: 1 of 1 slot ids outside \[0, 128\)"):
        pool.move_kv_cache(torch.tensor([1]), torch.tensor([200]))
        sglang_oobguard.check()


OLDER_INDEX_K = {  # 0.5.3 - 0.5.7's index-K writes: (pool factory, payload, the buffer list it writes)
    "NSATokenToKVPool.set_index_k_and_scale_buffer": (
        lambda mp: mp.NSATokenToKVPool(64, 64, 128, torch.bfloat16, 16, 2, "cpu", 128, False),  # 0.5.5+: kv_lora_rank % 128 == 0
        lambda n: (torch.randn(n, 128).to(torch.float8_e4m3fn), torch.ones(n, 1)), "index_k_with_scale_buffer"),
    "AscendMLAPagedTokenToKVPool.set_index_k_buffer": (
        lambda mp: mp.AscendMLAPagedTokenToKVPool(112, 16, torch.bfloat16, 16, 16, 128, 2, "cpu", False),
        lambda n: (torch.randn(n, 128, dtype=torch.bfloat16),), "index_k_buffer"),
}


@pytest.mark.parametrize("fact", OLDER_INDEX_K)
def test_the_older_index_k_writes_are_guarded(mp, guard, fact):
    """Token ids, paged inside (the rule of their later names): a bad id is stopped
    before anything is written; an in-range one reaches sglang's own write, which
    needs a GPU (NSA's Triton kernel) or an NPU (torch_npu): here it fails inside
    sglang, never in the guard."""
    needs(fact)
    make, payload, buffers = OLDER_INDEX_K[fact]
    cls, method = fact.split(".")
    guard("strict")
    pool = make(mp)
    high = pool.size + pool.page_size  # 128 in both: the rows of the index-K buffer
    before = [b.clone() for b in getattr(pool, buffers)]
    with pytest.raises(KVOutOfBoundsError, match=rf"{method} \({cls}\) layer 0: 1 of 2 slot ids outside "
                                                 rf"\[0, {high}\): loc\[1\] = {high}"):
        getattr(pool, method)(0, torch.tensor([5, high]), *payload(2))
    assert all(torch.equal(x, y) for x, y in zip(before, getattr(pool, buffers)))
    try:
        getattr(pool, method)(0, torch.tensor([5, high - 1]), *payload(2))
    except KVOutOfBoundsError:
        raise
    except Exception:  # sglang's own write, on a machine without its device
        pass


def test_classes_defined_after_install_are_guarded_and_released(mp, guard, monkeypatch, caplog, sglang_first_write_made):
    """Pool modules load after the plugin runs: KVCache.__init_subclass__ catches them."""
    caplog.set_level(logging.INFO, logger="sglang_oobguard")
    guard("raise", backend="triton")

    class LaterPool(mp.MHATokenToKVPool):
        def set_kv_buffer(self, layer, loc, cache_k, cache_v, *args, **kwargs):
            return super().set_kv_buffer(layer, loc, cache_k, cache_v, *args, **kwargs)

        def set_future_k_buffer(self, layer_id, loc, cache_k):
            self.k_buffer[layer_id][loc] = cache_k

    assert LaterPool.__dict__["set_kv_buffer"].__wrapped__ is not None
    assert not hasattr(LaterPool.__dict__["set_future_k_buffer"], "__wrapped__")
    assert any("not guarded: LaterPool.set_future_k_buffer (no bound rule known for its ids)" in r.getMessage()
               for r in caplog.records)
    launches = count_launches(monkeypatch)
    pool = LaterPool(64, 1, torch.float32, 2, 4, 2, "cpu", False)
    k = torch.zeros(1, 2, 4)
    pool.set_kv_buffer(Layer(0), torch.tensor([5]), k, k)
    assert [site_label(s) for s in launches] == ["set_kv_buffer (LaterPool)"]  # the door's probe; super()'s skipped
    with pytest.raises(KVOutOfBoundsError, match=r"set_kv_buffer \(LaterPool\) layer 0: .* loc\[0\] = 65"):
        pool.set_kv_buffer(Layer(0), torch.tensor([65]), k, k)
        sglang_oobguard.check()
    sglang_oobguard.uninstall()
    assert not hasattr(LaterPool.__dict__["set_kv_buffer"], "__wrapped__")
    del LaterPool, pool
    gc.collect()
    for cls in [cls for cls in mp.MHATokenToKVPool.__subclasses__() if cls.__name__ == "LaterPool"]:
        assert not held_by_the_guard(cls), "uninstall left the guard holding a user's pool class"


def held_by_the_guard(obj: object, steps: int = 3) -> list[str]:
    """What of the guard's (a module's globals, an object, a function, a wrapt wrapper: `_wrappers`
    is wrapt's C type) reaches `obj` up to `steps` referrers up, not through frames or past a
    module's globals: after uninstall, none may. Whether `obj` is gone is not the test: in 0.5.12's
    cell a test class outlived its test in 3 of 5 runs through ci/test.sh on 2026-12-07 (its holder
    unnamed: pytest cut the message), in none of 4 direct pytest runs."""
    seen, held, level = {id(obj)}, [], [obj]
    for _ in range(steps):
        up: list = []
        seen.update((id(level), id(up)))
        for ref in gc.get_referrers(*level):
            if id(ref) in seen or inspect.isframe(ref):
                continue
            seen.add(id(ref))
            module = isinstance(ref, dict) and "__builtins__" in ref
            owners = {type(ref).__module__, ref.get("__name__") if module
                      else getattr(ref, "__module__", None) if inspect.isfunction(ref) else None}
            held += [f"{type(ref).__name__} of {owner}" for owner in owners
                     if isinstance(owner, str) and owner.split(".")[0] in ("sglang_oobguard", "wrapt", "_wrappers")]
            if not module:
                up.append(ref)
        level = up
    return held


def test_swa_wrapper_checked_at_its_door_and_swa_ids_at_the_sub_pool(mp, guard):
    """SWAKVPool: the full-space `loc` against the wrapper's size + page_size; the SWA
    layer's `swa_loc` against the SWA sub-pool's own bound (size_swa + page_size)."""
    needs("KVWriteLoc")
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    named = dict(size=64, size_swa=32, page_size=1, dtype=torch.float32, head_num=2, head_dim=4,
                 swa_attention_layer_ids=[1], full_attention_layer_ids=[0], device="cpu",
                 enable_kvcache_transpose=False)  # the last: 0.5.14 only
    pool = SWAKVPool(**{name: value for name, value in named.items()
                        if name in inspect.signature(SWAKVPool).parameters})
    guard("raise")
    k = torch.zeros(1, 2, 4)
    pool.set_kv_buffer(Layer(1), mp.KVWriteLoc(torch.tensor([60]), swa_loc=torch.tensor([30])), k, k)
    with pytest.raises(KVOutOfBoundsError, match=r"^set_kv_buffer \(SWAKVPool\) layer 1: .*\[0, 65\): loc\[0\] = 65"):
        pool.set_kv_buffer(Layer(1), mp.KVWriteLoc(torch.tensor([65]), swa_loc=torch.tensor([3])), k, k)
    with pytest.raises(KVOutOfBoundsError, match=r"^set_kv_buffer \(MHA\) layer 1: .*\[0, 33\): loc\[0\] = 40 "
                                                 r"\(pool MHATokenToKVPool\)"):
        pool.set_kv_buffer(Layer(1), mp.KVWriteLoc(torch.tensor([60]), swa_loc=torch.tensor([40])), k, k)


def test_prefix_valid_write_checks_each_rows_written_prefix(mp, guard):
    needs("MHATokenToKVPool.set_kv_buffer_prefix_valid")
    guard("raise")
    pool = mha(mp)
    k = torch.randn(6, 2, 4)
    lens = torch.tensor([3, 1], dtype=torch.int32)
    pool.set_kv_buffer_prefix_valid(Layer(2), torch.tensor([[1, 2, 3], [4, -7, 999]]), lens, k, k)  # tail: unread
    assert torch.equal(pool.k_buffer[2][4], k[3])
    with pytest.raises(KVOutOfBoundsError, match=r"^set_kv_buffer_prefix_valid \(MHATokenToKVPool\) layer 2: "
                                                 r"1 of 6 slot ids outside \[0, 65\): loc\[4\] = 70"):
        pool.set_kv_buffer_prefix_valid(Layer(2), torch.tensor([[1, 2, 3], [4, 70, 999]]), lens + 1, k, k)
