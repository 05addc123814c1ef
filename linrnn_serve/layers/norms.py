"""The three norm flavours of SPEC §1.4 (do not mix them up)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def zc_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: x_f32 * rsqrt(mean(x^2) + eps) * (1 + w_f32), cast back (SPEC §1.4 #1)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * (1.0 + weight.float())).to(x.dtype)


def gated_rmsnorm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm: w * RMSNorm(x) (plain weight, norm before gate) * silu(gate) (SPEC §1.4 #2).

    Mirrors transformers' cast order: normalise in f32, cast, scale by w, gate in f32, cast.
    """
    dtype = x.dtype
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * n) * F.silu(gate.float())).to(dtype)


class ZCRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return zc_rmsnorm(x, self.weight, self.eps)
