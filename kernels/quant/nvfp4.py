"""NVFP4 storage format reference (SPEC §2.1): E2M1 codes packed two per byte along K (low nibble =
even element), one E4M3 block scale per 16 elements along K, and an f32 scale per output row.

In-model layout (what layers/quant.py holds and the kernels read), for a weight W [N, K]:
  packed      [N, K/2]  uint8
  block_scale [N, K/16] float8_e4m3fn   (row-major, unswizzled, as on disk)
  row_scale   [N]       float32         ModelOpt `weight_scale_2` (multiplies) or 1 / compressed-
                                        tensors `weight_global_scale` (divides), one per row so that
                                        fused parts with different global scales stay exact.
  W[n, k] = E2M1(code[n, k]) * float(block_scale[n, k // 16]) * row_scale[n]
Stacked expert weights add a leading [E] dim to all three.
"""
from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# code = sign << 3 | magnitude index; 8 (-0) decodes to 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of x rounded to E2M1: nearest, ties to even, saturating at +-6.

    Thresholds on |x| (SPEC §2.1): [0,.25]->0 (.25,.75)->.5 [.75,1.25]->1 (1.25,1.75)->1.5
    [1.75,2.5]->2 (2.5,3.5)->3 [3.5,5]->4 (5,inf)->6.
    """
    a = x.abs().float()
    idx = ((a > 0.25).to(torch.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5) + (a >= 3.5)
           + (a > 5.0))
    return idx.to(torch.uint8) | ((x < 0).to(torch.uint8) << 3)


def pack(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, element 2j in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes."""
    return torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)


def dequantize(packed: torch.Tensor, block_scale: torch.Tensor, row_scale: torch.Tensor,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """W [..., N, K] from the in-model layout (f32 arithmetic, then cast)."""
    vals = e2m1_lut(packed.device)[unpack(packed).long()]
    scale = block_scale.float().repeat_interleave(BLOCK, dim=-1) * row_scale.float()[..., None]
    return (vals * scale).to(dtype)


def quantize(w: torch.Tensor, global_amax: torch.Tensor | None = None):
    """ModelOpt-style NVFP4 quantization of W [..., N, K] (SPEC §2.2).

    weight_scale_2 = amax(|W|) / (6 * 448) per matrix (leading dims kept); block scale
    s_b = amax_b / (6 * weight_scale_2) cast to E4M3 (0 -> 1); code = RNE_E2M1(W / (s_b * ws2)).
    Returns (packed, block_scale, weight_scale_2) with weight_scale_2 of shape [...] (one per matrix).
    """
    wf = w.float()
    if global_amax is None:
        global_amax = wf.abs().amax(dim=(-2, -1))
    ws2 = global_amax.float() / (E2M1_MAX * E4M3_MAX)
    ws2 = torch.where(ws2 > 0, ws2, torch.ones_like(ws2))
    blocks = wf.reshape(*wf.shape[:-1], wf.shape[-1] // BLOCK, BLOCK)
    amax_b = blocks.abs().amax(-1)
    sb = (amax_b / (E2M1_MAX * ws2[..., None, None])).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    sbf = sb.float()
    sbf = torch.where(sbf > 0, sbf, torch.ones_like(sbf))
    sb = sbf.to(torch.float8_e4m3fn)
    scaled = blocks / (sbf * ws2[..., None, None])[..., None]
    codes = round_to_e2m1(scaled.reshape(wf.shape))
    return pack(codes), sb, ws2
