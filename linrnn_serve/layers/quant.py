"""Quantized storage formats for projections: NVFP4 (SPEC §2.1-2.3) and FP8 E4M3 (per tensor or per
output channel). Same protocol as `DenseWeights` (layers/linear.py); the in-model tensors are the
kernels' `WeightTensor` layout (linrnn_kernels.quant):

  Nvfp4Weights: packed [(E,) N, K/2] uint8, block_scale [(E,) N, K/16] float8_e4m3fn,
                row_scale [(E,) N] f32
  Fp8Weights:   weight [(E,) N, K] float8_e4m3fn, row_scale [(E,) N] f32

Both real checkpoint layouts load into the same tensors. Per-tensor scales land in the rows of the
part they belong to, so fused parts (q/k/v, gate/up, an expert's gate/up) with different global
scales stay exact:
  ModelOpt           X.weight (packed) X.weight_scale X.weight_scale_2 (row_scale = it)   X.input_scale
  compressed-tensors X.weight_packed   X.weight_scale X.weight_global_scale (row_scale = 1/it)
                                                                               X.input_global_scale
  FP8 (both)         X.weight (e4m3)   X.weight_scale ([], [1], [N] or [N, 1])             X.input_scale
Activation scales are accepted and unused: the kernels are weight-only (bf16 activations, as vLLM's
Marlin path on Hopper, SPEC §2.5).
"""
from __future__ import annotations

import torch
from torch import nn

import linrnn_kernels.quant as quant_ops
from linrnn_kernels.quant import WeightTensor
from linrnn_kernels.quant.nvfp4 import BLOCK
from linrnn_serve.layers.linear import TensorSpec

MODELOPT = "modelopt"
COMPRESSED_TENSORS = "compressed-tensors"


def quant_linear(x: torch.Tensor, w: WeightTensor) -> torch.Tensor:
    """y = x W^T for a quantized weight: the fused dequantizing GEMM on CUDA, else the naive reference
    (dequantize to f32, f32 matmul). Fallback without the kernel: F.linear(x, w.dequantize(x.dtype))."""
    return quant_ops.linear(x, w)


# ---- checkpoint-tensor transforms (src, dst view) -> value; ValueError names what is wrong ------------
def _expect_dtype(dtype: torch.dtype, what: str):
    def transform(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if src.dtype != dtype:
            raise ValueError(f"expected {what} ({dtype}), found {src.dtype}: the checkpoint does not store this "
                             f"module the way the quantization config says")
        return src
    return transform


def _per_tensor_scale(reciprocal: bool, what: str):
    """A scalar scale broadcast over the part's rows (the f32 row_scale)."""
    def transform(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if not src.dtype.is_floating_point:
            raise ValueError(f"{what} must be a float scale, found {src.dtype}")
        s = src.float().reshape(())
        if not bool(torch.isfinite(s)) or float(s) <= 0:  # load time only, never on the decode path
            raise ValueError(f"{what} must be positive and finite, found {float(s)}")
        return (1.0 / s) if reciprocal else s
    return transform


def _per_row_scale(what: str):
    def transform(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor:
        if not src.dtype.is_floating_point:
            raise ValueError(f"{what} must be a float scale, found {src.dtype}")
        return src.float().reshape(dst.shape)
    return transform


def _params(**tensors: torch.Tensor) -> dict[str, nn.Parameter]:
    return {k: nn.Parameter(v, requires_grad=False) for k, v in tensors.items()}


class Nvfp4Weights(nn.Module):
    """NVFP4 weights (SPEC §2.1). `layout` (set on the subclasses from `for_layout`) says which
    checkpoint suffixes are required; the base class accepts either layout with none required."""

    fmt = "nvfp4"
    layout: str | None = None
    _variants: dict[str, type] = {}

    def __init__(self, n: int, k: int, dtype: torch.dtype, experts: int | None = None):
        super().__init__()
        if k % BLOCK:
            raise ValueError(f"NVFP4 needs in_features to be a multiple of {BLOCK}, got {k}")
        self.n, self.k, self.experts, self.dtype = n, k, experts, dtype
        lead = () if experts is None else (experts,)
        for name, p in _params(packed=torch.empty(*lead, n, k // 2, dtype=torch.uint8),
                               block_scale=torch.empty(*lead, n, k // BLOCK, dtype=torch.float8_e4m3fn),
                               row_scale=torch.empty(*lead, n, dtype=torch.float32)).items():
            self.register_parameter(name, p)

    @classmethod
    def for_layout(cls, layout: str) -> type["Nvfp4Weights"]:
        """The (cached, so FusedLinear sees one class per layout) variant requiring `layout`'s names."""
        if layout not in (MODELOPT, COMPRESSED_TENSORS):
            raise ValueError(f"unknown NVFP4 checkpoint layout {layout!r}")
        if layout not in cls._variants:
            name = "ModelOptNvfp4Weights" if layout == MODELOPT else "CompressedTensorsNvfp4Weights"
            cls._variants[layout] = type(name, (cls,), {"layout": layout})
        return cls._variants[layout]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight_tensor())

    mma = None  # the MMA-fragment repack (kernels/moe/nvfp4_layout.PackedNvfp4), set by pack_mma

    def pack_mma(self, gated: bool, name: str) -> None:
        from linrnn_kernels.moe import nvfp4_layout

        with torch.no_grad():
            self.mma = nvfp4_layout.pack(self.packed.data, self.block_scale.data, self.row_scale.data, gated, name)

    def weight_tensor(self) -> WeightTensor:
        return WeightTensor("nvfp4", self.packed, self.block_scale, self.row_scale, self.mma)

    def checkpoint_tensors(self, rows: int) -> dict[str, TensorSpec]:
        mo, ct = self.layout != MODELOPT, self.layout != COMPRESSED_TENSORS  # optional flags
        packed = _expect_dtype(torch.uint8, "packed E2M1 codes")
        return {
            # ModelOpt
            "weight": TensorSpec("packed", (rows, self.k // 2), packed, optional=mo),
            "weight_scale_2": TensorSpec("row_scale", (), _per_tensor_scale(False, "weight_scale_2"), optional=mo),
            "input_scale": TensorSpec(None, (), optional=True),
            # compressed-tensors
            "weight_packed": TensorSpec("packed", (rows, self.k // 2), packed, optional=ct),
            "weight_global_scale": TensorSpec("row_scale", (), _per_tensor_scale(True, "weight_global_scale"),
                                              optional=ct),
            "input_global_scale": TensorSpec(None, (), optional=True),
            # both
            "weight_scale": TensorSpec("block_scale", (rows, self.k // BLOCK),
                                       _expect_dtype(torch.float8_e4m3fn, "E4M3 block scales")),
        }

    def extra_repr(self) -> str:
        return f"n={self.n}, k={self.k}, experts={self.experts}, layout={self.layout}"


class Fp8Weights(nn.Module):
    """FP8 E4M3 weights with a per-tensor scale (ModelOpt FP8, compressed-tensors `float-quantized`
    strategy tensor); `per_channel()` gives the per-output-channel variant (scale [N] or [N, 1])."""

    fmt = "fp8"
    channel_scales = False
    _channel_variant: type | None = None

    def __init__(self, n: int, k: int, dtype: torch.dtype, experts: int | None = None):
        super().__init__()
        self.n, self.k, self.experts, self.dtype = n, k, experts, dtype
        lead = () if experts is None else (experts,)
        for name, p in _params(weight=torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn),
                               row_scale=torch.empty(*lead, n, dtype=torch.float32)).items():
            self.register_parameter(name, p)

    @classmethod
    def per_channel(cls) -> type["Fp8Weights"]:
        if Fp8Weights._channel_variant is None:
            Fp8Weights._channel_variant = type("Fp8ChannelWeights", (Fp8Weights,), {"channel_scales": True})
        return Fp8Weights._channel_variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quant_linear(x, self.weight_tensor())

    def weight_tensor(self) -> WeightTensor:
        return WeightTensor("fp8", self.weight, None, self.row_scale)

    def checkpoint_tensors(self, rows: int) -> dict[str, TensorSpec]:
        if self.channel_scales:
            scale = TensorSpec("row_scale", (rows,), _per_row_scale("weight_scale"))
        else:
            scale = TensorSpec("row_scale", (), _per_tensor_scale(False, "weight_scale"))
        return {
            "weight": TensorSpec("weight", (rows, self.k), _expect_dtype(torch.float8_e4m3fn, "FP8 E4M3 weights")),
            "weight_scale": scale,
            "input_scale": TensorSpec(None, (), optional=True),
        }

    def extra_repr(self) -> str:
        return f"n={self.n}, k={self.k}, experts={self.experts}, per_channel={self.channel_scales}"


__all__ = ["Nvfp4Weights", "Fp8Weights", "quant_linear", "MODELOPT", "COMPRESSED_TENSORS"]
