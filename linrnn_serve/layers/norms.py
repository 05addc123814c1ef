"""Zero-centred RMSNorm module (SPEC §1.4 #1). The math lives in linrnn_kernels.norm (fused with the
residual add); the GDN's gated norm and q/k norms are applied by their layers through the same ops."""
from __future__ import annotations

import torch
from torch import nn

import linrnn_kernels.norm as norm_ops


class ZCRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """(normed, new residual) with new residual = x + residual (or x when residual is None)."""
        return norm_ops.add_rmsnorm(x, residual, self.weight, self.eps)
