"""Zero-centred RMSNorm module (SPEC §1.4 #1). The math lives in linrnn_kernels.norm (fused with the
residual add); the GDN's gated norm and q/k norms are applied by their layers through the same ops.

`PostNorm` is the residual add + RMSNorm that follows a sublayer (the next sublayer's input norm):
a sublayer given one returns (normed, new residual) and may fuse it into its last projection's
epilogue (linrnn_kernels.gemv); `post(h)` is the unfused fallback."""
from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class PostNorm:
    """The norm to apply after a sublayer: norm(h + residual) -> (normed, h + residual)."""

    norm: ZCRMSNorm
    residual: torch.Tensor | None

    def __call__(self, h: torch.Tensor):
        return self.norm(h, self.residual)

    def fused_options(self) -> dict:
        """Keyword options of linrnn_kernels.gemv.fused_linear that apply this norm in the epilogue."""
        return {"residual": self.residual, "norm_w": self.norm.weight, "norm_eps": self.norm.eps}
