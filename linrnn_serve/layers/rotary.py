"""Partial NeoX rotary embedding over the first `rotary_dim` dims of each head (SPEC §1.7).

Qwen3.5's interleaved M-RoPE equals 1-D RoPE for text-only input, so one position stream suffices.
cos/sin are computed from positions on the fly (positions * inv_freq in f32, as transformers does),
which keeps the op shape-static for CUDA graphs and needs no max-length table.
"""
from __future__ import annotations

import torch
from torch import nn


class PartialRotary(nn.Module):
    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D] -> rotated copies (dims >= rotary_dim pass through)."""
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        emb = torch.cat([freqs, freqs], dim=-1)
        cos, sin = emb.cos().to(q.dtype)[:, None, :], emb.sin().to(q.dtype)[:, None, :]
        return _rotate(q, cos, sin, self.rotary_dim), _rotate(k, cos, sin, self.rotary_dim)


def _rotate(x, cos, sin, rd):
    xr, xp = x[..., :rd], x[..., rd:]
    half = rd // 2
    rot = torch.cat([-xr[..., half:], xr[..., :half]], dim=-1)
    return torch.cat([xr * cos + rot * sin, xp], dim=-1)
