"""Weight storage formats as seen by the kernels.

`WeightTensor` is the one descriptor every GEMM op takes (dense linear, NVFP4/FP8 linear, grouped
expert GEMMs), so a layer passes its weights without the kernels knowing any layer class:
  fmt "dense": data [(E,) N, K] bf16/f32;                  block_scale, row_scale None
  fmt "nvfp4": data [(E,) N, K/2] uint8 (E2M1 pairs);      block_scale [(E,) N, K/16] float8_e4m3fn;
               row_scale [(E,) N] float32                   (see nvfp4.py)
  fmt "fp8":   data [(E,) N, K] float8_e4m3fn;             block_scale None; row_scale [(E,) N] float32
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class WeightTensor(NamedTuple):
    fmt: str
    data: torch.Tensor
    block_scale: torch.Tensor | None = None
    row_scale: torch.Tensor | None = None
    # nvfp4 only: the same weights repacked into MMA fragments (linrnn_kernels.moe.nvfp4_layout
    # PackedNvfp4), set at load time for the Hopper decode kernel; None elsewhere
    packed: object | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[-2]

    @property
    def in_features(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == "nvfp4" else 1)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dense [(E,) N, K] weights (the naive reference path)."""
        if self.fmt == "dense":
            return self.data.to(dtype)
        if self.fmt == "nvfp4":
            from linrnn_kernels.quant.nvfp4 import dequantize

            return dequantize(self.data, self.block_scale, self.row_scale, dtype)
        if self.fmt == "fp8":
            return (self.data.float() * self.row_scale.float()[..., None]).to(dtype)
        raise ValueError(f"unknown weight format {self.fmt!r}")


from linrnn_kernels.quant.linear import linear  # noqa: E402  (after WeightTensor: linear.py imports it)
