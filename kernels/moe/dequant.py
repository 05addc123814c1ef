"""NVFP4 -> bf16 expert weights on the device, for large token counts (prefill).

With hundreds of tokens per expert the grouped GEMM is compute-bound, and the bf16 tensor-core path
(grouped_gemm.py, dense weights) beats decoding NVFP4 in every tile: experts.moe_experts dequantizes
the expert stack once per layer call into a bf16 scratch and runs the dense grouped GEMMs on it.
W = E2M1(code) * (block_scale * row_scale) in f32, then rounded: bit-identical to
`WeightTensor.dequantize(dtype)` (nvfp4.dequantize), which is the reference in tests.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.quant import WeightTensor


@triton.jit
def _e2m1(code):
    """E2M1 code (int32 0..15) -> f32 value: magnitudes 0, .5, 1, 1.5, 2, 3, 4, 6; bit 3 = sign."""
    mag = code & 7
    v = tl.where(mag < 4, mag.to(tl.float32) * 0.5,
                 tl.where(mag < 6, (mag - 2).to(tl.float32), (mag * 2 - 8).to(tl.float32)))
    return tl.where(code >= 8, -v, v)


@triton.jit
def _dequant_kernel(packed_ptr, bs_ptr, rs_ptr, out_ptr, rows, K, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_R, BLOCK_K] of W: contiguous byte loads, one scale load per 16 codes (broadcast in
    registers), contiguous bf16 stores."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r64 = r.to(tl.int64)
    row_ok = r < rows
    k0 = tl.program_id(1) * BLOCK_K
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    byte = tl.load(packed_ptr + r64[:, None] * (K // 2) + kb[None, :],
                   mask=row_ok[:, None] & (kb < K // 2)[None, :], other=0).to(tl.int32)
    blk = k0 // 16 + tl.arange(0, BLOCK_K // 16)
    scale = tl.load(bs_ptr + r64[:, None] * (K // 16) + blk[None, :],
                    mask=row_ok[:, None] & (blk < K // 16)[None, :], other=0.0).to(tl.float32)
    s = scale * tl.load(rs_ptr + r, mask=row_ok, other=0.0)[:, None]
    v = tl.reshape(tl.join(_e2m1(byte & 15), _e2m1(byte >> 4)), (BLOCK_R, BLOCK_K // 16, 16))  # even k: low nibble
    w = tl.reshape(v * s[:, :, None], (BLOCK_R, BLOCK_K)).to(out_ptr.dtype.element_ty)
    k = k0 + tl.arange(0, BLOCK_K)
    tl.store(out_ptr + r64[:, None] * K + k[None, :], w, mask=row_ok[:, None] & (k < K)[None, :])


def dequantize(w: WeightTensor, dtype=torch.bfloat16) -> WeightTensor:
    """NVFP4 WeightTensor [(E,) N, K/2] -> dense WeightTensor [(E,) N, K] of `dtype` (a new buffer)."""
    if w.fmt != "nvfp4":
        raise ValueError(f"dequantize expects nvfp4 weights, got {w.fmt}")
    *lead, n, kh = w.data.shape
    K = 2 * kh
    rows = n
    for d in lead:
        rows *= d
    out = torch.empty(*lead, n, K, dtype=dtype, device=w.data.device)
    BLOCK_R, BLOCK_K = 8, min(512, triton.next_power_of_2(K))
    grid = (triton.cdiv(rows, BLOCK_R), triton.cdiv(K, BLOCK_K))
    _dequant_kernel[grid](w.data.contiguous(), w.block_scale.contiguous(), w.row_scale.contiguous(), out, rows, K,
                          BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, num_warps=4)
    return WeightTensor("dense", out)
