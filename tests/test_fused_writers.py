"""The fused writers of targets.FUSED_WRITERS besides the RoPE + KV store (test_step.py):
trtllm_mha's FP8 K/V store, the DSA indexer's index-K store, trtllm_mla's fused scatter.
Each is called through the real sglang module where sglang looks it up, with its real
signature; only its CUDA kernel (a JIT build with no CPU one) is replaced, under the
guard's wrapper, by a recorder."""

from __future__ import annotations

import importlib
import inspect
import logging
from types import ModuleType
from typing import Any, Optional

import pytest
import torch

import sglang_oobguard
from sglang_oobguard import KVOutOfBoundsError
from helpers import SGLANG
from sglang_oobguard.model.finite import UNSEEN, WRITER_VALUES, stored_values
from sglang_oobguard.model.targets import FUSED_WRITERS, Writer

ROWS = 5
PER_ROW = {"page_size": 64, "dcp_world_size": 2}  # what the bound multiplies the rows by
CASES = [w for w in FUSED_WRITERS if w.function != "apply_rope_inplace_with_kvcache"]


def home(writer: Writer) -> Optional[ModuleType]:
    """The module this sglang looks the writer up in, if it has one that imports here
    (0.4.10's trtllm_mla_backend raises KeyError on import without a GPU)."""
    for name in writer.modules:
        try:
            module = importlib.import_module(name)
        except Exception:
            continue
        if writer.function in vars(module):
            return module
    return None


# Writers that sglang imports into the module it calls them from only on CUDA (dsa_indexer's
# `if _is_cuda:` block), and the module that defines them.
CUDA_ONLY = {"fused_k_indexer_norm_rope_store": "sglang.kernels.ops.attention.dsa.indexer_k"}


def imported_on_cuda(writer: Writer, monkeypatch) -> None:
    """Do on the CPU what the calling module's `if _is_cuda:` import does: its global
    names the defining module's function (before install, as on a GPU machine)."""
    for name in writer.modules:
        try:
            caller, defining = importlib.import_module(name), importlib.import_module(CUDA_ONLY[writer.function])
        except Exception:
            continue
        monkeypatch.setattr(caller, writer.function, getattr(defining, writer.function), raising=False)
        return


@pytest.fixture
def writer_call(guard, monkeypatch):
    """(call, reached) for a writer under the guard: call(loc) passes loc and a buffer of
    ROWS rows (pages) at the writer's own positions, the rest None; reached holds the
    arguments the kernel got, by name."""

    def make(writer: Writer, mode: str, backend: str = "auto", finite: bool = False):
        if writer.function in CUDA_ONLY and home(writer) is None:
            imported_on_cuda(writer, monkeypatch)
        module = home(writer)
        if module is None:
            pytest.skip(f"this sglang has no {writer.function} in {' or '.join(writer.modules)} "
                        "(or defines it only on CUDA)")
        guard(mode, backend=backend, finite=finite)
        wrapped = vars(module)[writer.function]
        assert hasattr(wrapped, "__wrapped__"), f"the guard did not wrap {writer.function} in {module.__name__}"
        names = list(inspect.signature(wrapped.__wrapped__).parameters)
        if writer.ids.position >= len(names):  # 0.5.10's apply_rope_inplace_with_kvcache: another signature
            pytest.skip(f"sglang {SGLANG}'s {writer.function}{tuple(names)} has no {writer.ids.names[0]} at "
                        f"{writer.ids.position}")
        assert names[writer.ids.position] == writer.ids.names[0], (names, writer.ids)
        assert names[writer.rows[0]] == writer.rows[1], (names, writer.rows)
        if writer.per_row:
            assert names[writer.per_row[0]] == writer.per_row[1], (names, writer.per_row)
        reached: list[dict[str, Any]] = []

        def recorder(*args, **kwargs):
            """Test-only: stands in for the CUDA kernel, which cannot run here; records its call."""
            reached.append({**dict(zip(names, args)), **kwargs})

        monkeypatch.setattr(wrapped, "__wrapped__", recorder)

        def call(loc: torch.Tensor, keywords: bool = False, given: Optional[dict[int, Any]] = None) -> None:
            args: list[Any] = [None] * len(names)
            for at, value in (given or {}).items():  # the values it stores, by position
                args[at] = value
            args[writer.ids.position] = loc
            args[writer.rows[0]] = torch.zeros(ROWS, 4)
            if writer.per_row:
                args[writer.per_row[0]] = PER_ROW[writer.per_row[1]]
            function = vars(module)[writer.function]  # as sglang calls it: the module's global
            function(**dict(zip(names, args))) if keywords else function(*args)

        call.names = names  # type: ignore[attr-defined]  # the writer's own parameters
        return call, reached

    return make


def bound_of(writer: Writer) -> int:
    return ROWS * (PER_ROW[writer.per_row[1]] if writer.per_row else 1)


@pytest.mark.parametrize("writer", CASES, ids=lambda w: w.function)
def test_strict_raises_before_the_kernel_naming_the_writer(writer_call, writer):
    call, reached = writer_call(writer, "strict")  # the host scan: on a GPU strict traps in the kernel
    high = bound_of(writer)
    with pytest.raises(KVOutOfBoundsError) as info:
        call(torch.tensor([1, high, 2]))
    text = str(info.value)
    assert text.startswith(f"{writer.label}: 1 of 3 slot ids outside [0, {high}): loc[1] = {high}"), text
    assert not reached
    call(torch.tensor([0, high - 1]))  # the last slot of the bound is in it
    assert len(reached) == 1


@pytest.mark.parametrize("backend, keywords", [("auto", False), ("triton", False), ("auto", True)])
@pytest.mark.parametrize("writer", CASES, ids=lambda w: w.function)
def test_warn_contains_into_a_copy_and_logs(writer_call, writer, backend, keywords, caplog):
    """Positional, and by keyword as sglang calls some of them (fused_fp8_qkv_kv_cache,
    set_mla_kv_concat_q): the kernel gets the copy either way."""
    call, reached = writer_call(writer, "warn", backend)
    loc = torch.tensor([3, -1, 4])
    with caplog.at_level(logging.WARNING, logger="sglang_oobguard"):
        call(loc, keywords)
        sglang_oobguard.check()  # the kernel path's record is read at a check point (a step's end)
    (got,) = reached
    assert got[writer.ids.names[0]].tolist() == [3, 0, 4]
    assert loc.tolist() == [3, -1, 4]  # the caller's ids are never changed
    assert f"{writer.label}: 1 of 3 slot ids outside [0, {bound_of(writer)}): loc[1] = -1" in caplog.text


WITH_VALUES = [w for w in FUSED_WRITERS if w.function in WRITER_VALUES]


def test_every_fused_writer_names_the_values_it_stores_or_why_they_are_not_seen():
    functions = [writer.function for writer in FUSED_WRITERS]
    assert sorted(functions) == sorted([*WRITER_VALUES, *UNSEEN]) and not WRITER_VALUES.keys() & UNSEEN.keys()


@pytest.mark.parametrize("backend", ["auto", "triton"])
@pytest.mark.parametrize("writer", WITH_VALUES, ids=lambda w: w.function)
def test_finite_reads_each_value_a_writer_stores_and_lets_it_through(writer_call, writer, backend):
    """Each named value argument, per token or a scale, is the one the signature has at
    that place; a NaN in the last of them is reported after the kernel got it unchanged."""
    call, reached = writer_call(writer, "raise", backend, finite=True)
    names = call.names
    stored = WRITER_VALUES[writer.function]
    if stored_values(writer.function, names) != stored:
        pytest.skip(f"sglang {SGLANG}'s {writer.function}{tuple(names)} has another signature than the table's "
                    f"{stored}: its values are not read (doctor: 'values: NOT seen')")
    assert [names[at] for at, _ in stored] == [name for _, name in stored]
    given = {at: torch.ones(3, 2, 4) if "scale" not in name else torch.ones(1) for at, name in stored}
    at, name = stored[-1]
    given[at][-1] = float("nan")
    with pytest.raises(KVOutOfBoundsError) as info:
        call(torch.tensor([0, 1, 2]), given=given)  # the host scan raises after the kernel
        assert backend == "triton"
        sglang_oobguard.check()  # the value kernel's record is read at a check point
    assert len(reached) == 1 and torch.isnan(reached[0][name]).any()  # the kernel got it unchanged
    v = info.value.violation
    assert (v.label, v.part, v.element) == (writer.label, name, "nan"), v
    assert (v.pos, v.value) == ((2, 2) if "scale" not in name else (-1, -1)), v


def test_doctor_lists_every_fused_writer_with_its_bound_and_whether_this_sglang_has_it():
    from helpers import run_python

    proc = run_python("import sys; from sglang_oobguard.__main__ import main; sys.exit(main(['doctor']))", {})
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.split("fused writers (", 1)[1].splitlines()[1:1 + len(FUSED_WRITERS)]
    for writer, line in zip(FUSED_WRITERS, lines):
        assert line.split()[0] == writer.function and f"{writer.ids.names[0]} in [0, {writer.bound})" in line, line
        module = home(writer)
        assert f"found in {module.__name__}" in line if module else ("ABSENT" in line or "not importable" in line), line


def test_the_table_holds_every_fused_writer_that_sglang_calls_outside_the_pool_methods():
    """The writers read from sglang's source (0.5.10 - 0.5.23) that take their own ids:
    dropping one from the table would drop its tests above with it, so it is named here."""
    read_from_sglang = {"apply_rope_inplace_with_kvcache", "fused_fp8_qkv_kv_cache", "fused_fp8_set_kv_buffer",
                        "fused_store_index_k_cache", "fused_k_indexer_norm_rope_store", "set_mla_kv_concat_q",
                        "set_mla_kv_concat_q_fp8"}
    assert read_from_sglang <= {writer.function for writer in FUSED_WRITERS}
