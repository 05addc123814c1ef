"""Projections (y = x W^T) built from named parts whose weights may be stored dense or quantized.

Every projection of the model is a `FusedLinear` of named parts, e.g. the GDN input projection has
parts q/k/v ("qkv"), z, b, a. Consecutive parts that share a storage format are fused into one
weight group (one GEMM); a checkpoint that stores some parts quantized and others in bf16 (nvidia's
Qwen3.6 MIXED_PRECISION release: FP8 in_proj_qkv/z, bf16 in_proj_a/b) gets one GEMM per group.

A storage format is a module class (`DenseWeights` here; NVFP4 / FP8 in layers/quant.py) with:
  fmt                      name used in logs and the checkpoint layout
  __init__(n, k, dtype, experts=None)   weights for n output rows (optionally per expert)
  forward(x)               x [T, K] -> [T, n]   (non-expert weights)
  weight_tensor()          the kernels' WeightTensor view (linrnn_kernels.quant)
  checkpoint_tensors(...)  checkpoint suffix -> (attribute, expected shape, transform) per row range
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

import linrnn_kernels.gemv as gemv_ops
from linrnn_kernels.quant import WeightTensor


@dataclass
class TensorSpec:
    """How one checkpoint tensor of a weight piece lands in a format's attribute."""

    attr: str
    shape: tuple[int, ...]  # expected source shape (without the expert dim)
    transform: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None  # (src, dst view) -> value
    optional: bool = False


class DenseWeights(nn.Module):
    fmt = "dense"

    def __init__(self, n: int, k: int, dtype: torch.dtype, experts: int | None = None):
        super().__init__()
        self.n, self.k, self.experts = n, k, experts
        shape = (n, k) if experts is None else (experts, n, k)
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2:  # decode-sized batches may take the skinny GEMM (linrnn_kernels.gemv.config)
            return gemv_ops.fused_linear(x, self.weight_tensor())
        return F.linear(x, self.weight)

    def weight_tensor(self) -> WeightTensor:
        return WeightTensor("dense", self.weight)

    def checkpoint_tensors(self, rows: int) -> dict[str, TensorSpec]:
        return {"weight": TensorSpec("weight", (rows, self.k))}


class FusedLinear(nn.Module):
    """Named row-parts [(name, rows), ...] over one input; formats[name] picks each part's storage."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], dtype: torch.dtype,
                 formats: dict[str, type] | None = None):
        super().__init__()
        formats = formats or {}
        self.in_features = in_features
        self.out_features = sum(r for _, r in parts)
        self.groups = nn.ModuleList()
        self._where: dict[str, tuple[int, int, int]] = {}  # part -> (group, row start, rows)
        run: list[tuple[str, int]] = []
        run_fmt = None

        def flush():
            if run:
                g = len(self.groups)
                off = 0
                for name, r in run:
                    self._where[name] = (g, off, r)
                    off += r
                self.groups.append(run_fmt(off, in_features, dtype))

        for name, rows in parts:
            fmt = formats.get(name, DenseWeights)
            if fmt is not run_fmt and run:
                flush()
                run = []
            run_fmt = fmt
            run.append((name, rows))
        flush()

    def locate(self, part: str) -> tuple[nn.Module, int, int, str]:
        """(weight group, first row, rows, group path) of a named part."""
        g, start, rows = self._where[part]
        return self.groups[g], start, rows, f"groups.{g}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.groups) == 1:
            return self.groups[0](x)
        return torch.cat([g(x) for g in self.groups], dim=-1)

    def weight_tensor(self) -> WeightTensor | None:
        """The kernels' view of all rows when they are stored in one group (one format), else None:
        the layers pass it to fused kernels (linrnn_kernels.gemv) and fall back to forward() otherwise."""
        return self.groups[0].weight_tensor() if len(self.groups) == 1 else None


def Linear(in_features: int, out_features: int, dtype: torch.dtype, fmt: type = DenseWeights) -> FusedLinear:
    """A single-part projection (part name 'weight')."""
    return FusedLinear(in_features, [("weight", out_features)], dtype, {"weight": fmt})
