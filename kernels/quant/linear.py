"""y = x W^T for one (non-expert) WeightTensor [N, K] in any storage format.

dense -> F.linear (cuBLAS). nvfp4 / fp8 -> the grouped GEMM kernel of kernels/moe/grouped_gemm.py
with one expert and unsorted rows (same weight decode, f32 accumulation, row_scale epilogue), or
`linear_naive` (dequantize, then an f32 matmul) off the GPU / inside reference_ops().
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.quant import WeightTensor


def linear_naive(x: torch.Tensor, w: WeightTensor, activations: str = "float") -> torch.Tensor:
    """Reference: dequantize W to f32, matmul in f32, cast to x.dtype. activations="nvfp4" rounds
    the x rows to NVFP4 first (the W4A4 reference of the dot_scaled path)."""
    x2 = x.reshape(-1, x.shape[-1])
    if activations == "nvfp4":
        from linrnn_kernels.moe.naive import fake_quantize_rows_nvfp4

        x2 = fake_quantize_rows_nvfp4(x2)
    y = x2.float() @ w.dequantize(torch.float32).t()
    return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def _block_m(num_rows: int) -> int:
    return 16 if num_rows <= 16 else 32 if num_rows <= 32 else 64 if num_rows <= 64 else 128


def linear_triton(x: torch.Tensor, w: WeightTensor, *, config=None, nvfp4_path: str | None = None):
    """The Triton path for any format (dense included, for tests and benchmarks)."""
    from linrnn_kernels.moe import grouped_gemm as gg

    N, K = w.out_features, w.in_features
    if x.shape[-1] != K:
        raise ValueError(f"x has {x.shape[-1]} features, weight expects {K}")
    gg.check_weight(w, "weight", None, N, K)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K).contiguous()
    T = x2.shape[0]
    out = gg.alloc(T, N, dtype=x.dtype, device=x.device)
    if T == 0:
        return out.reshape(*lead, N)
    if config is None:
        bm = _block_m(T)
        config = gg._config_override("linear") or gg.default_config(
            w.fmt, False, bm, _cdiv(T, bm), N, K, x.device)
    blocks = _cdiv(T, config.block_m)
    common = dict(num_rows=T, n=N, k=K, num_m_blocks=blocks, nvfp4_path=nvfp4_path)
    if config.split_k == 1:
        gg.launch_gemm(x2, w, out, config, **common)
    else:
        part = gg.alloc(config.split_k, T, N, dtype=torch.float32, device=x.device)
        gg.launch_gemm(x2, w, part, config, **common)
        gg.sum_reduce(part, out, group=1)
    return out.reshape(*lead, N)


# cuBLAS runs an align-1 kernel (sm75-era, ~50 TFLOP/s on the H200) when the output's row stride is not a multiple
# of 16 bytes: the MoE gate (256 router rows + 1 shared-expert gate row = 257 outputs) took 162 us per layer at
# 8192 tokens, ~12x its FLOP time (benchmarks/results/serving/prefill_round/). With the weight padded by zero rows
# to a multiple of OUT_ALIGN outputs, the result is a view of the first N columns of an aligned [M, N_pad] matrix.
OUT_ALIGN = 8


def dense_linear(x: torch.Tensor, w: torch.Tensor, align: bool | None = None) -> torch.Tensor:
    """F.linear(x, w) for a dense [N, K] w; align (default: on CUDA) pads N to a multiple of OUT_ALIGN and returns
    a column view (rows strided by the padded N) when N is not one already."""
    N = w.shape[0]
    pad = -N % OUT_ALIGN
    if not (x.is_cuda if align is None else align) or not pad:
        return F.linear(x, w)
    wp = F.pad(w, (0, 0, 0, pad))  # one launch (~1 MB for the gate), far below the slow kernel's cost
    return F.linear(x, wp)[..., :N]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def linear(x: torch.Tensor, w: WeightTensor) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x.dtype."""
    if w.fmt == "dense":
        return dense_linear(x, w.data if w.data.dtype == x.dtype else w.data.to(x.dtype))
    if use_triton(x):
        from linrnn_kernels.moe.experts import supported

        if supported(x, w):
            return linear_triton(x, w)
    return linear_naive(x, w)
