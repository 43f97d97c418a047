"""TEST-ONLY: vLLM's RMSNorm and GemmaRMSNorm as plain torch (their `forward_native`),
which sglang 0.4.x's layernorm takes on a CPU without AMX."""

from __future__ import annotations

from typing import Optional, Union

import torch
from torch import nn


class RMSNorm(nn.Module):
    offset = 0.0  # GemmaRMSNorm scales by 1 + weight

    def __init__(self, hidden_size: int, eps: float = 1e-6, var_hidden_size: Optional[int] = None,
                 has_weight: bool = True, dtype: Optional[torch.dtype] = None) -> None:
        super().__init__()
        self.variance_epsilon = eps
        self.weight = nn.Parameter(torch.full((hidden_size,), 1.0 - self.offset, dtype=dtype or torch.float32))

    def forward(self, x: torch.Tensor, residual: Optional[torch.Tensor] = None
                ) -> Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        dtype = x.dtype
        x = x.float()
        if residual is not None:
            x = x + residual.float()
            residual = x.to(dtype)
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.variance_epsilon)
        x = (x * (self.offset + self.weight.float())).to(dtype)
        return x if residual is None else (x, residual)


class GemmaRMSNorm(RMSNorm):
    offset = 1.0
