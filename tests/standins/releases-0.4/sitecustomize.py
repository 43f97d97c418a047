"""TEST-ONLY: sglang 0.4.x (built for torch 2.7) asks `torch._C._cpu._is_amx_tile_supported`
as its modules import; torch 2.14.1, the torch of every cell here, moved it to `torch.cpu`.
Same function, old name, set at each start of a process that has this folder on
PYTHONPATH (the engine's spawned processes too; tests/helpers.shim_old_sglang runs this
file in a test process that started without it). tests/e2e/siteinstall's sitecustomize
runs this one before its own. Also `_Hf3fsWithoutSource` below."""

import sys
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

import torch

if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
    torch._C._cpu._is_amx_tile_supported = torch.cpu._is_amx_tile_supported


class _Hf3fsWithoutSource:
    """TEST-ONLY: sglang 0.4.10's wheel ships `client_hf3fs.py` without the `hf3fs_utils.cpp`
    it compiles at import, and the scheduler imports it (hiradix_cache -> cache_controller ->
    storage_hf3fs), so the engine cannot start. Where that file is missing, the module is a
    stand-in whose every name raises when used: HiCache's 3FS backend, which no test runs."""

    NAME = "sglang.srt.mem_cache.storage.hf3fs.client_hf3fs"

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.NAME:
            return None
        real = PathFinder.find_spec(fullname, path)
        if real is None or Path(real.origin).with_name("hf3fs_utils.cpp").exists():
            return None
        from _standin import _Loader  # (tests/standins, on PYTHONPATH before this folder)

        return ModuleSpec(fullname, _Loader(), is_package=True)


sys.meta_path.insert(0, _Hf3fsWithoutSource())
