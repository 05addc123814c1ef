"""Memory layout of the GDN recurrent-state pools (per head, f32 arithmetic orientation [Dk, Dv]).

  f32 partition  [slots, H_f32,  Dk, Dv]                          float32
  bf16 partition [slots, H_bf16, Dv / W, Dk, W], W = min(64, Dv)  bfloat16  ("blocked")

Blocked bf16: the decode kernel's widest state tile ([Dk, 64], B >= 32 at 35B-A3B shapes) is one contiguous
16 KB run instead of 128 rows of 128 B strided 256 B apart. Measured on an H200 (all-bf16 state, B = 64 / 128 /
256): 76.8 / 84.1 / 86.9 % of copy bandwidth against 72.2 / 78.8 / 80.0 % for [Dk, Dv]; the same addressing for
f32 heads measured 1.5-2 points slower (86.0 / 89.0 / 90.3 % vs 87.5 / 91.0 / 92.0 %), so the f32 partition keeps
[Dk, Dv] (benchmarks/results/kernels/gdn-decode/bf16_round3/). Narrower tiles ([Dk, 16], [Dk, 32]) are row
pieces of a block. Only addresses differ: the same kernels compute the same bits in either layout.
"""
from __future__ import annotations

import torch

BF16_BLOCK = 64


def bf16_block(dv: int) -> int:
    """Columns per block of the bf16 partition (W)."""
    return min(BF16_BLOCK, dv)


def bf16_pool_shape(slots: int, heads: int, dk: int, dv: int) -> tuple[int, ...]:
    w = bf16_block(dv)
    return (slots, heads, dv // w, dk, w)


def to_bf16_blocked(x: torch.Tensor) -> torch.Tensor:
    """[..., Dk, Dv] states -> the bf16 partition's [..., Dv / W, Dk, W] (dtype unchanged; contiguous)."""
    dk, dv = x.shape[-2:]
    w = bf16_block(dv)
    return x.reshape(*x.shape[:-1], dv // w, w).transpose(-3, -2).contiguous()


def from_bf16_blocked(x: torch.Tensor) -> torch.Tensor:
    """The bf16 partition's [..., Dv / W, Dk, W] -> [..., Dk, Dv] (a copy)."""
    nb, dk, w = x.shape[-3:]
    return x.transpose(-3, -2).reshape(*x.shape[:-3], dk, nb * w)
