"""TEST-ONLY: sglang 0.4.x (built for torch 2.7) asks `torch._C._cpu._is_amx_tile_supported`
as its modules import; torch 2.14.1, the torch of every cell here, moved it to `torch.cpu`.
Same function, old name, set at each start of a process that has this folder on
PYTHONPATH (the engine's spawned processes too; tests/helpers.shim_old_sglang runs this
file in a test process that started without it). tests/e2e/siteinstall's sitecustomize
runs this one before its own."""

import torch

if not hasattr(torch._C._cpu, "_is_amx_tile_supported"):
    torch._C._cpu._is_amx_tile_supported = torch.cpu._is_amx_tile_supported
