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

Two quantization flavours, each reproducing its producer bit for bit:
  quantize()                    NVIDIA ModelOpt 0.47 `NVFP4QTensor.quantize` (SPEC §2.2)
  quantize_compressed_tensors() compressed-tensors 0.20 `calculate_qparams` + `generate_gparam` +
                                `NVFP4PackedCompressor.compress`, as llm-compressor drives them
                                (SPEC §2.3); statistics are taken in the weight's own dtype.
"""
from __future__ import annotations

import torch

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = 448.0
# code = sign << 3 | magnitude index; 8 (-0) decodes to 0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# ModelOpt >= 0.39 clamps block scales to the smallest E4M3 subnormal so they never underflow to 0
E4M3_MIN_SUBNORMAL = 2.0 ** -9
# compressed-tensors replaces a zero E4M3 block scale by this (`_get_dtype_eps(float8_e4m3fn)`)
CT_ZERO_SCALE = 0.125


def e2m1_lut(device=None, dtype=torch.float32) -> torch.Tensor:
    return torch.tensor(E2M1_VALUES, dtype=dtype, device=device)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes (uint8, 0..15) of x rounded to E2M1: nearest, ties to even, saturating at +-6.

    Thresholds on |x| (SPEC §2.1): [0,.25]->0 (.25,.75)->.5 [.75,1.25]->1 (1.25,1.75)->1.5
    [1.75,2.5]->2 (2.5,3.5)->3 [3.5,5]->4 (5,inf)->6. The sign bit is set iff x < 0 (so -0.0 gives
    code 0 and a small negative value code 8), as both ModelOpt (`weight < 0`) and compressed-tensors
    (`torch.sign(x)` times the rounded magnitude, then `signbit`) do.
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
    """W [..., N, K] from the in-model layout (f32 arithmetic, then cast).

    E2M1 x E4M3 is exact in f32, so this equals ModelOpt's `NVFP4QTensor.dequantize` bit for bit;
    for compressed-tensors (which divides by the global scale) it can differ by one f32 ulp.
    """
    vals = e2m1_lut(packed.device)[unpack(packed).long()]
    scale = block_scale.float().repeat_interleave(BLOCK, dim=-1) * row_scale.float()[..., None]
    return (vals * scale).to(dtype)


def _blocks(w: torch.Tensor) -> torch.Tensor:
    if w.shape[-1] % BLOCK:
        raise ValueError(f"NVFP4 needs the input dim to be a multiple of {BLOCK}, got shape {tuple(w.shape)}")
    return w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)


def modelopt_weight_scale_2(amax: torch.Tensor) -> torch.Tensor:
    """ModelOpt per-tensor scale: amax / (6 * 448) in f32 (`get_weights_scaling_factor_2`)."""
    return amax.float() / (E2M1_MAX * E4M3_MAX)


def quantize(w: torch.Tensor, global_amax: torch.Tensor | None = None):
    """ModelOpt-style NVFP4 quantization of W [..., N, K] (SPEC §2.2; ModelOpt 0.47 `NVFP4QTensor`).

    weight_scale_2 = amax(|W|) / (6 * 448) per matrix (leading dims kept; `global_amax` overrides
    the amax, e.g. the max over fused q/k/v); block scale s_b = amax_b / (6 * weight_scale_2), 0 -> 1,
    clamped to [2^-9, 448] and cast to E4M3; code = RNE_E2M1(W / (float(s_b) * weight_scale_2)).
    Returns (packed, block_scale, weight_scale_2) with weight_scale_2 of shape [...] (one per matrix).
    An all-zero matrix gets weight_scale_2 = 1 (ModelOpt would divide 0 by 0).
    """
    blocks = _blocks(w)
    if global_amax is None:
        global_amax = w.abs().amax(dim=(-2, -1))
    ws2 = modelopt_weight_scale_2(global_amax)
    ws2 = torch.where(ws2 > 0, ws2, torch.ones_like(ws2))
    amax_b = blocks.abs().amax(-1).float()
    sb = amax_b / (E2M1_MAX * ws2[..., None, None])
    sb = torch.where(sb == 0, torch.ones_like(sb), sb)
    sb = sb.clamp(min=E4M3_MIN_SUBNORMAL, max=E4M3_MAX).to(torch.float8_e4m3fn)
    # the weight keeps its dtype: bf16 / f32 divides in f32, as ModelOpt's `input / (...)` does
    scaled = blocks / (sb.float() * ws2[..., None, None])[..., None]
    codes = round_to_e2m1(scaled.reshape(w.shape))
    return pack(codes), sb, ws2


def compressed_tensors_global_scale(amax: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `generate_gparam`: 448 * 6 / amax computed in amax's dtype (bf16 for a
    bf16 weight), tiny-clamped, inf/nan -> 1, returned as f32. `amax` is max |W| over the tensor
    (or over a fused group: the group shares min(global) = global(max amax))."""
    a = amax.clamp(min=torch.finfo(amax.dtype).tiny)
    g = (E4M3_MAX * E2M1_MAX) / a
    return torch.nan_to_num(g, nan=1.0, posinf=1.0, neginf=1.0).float()


def quantize_compressed_tensors(w: torch.Tensor, global_scale: torch.Tensor | None = None):
    """compressed-tensors `nvfp4-pack-quantized` quantization of W [..., N, K] (SPEC §2.3).

    global = compressed_tensors_global_scale(amax(|W|)) per matrix unless given (f32, shape [...]);
    block scale = E4M3(clamp(global * (amax_b / 6), +-448)) with amax_b / 6 rounded in W's dtype
    first (`calculate_qparams`), 0 -> 0.125; code = cast_to_fp4(clamp(W / (scale / global), +-6)).
    Returns (packed, block_scale, weight_global_scale); dequantize with row_scale = 1 / global.
    """
    blocks = _blocks(w)
    if global_scale is None:
        global_scale = compressed_tensors_global_scale(w.abs().amax(dim=(-2, -1)))
    g = global_scale.float().reshape(*w.shape[:-2], 1, 1)
    # `max_val_pos / (bit_range.to(max_val_pos.dtype) / 2)`: one rounding in the weight's dtype
    local = blocks.abs().amax(-1) / torch.tensor(E2M1_MAX, dtype=w.dtype)
    sb = (g * local).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    sb = torch.where(sb == 0, torch.full_like(sb, CT_ZERO_SCALE), sb)
    # `_quantize`: scale = scale / global_scale; scaled = x / scale (f32), clamp, round
    scaled = blocks / (sb / g)[..., None]
    codes = round_to_e2m1(scaled.clamp(-E2M1_MAX, E2M1_MAX).reshape(w.shape))
    return pack(codes), sb.to(torch.float8_e4m3fn), global_scale.float()
