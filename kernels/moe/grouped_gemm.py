"""Grouped GEMM over expert-sorted row blocks, one kernel for every weight format (SPEC §1.8, §2.1).

    out[r, n] = sum_k A[row(r), k] * W[e(r), n, k]         W in WeightTensor layout [(E,) N, K]

Rows come in blocks of BLOCK_M that all use one expert (see align.py); a block's rows are gathered
through `sorted_ids` (pair ids; the A row is pair // A_ROW_DIV). With SORTED=False the rows are
simply 0..num_rows-1 with expert 0: the dense quantized linear of kernels/quant/linear.py.

Decode is memory-bound on the weights, and a block holds few rows, so the product is computed
transposed, acc[BLOCK_N, BLOCK_M] = W_tile[BLOCK_N, BLOCK_K] @ A_tile^T: the weight rows fill the
MMA's M side (64 per warpgroup on Hopper) and the token rows its narrow N side (16..128).

Weight formats (constexpr FMT):
  dense  bf16/f32 tiles go straight to the MMA.
  fp8    E4M3 tile -> compute dtype (exact), row_scale on the f32 accumulator.
  nvfp4  the packed codes stay packed in HBM and are decoded in registers. The Hopper paths load
         them as 16-bit elements of 4 codes (k = 4e .. 4e+3, lowest nibble first) and consume the
         tile as four dots, one per code position j over the columns k = j (mod 4) of the
         activation tile (a register split, no interleave shuffle of the weights). E2M1 x E4M3
         block scale is exact in bf16 (2 + 4 significant bits), so the dequantized weights are
         exact and row_scale is applied to the f32 accumulator in the epilogue.
         NVFP4_MODE 0: decode with plain Triton integer ops (E2M1 bits placed in an E4M3 byte,
                       converted by hardware); runs under TRITON_INTERPRET.
         NVFP4_MODE 1: inline-PTX decode (Marlin's bit placement, see _E2M1X8_TO_BF16_PTX),
                       20 instructions per 8 weights incl. the scale multiply, 13 on the integer
                       pipe. Hopper default. At decode batch sizes (16-row blocks) the decode is
                       what competes with HBM: compiled for sm_90, the K loop of the gate_up
                       kernel is ~4.1 SASS instructions per weight (2.4 integer) in this mode
                       against ~10.7 (6.4 integer) with the plain-Triton decode.
         NVFP4_MODE 2: FP4 tensor cores (sm_100+) through tl.dot_scaled. Triton 3.6 cannot compile
                       dot_scaled(bf16, e2m1 with E4M3 scales) on any target (AccelerateMatmul
                       asserts), and FP4 MMA hardware takes two FP4 operands anyway, so this path is
                       W4A4: the activation rows are quantized to NVFP4 first (quantize_rows_nvfp4:
                       per-row f32 scale, per-16 E4M3 block scales, ModelOpt rounding), which changes
                       numerics relative to the W4A16 paths (as vLLM's Blackwell FP4 GEMMs do).
                       UNTESTED: compiled for sm_100 offline only; no Blackwell GPU here, and the
                       interpreter has no dot_scaled.
Epilogues: GATED stacks the matching gate (rows n) and up (rows N + n) weight rows in one tile
(one MMA of 2 * BLOCK_N rows) and writes SiLU(gate) * up; ROUTE_WEIGHTED multiplies by the pair's
routing weight. With SPLIT_K > 1 every program writes f32 partials [SPLIT_K, rows, ...] that a
reduce kernel sums in a fixed order: no float atomics anywhere, so results are bitwise
reproducible (CUDA graphs on or off).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from linrnn_kernels.gemv.skinny import gdc_wait
from linrnn_kernels.quant import WeightTensor

logger = logging.getLogger("linrnn_kernels.moe")

FORMATS = ("dense", "fp8", "nvfp4")
NVFP4_MODES = {"triton": 0, "asm": 1, "dot_scaled": 2}

# Inline PTX decode of two 16-bit elements (8 E2M1 codes) into the 4 code positions, bf16, times
# their block scales. Marlin's bit placement: a code's exponent+mantissa bits go to bf16 bits 6..8
# and its sign to bit 15, which reads as the E2M1 value times 2^-126 (code 1 = 0.5 becomes a bf16
# subnormal; bf16 FMA keeps subnormals). With 16-bit elements, code j of both elements sits at the
# same offset of each 16-bit half, so one shift and three masks decode two weights at once. The
# block scale arrives pre-multiplied by 2^119, so the product is W * 2^-7: exact (2 x 4 significant
# bits) and normal (>= 2^-17); the epilogue multiplies the accumulator by ASM_DECODE_GAIN = 2^7.
# Operands: $0..$3 = code position 0..3 of elements (0, 1) as bf16 pairs; $4 = the two elements;
# $5, $6 = each element's scale as a bf16 pair [s, s] (32-bit elements need no packing, whereas
# bf16 elements would be packed into registers by extra instructions on every call).
_E2M1X8_TO_BF16_PTX = tl.constexpr("""
{
.reg .b32 sc, nzero, y, m, r0, r1, r2, r3;
prmt.b32 sc, $5, $6, 0x5410;
mov.b32 nzero, 0x80008000;
and.b32 m, $4, 0x70007000;
shr.u32 m, m, 6;
and.b32 y, $4, 0x80008000;
or.b32 r3, y, m;
shl.b32 y, $4, 4;
and.b32 m, y, 0x70007000;
shr.u32 m, m, 6;
and.b32 y, y, 0x80008000;
or.b32 r2, y, m;
shl.b32 y, $4, 8;
and.b32 m, y, 0x70007000;
shr.u32 m, m, 6;
and.b32 y, y, 0x80008000;
or.b32 r1, y, m;
shl.b32 y, $4, 12;
and.b32 m, y, 0x70007000;
shr.u32 m, m, 6;
and.b32 y, y, 0x80008000;
or.b32 r0, y, m;
fma.rn.bf16x2 $0, r0, sc, nzero;
fma.rn.bf16x2 $1, r1, sc, nzero;
fma.rn.bf16x2 $2, r2, sc, nzero;
fma.rn.bf16x2 $3, r3, sc, nzero;
}
""")
ASM_DECODE_GAIN = tl.constexpr(128.0)  # the asm decode yields W * 2^-7


@triton.jit
def _e2m1_over_64(code):
    """E2M1 codes (int32, 0..15) -> value / 64, exact: the E2M1 bits placed in an E4M3 byte
    (sign -> bit 7, exponent+mantissa -> bits 2..4) read 2^-6 times the E2M1 value, subnormals too."""
    e4m3 = (((code & 8) << 4) | ((code & 7) << 2)).to(tl.uint8)
    return e4m3.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _dequant_nvfp4(packed, scale, COMPUTE: tl.constexpr, ASM: tl.constexpr):
    """packed int16 [R, C] (4 codes per element, lowest nibble first), scale float8e4nv [R, C // 4]
    -> (W[:, 0::4], W[:, 1::4], W[:, 2::4], W[:, 3::4]), each [R, C] in COMPUTE dtype (bf16 and
    times 1 / ASM_DECODE_GAIN if ASM)."""
    # each block scale covers 16 codes = 4 elements: broadcast it to every element of its block
    if ASM:
        s = (scale.to(tl.float32) * 2.0 ** 119).to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.uint32)
        s = (s | (s << 16)).to(tl.int32, bitcast=True)
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], s.shape[1], 4)), packed.shape)
        # is_pure=False keeps Triton from hoisting the decode into the MMA operand layout, where a
        # thread's elements are scattered and re-gathering them costs more than the shared-memory
        # round trip of the decoded tile
        w0, w1, w2, w3 = tl.inline_asm_elementwise(
            _E2M1X8_TO_BF16_PTX, "=r,=r,=r,=r,r,r,r", [packed, s],
            dtype=(tl.bfloat16, tl.bfloat16, tl.bfloat16, tl.bfloat16), is_pure=False, pack=2)
    else:
        s = scale.to(tl.float32) * 64.0  # undo the 2^-6 of the E4M3 placement
        s = tl.reshape(tl.broadcast_to(s[:, :, None], (s.shape[0], s.shape[1], 4)), packed.shape)
        p = packed.to(tl.int32)
        w0 = (_e2m1_over_64(p & 15) * s).to(COMPUTE)
        w1 = (_e2m1_over_64((p >> 4) & 15) * s).to(COMPUTE)
        w2 = (_e2m1_over_64((p >> 8) & 15) * s).to(COMPUTE)
        w3 = (_e2m1_over_64((p >> 12) & 15) * s).to(COMPUTE)
    return w0, w1, w2, w3


@triton.jit
def _tile_dot(acc, a_t, a_scale, a0_t, a1_t, a2_t, a3_t, w_ptrs, s_ptrs, w_mask, s_mask,
              FMT: tl.constexpr, NVFP4_MODE: tl.constexpr, COMPUTE: tl.constexpr,
              PRECISION: tl.constexpr):
    """acc[BN, BM] += W_tile @ A_tile^T for one K step of one weight tile; aj_t = A^T rows k = j
    (mod 4) for the 4-codes-per-element NVFP4 decode; in mode 2 a_t holds NVFP4 codes of A^T
    and a_scale their block scales."""
    if FMT == "nvfp4":
        packed = tl.load(w_ptrs, mask=w_mask, other=0)
        scale = tl.load(s_ptrs, mask=s_mask, other=0.0)
        if NVFP4_MODE == 2:
            acc = tl.dot_scaled(packed, scale, "e2m1", a_t, a_scale, "e2m1", acc)
        else:
            w0, w1, w2, w3 = _dequant_nvfp4(packed, scale, COMPUTE, NVFP4_MODE == 1)
            acc = tl.dot(w0, a0_t, acc, input_precision=PRECISION)
            acc = tl.dot(w1, a1_t, acc, input_precision=PRECISION)
            acc = tl.dot(w2, a2_t, acc, input_precision=PRECISION)
            acc = tl.dot(w3, a3_t, acc, input_precision=PRECISION)
    else:
        w = tl.load(w_ptrs, mask=w_mask, other=0.0).to(COMPUTE)
        acc = tl.dot(w, a_t, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _moe_gemm_kernel(
        a_ptr, stride_am, as_ptr, stride_asm, ag_ptr,
        w_ptr, stride_we, stride_wn,
        bs_ptr, stride_bse, stride_bsn,
        rs_ptr, stride_rse,
        out_ptr, stride_os, stride_om,
        sorted_ids_ptr, expert_ids_ptr, route_w_ptr,
        num_rows, N, K, num_m_blocks,
        A_ROW_DIV: tl.constexpr, FMT: tl.constexpr, GATED: tl.constexpr,
        ROUTE_WEIGHTED: tl.constexpr, SORTED: tl.constexpr, SPLIT_K: tl.constexpr,
        EVEN_K: tl.constexpr, NVFP4_MODE: tl.constexpr, W_CODES: tl.constexpr, A_FP4: tl.constexpr,
        COMPUTE: tl.constexpr, PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    # m fastest: the blocks of one expert (adjacent in sorted order) read the same weight tile
    # at about the same time, so a re-read hits L2
    pid_m = pid % num_m_blocks
    pid_n = pid // num_m_blocks
    offs_m = tl.arange(0, BLOCK_M)
    if SORTED:
        expert = tl.load(expert_ids_ptr + pid_m)
        if expert < 0:  # block past num_padded (grids have the static maximum size)
            return
        rows = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + offs_m)
    else:
        expert = pid_m * 0
        rows = pid_m * BLOCK_M + offs_m
    expert = expert.to(tl.int64)
    row_ok = rows < num_rows  # the sentinel (= num_rows) marks padding
    a_rows = (rows // A_ROW_DIV).to(tl.int64)
    # weight rows of this tile; a gated tile stacks the gate rows n and the up rows N + n, so one
    # MMA of 2 * BLOCK_N rows covers both
    if GATED:
        r = tl.arange(0, 2 * BLOCK_N)
        cols = pid_n * BLOCK_N + r % BLOCK_N
        w_rows = cols + (r // BLOCK_N) * N
    else:
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        w_rows = cols
    n_ok = cols < N

    k_per_split = tl.cdiv(K, SPLIT_K * BLOCK_K) * BLOCK_K
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)

    offs_k = tl.arange(0, BLOCK_K)
    if A_FP4:  # NVFP4 activation codes (2 per byte) and their block scales (mode 2)
        offs_ka = tl.arange(0, BLOCK_K // 2)
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_lo // 2 + offs_ka)[None, :]
        offs_kas = tl.arange(0, BLOCK_K // 16)
        as_ptrs = as_ptr + a_rows[:, None] * stride_asm + (k_lo // 16 + offs_kas)[None, :]
        a_step = BLOCK_K // 2
    else:
        offs_ka = offs_k
        a_ptrs = a_ptr + a_rows[:, None] * stride_am + (k_lo + offs_k)[None, :]
        offs_kas = tl.arange(0, 1)
        as_ptrs = a_ptrs  # unused
        a_step = BLOCK_K
    w_base = w_ptr + expert * stride_we + w_rows[:, None].to(tl.int64) * stride_wn
    if FMT == "nvfp4":  # W_CODES codes per loaded element: 2 (bytes) or 4 (16-bit elements)
        offs_kw = tl.arange(0, BLOCK_K // W_CODES)
        w_ptrs = w_base + (k_lo // W_CODES + offs_kw)[None, :]
        offs_ks = tl.arange(0, BLOCK_K // 16)
        s_ptrs = (bs_ptr + expert * stride_bse + w_rows[:, None].to(tl.int64) * stride_bsn
                  + (k_lo // 16 + offs_ks)[None, :])
        w_step = BLOCK_K // W_CODES
        s_step = BLOCK_K // 16
    else:
        offs_kw = offs_k
        w_ptrs = w_base + (k_lo + offs_kw)[None, :]
        offs_ks = tl.arange(0, 1)
        s_ptrs = w_ptrs  # unused
        w_step = BLOCK_K
        s_step = 0

    acc = tl.zeros((w_rows.shape[0], BLOCK_M), tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        if EVEN_K:
            a_mask = row_ok[:, None]
            as_mask = row_ok[:, None]
            w_mask = n_ok[:, None]
            s_mask = n_ok[:, None]
        else:
            if A_FP4:
                a_mask = row_ok[:, None] & (k0 + 2 * offs_ka < k_hi)[None, :]
            else:
                a_mask = row_ok[:, None] & (k0 + offs_k < k_hi)[None, :]
            as_mask = row_ok[:, None] & (k0 + 16 * offs_kas < k_hi)[None, :]
            if FMT == "nvfp4":
                w_mask = n_ok[:, None] & (k0 + W_CODES * offs_kw < k_hi)[None, :]
                s_mask = n_ok[:, None] & (k0 + 16 * offs_ks < k_hi)[None, :]
            else:
                w_mask = n_ok[:, None] & (k0 + offs_kw < k_hi)[None, :]
                s_mask = w_mask
        if A_FP4:
            a_t = tl.trans(tl.load(a_ptrs, mask=a_mask, other=0))
            a_scale = tl.load(as_ptrs, mask=as_mask, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(COMPUTE)
            a_t = tl.trans(a)
            a_scale = a_t  # unused
        if FMT == "nvfp4" and NVFP4_MODE != 2:
            # columns k = 4e + 2p + q: split q, then p -> the four code positions j = 2p + q
            a_q0, a_q1 = tl.split(tl.reshape(a, (BLOCK_M, BLOCK_K // 4, 2, 2)))
            a0, a2 = tl.split(a_q0)
            a1, a3 = tl.split(a_q1)
            a0_t = tl.trans(a0)
            a1_t = tl.trans(a1)
            a2_t = tl.trans(a2)
            a3_t = tl.trans(a3)
        else:
            a0_t = a_t
            a1_t = a_t
            a2_t = a_t
            a3_t = a_t
        acc = _tile_dot(acc, a_t, a_scale, a0_t, a1_t, a2_t, a3_t, w_ptrs, s_ptrs, w_mask, s_mask,
                        FMT, NVFP4_MODE, COMPUTE, PRECISION)
        a_ptrs += a_step
        as_ptrs += BLOCK_K // 16
        w_ptrs += w_step
        s_ptrs += s_step

    if FMT != "dense":
        gain = ASM_DECODE_GAIN if (FMT == "nvfp4" and NVFP4_MODE == 1) else 1.0
        acc = acc * (tl.load(rs_ptr + expert * stride_rse + w_rows, mask=n_ok, other=0.0) * gain)[:, None]
    if A_FP4:  # per-row scale of the NVFP4 activations
        acc = acc * tl.load(ag_ptr + a_rows, mask=row_ok, other=0.0)[None, :]
    if ROUTE_WEIGHTED:
        acc = acc * tl.load(route_w_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)[None, :]
    rows_out = rows[None, :].to(tl.int64) * stride_om
    if GATED and SPLIT_K == 1:
        gate, up = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
        h = gate / (1.0 + tl.exp(-gate)) * up
        h_cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + rows_out + h_cols[:, None], h.to(out_ptr.dtype.element_ty),
                 mask=(h_cols < N)[:, None] & row_ok[None, :])
    else:  # plain output, or f32 partials whose columns mirror the weight rows (gate | up)
        tl.store(out_ptr + pid_k * stride_os + rows_out + w_rows[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=n_ok[:, None] & row_ok[None, :])


@triton.jit
def _quant_rows_nvfp4_kernel(x_ptr, stride_xr, codes_ptr, scales_ptr, gain_ptr, K,
                             BLOCK_K: tl.constexpr):
    """One row of x -> NVFP4 (ModelOpt rounding, nvfp4.quantize with the row as the tensor):
    g = amax / (6 * 448); block scale E4M3(amax_16 / (6 g)) (0 -> 1, clamped to [2^-9, 448]);
    code = RNE_E2M1(x / (scale * g)); two codes per byte, low nibble first."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    x = tl.load(x_ptr + r * stride_xr + offs, mask=offs < K, other=0.0).to(tl.float32)
    g = tl.max(tl.abs(x), axis=0) / (6.0 * 448.0)
    g = tl.where(g > 0, g, 1.0)
    xb = tl.reshape(x, (BLOCK_K // 16, 16))
    sb = tl.math.div_rn(tl.max(tl.abs(xb), axis=1), 6.0 * g)
    sb = tl.where(sb == 0, 1.0, sb)
    sb = tl.minimum(tl.maximum(sb, 2.0 ** -9), 448.0).to(tl.float8e4nv)
    q = tl.math.div_rn(xb, (sb.to(tl.float32) * g)[:, None])
    a = tl.abs(q)
    # SPEC §2.1 thresholds: nearest, ties to even
    idx = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
           + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
           + (a > 5.0).to(tl.int32))
    code = idx | ((q < 0).to(tl.int32) << 3)
    lo, hi = tl.split(tl.reshape(code, (BLOCK_K // 2, 2)))
    byte_offs = tl.arange(0, BLOCK_K // 2)
    tl.store(codes_ptr + r * (K // 2) + byte_offs, (lo | (hi << 4)).to(tl.uint8), mask=byte_offs < K // 2)
    blk = tl.arange(0, BLOCK_K // 16)
    tl.store(scales_ptr + r * (K // 16) + blk, sb, mask=blk < K // 16)
    tl.store(gain_ptr + r, g)


@triton.jit
def _silu_mul_reduce_kernel(ws_ptr, stride_ws, stride_wr, out_ptr, stride_or, N,
                            SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """out[r] = silu(sum_s gate_s[r]) * sum_s up_s[r], splits summed in order."""
    r = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    g = tl.zeros((BLOCK,), tl.float32)
    u = tl.zeros((BLOCK,), tl.float32)
    for s in tl.static_range(SPLIT_K):
        base = ws_ptr + s * stride_ws + r * stride_wr
        g += tl.load(base + offs, mask=ok, other=0.0)
        u += tl.load(base + N + offs, mask=ok, other=0.0)
    h = g / (1.0 + tl.exp(-g)) * u
    tl.store(out_ptr + r * stride_or + offs, h.to(out_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _sum_reduce_kernel(part_ptr, stride_ps, stride_pr, out_ptr, stride_ot, N,
                       GROUP: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = sum_{j < GROUP} sum_s part[s, t * GROUP + j] (top-k combine), fixed order. PDL: launched with
    programmatic dependent launch, waits for the previous kernel (which wrote part) before reading."""
    if PDL:
        gdc_wait()
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), tl.float32)
    for j in tl.static_range(GROUP):
        for s in tl.static_range(SPLIT_K):
            acc += tl.load(part_ptr + s * stride_ps + (t * GROUP + j) * stride_pr + offs, mask=ok, other=0.0)
    tl.store(out_ptr + t * stride_ot + offs, acc.to(out_ptr.dtype.element_ty), mask=ok)


# ---------------------------------------------------------------------------------------------
# Configuration

# tl.dot needs K >= 16 per MMA; an NVFP4 tile is consumed as 4 dots of BLOCK_K / 4 columns
MIN_BLOCK_K = {"dense": 16, "fp8": 16, "nvfp4": 64}


@dataclass(frozen=True)
class GemmConfig:
    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


def _num_sms(device) -> int:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _split_k(programs: int, k_steps: int, num_sms: int) -> int:
    """Smallest power of two giving >= 1 program per SM, keeping >= 2 K steps per split."""
    split = 1
    while programs * split < num_sms and split * 2 <= 8 and k_steps // (split * 2) >= 2:
        split *= 2
    return split


def moe_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """Rows per expert block, by the mean number of pairs per expert."""
    mean = num_tokens * top_k / num_experts
    if mean <= 8:
        return 16
    if mean <= 24:
        return 32
    if mean <= 48:
        return 64
    return 128


def default_config(fmt: str, gated: bool, block_m: int, active_blocks: int, N: int, K: int,
                   device) -> GemmConfig:
    """Config for one grouped GEMM. `active_blocks` estimates how many row blocks carry work
    (decode: min(E, pairs)); it only steers split-K so that small batches still fill the SMs."""
    block_k = 128 if fmt in ("nvfp4", "fp8") else 64
    block_k = min(block_k, max(MIN_BLOCK_K[fmt], triton.next_power_of_2(K)))
    # a gated tile stacks gate and up rows (2 * block_n weight rows): 128 rows either way
    block_n = 64 if gated or block_m >= 128 else 128
    block_n = min(block_n, max(16, triton.next_power_of_2(N)))
    num_warps = 8 if block_m >= 128 else 4
    num_stages = 3  # ~64 KB of shared memory at decode sizes: 3 programs per SM
    programs = active_blocks * triton.cdiv(N, block_n)
    split = _split_k(programs, triton.cdiv(K, block_k), _num_sms(device))
    return GemmConfig(block_m, block_n, block_k, split, num_warps, num_stages)


def _config_override(name: str) -> GemmConfig | None:
    """LINRNN_MOE_<NAME>_CONFIG="bm,bn,bk,split,warps,stages" (benchmark sweeps)."""
    spec = os.environ.get(f"LINRNN_MOE_{name.upper()}_CONFIG")
    if not spec:
        return None
    return GemmConfig(*(int(v) for v in spec.split(",")))


# ---------------------------------------------------------------------------------------------
# NVFP4 path selection

_logged_path: str | None = None


def nvfp4_gemm_path(device=None) -> str:
    """The NVFP4 GEMM implementation this process uses on `device`: "dot_scaled" (W4A4 on FP4
    tensor cores, compute capability >= 10.0, untested), "asm" (W4A16, dequantize in registers with
    inline PTX: sm_89 / sm_90), or "triton" (W4A16 with plain Triton ops: the interpreter, or when
    forced). LINRNN_NVFP4_GEMM=asm|triton|dot_scaled overrides (asm keeps W4A16 numerics on sm_100)."""
    forced = os.environ.get("LINRNN_NVFP4_GEMM", "auto")
    if forced == "mma":  # the MMA-fragment decode kernel (nvfp4_mma.py); this file's paths run as auto
        forced = "auto"
    if forced in NVFP4_MODES:
        return forced
    if forced != "auto":
        raise ValueError(f"LINRNN_NVFP4_GEMM={forced!r}: expected auto, {', '.join(NVFP4_MODES)}")
    if os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return "triton"
    major, _ = torch.cuda.get_device_capability(device)
    return "dot_scaled" if major >= 10 else "asm"


def describe_nvfp4_gemm(device=None) -> str:
    """One line for the startup log, e.g.
    "NVFP4 GEMM: W4A16, dequantize-in-register (inline PTX E2M1 decode) (sm_90)"."""
    path = nvfp4_gemm_path(device)
    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        major, minor = torch.cuda.get_device_capability(device)
        arch = f"sm_{major}{minor}"
    else:
        arch = "interpreter"
    what = {"asm": "W4A16, dequantize-in-register (inline PTX E2M1 decode)",
            "triton": "W4A16, dequantize-in-register (Triton integer decode)",
            "dot_scaled": "W4A4, tl.dot_scaled e2m1 x e2m1 on FP4 tensor cores (activations "
                          "quantized to NVFP4; UNTESTED)"}[path]
    from linrnn_kernels.moe import nvfp4_mma

    if path != "dot_scaled" and nvfp4_mma.available(device):
        what = "W4A16, MMA-fragment Gluon kernel for decode batches (repacked experts), " + what + " otherwise"
    return f"NVFP4 GEMM: {what} ({arch})"


def _log_path_once(device):
    global _logged_path
    if _logged_path is None:
        _logged_path = describe_nvfp4_gemm(device)
        logger.info(_logged_path)


# ---------------------------------------------------------------------------------------------
# Launchers

def alloc(*shape, dtype, device):
    """Every output and intermediate buffer comes from here (tests swap in a NaN-filling version
    to catch elements the kernels fail to write)."""
    return torch.empty(*shape, dtype=dtype, device=device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _compute_dtype(x: torch.Tensor):
    """The MMA input dtype. The interpreter cannot do bf16 arithmetic (it stores bf16 as raw
    uint16), so kernels compute in f32 there; on the GPU the activation dtype."""
    if _interpreting() or x.dtype == torch.float32:
        return tl.float32, "ieee"  # f32 models must not silently drop to tf32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype], None


def check_weight(w: WeightTensor, name: str, experts: int | None, n: int, k: int):
    """Validate a WeightTensor against the expected logical [(E,) n, k] shape, with clear errors."""
    if w.fmt not in FORMATS:
        raise ValueError(f"{name}: unknown weight format {w.fmt!r} (expected one of {FORMATS})")
    lead = () if experts is None else (experts,)
    cols = k // 2 if w.fmt == "nvfp4" else k
    if tuple(w.data.shape) != (*lead, n, cols):
        raise ValueError(f"{name}: {w.fmt} data has shape {tuple(w.data.shape)}, expected {(*lead, n, cols)}")
    if w.data.stride(-1) != 1:
        raise ValueError(f"{name}: weight rows must be contiguous along K")
    if w.fmt == "nvfp4":
        if k % 32:
            raise ValueError(f"{name}: NVFP4 in_features {k} must be a multiple of 32")
        if w.data.dtype != torch.uint8:
            raise ValueError(f"{name}: NVFP4 data must be uint8, got {w.data.dtype}")
        if w.block_scale is None or tuple(w.block_scale.shape) != (*lead, n, k // 16):
            got = None if w.block_scale is None else tuple(w.block_scale.shape)
            raise ValueError(f"{name}: NVFP4 block_scale has shape {got}, expected {(*lead, n, k // 16)}")
        if w.block_scale.dtype != torch.float8_e4m3fn or w.block_scale.stride(-1) != 1:
            raise ValueError(f"{name}: NVFP4 block_scale must be contiguous float8_e4m3fn")
    if w.fmt == "fp8" and w.data.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{name}: fp8 data must be float8_e4m3fn, got {w.data.dtype}")
    if w.fmt in ("nvfp4", "fp8"):
        if w.row_scale is None or tuple(w.row_scale.shape) != (*lead, n):
            got = None if w.row_scale is None else tuple(w.row_scale.shape)
            raise ValueError(f"{name}: row_scale has shape {got}, expected {(*lead, n)}")
        if w.row_scale.dtype != torch.float32 or w.row_scale.stride(-1) != 1:
            raise ValueError(f"{name}: row_scale must be contiguous float32")


def quantize_rows_nvfp4(x: torch.Tensor):
    """x [R, K] -> (codes uint8 [R, K/2], block scales float8_e4m3fn [R, K/16], row scale f32 [R])
    with x[r, k] ~= E2M1(code) * scale[r, k // 16] * row_scale[r] (W4A4 activations, mode 2)."""
    R, K = x.shape
    if K % 16:
        raise ValueError(f"NVFP4 activation quantization needs K % 16 == 0, got K={K}")
    codes = alloc(R, K // 2, dtype=torch.uint8, device=x.device)
    scales = alloc(R, K // 16, dtype=torch.float8_e4m3fn, device=x.device)
    gain = alloc(R, dtype=torch.float32, device=x.device)
    if R:
        _quant_rows_nvfp4_kernel[(R,)](x, x.stride(0), codes, scales, gain, K,
                                       BLOCK_K=max(32, triton.next_power_of_2(K)), num_warps=4)
    return codes, scales, gain


def launch_gemm(a: torch.Tensor, w: WeightTensor, out: torch.Tensor, cfg: GemmConfig, *,
                num_rows: int, n: int, k: int, num_m_blocks: int, sorted_ids=None, expert_ids=None,
                route_weights=None, a_row_div: int = 1, gated: bool = False,
                nvfp4_path: str | None = None):
    """One grouped GEMM launch. `out` is [rows, n] (gated, split 1: SiLU(gate)*up), or f32
    [split, rows, n or 2n] partials when cfg.split_k > 1; other outputs [split, rows, n]."""
    if cfg.block_k < MIN_BLOCK_K[w.fmt]:
        raise ValueError(f"block_k={cfg.block_k} is below {MIN_BLOCK_K[w.fmt]} for {w.fmt} weights "
                         f"(each MMA needs K >= 16)")
    compute, precision = _compute_dtype(a)
    mode = NVFP4_MODES[nvfp4_path or nvfp4_gemm_path(a.device)] if w.fmt == "nvfp4" else 0
    if w.fmt == "nvfp4" and a.is_cuda:
        _log_path_once(a.device)
    a_codes = a_scales = a_gain = a
    if mode == 2:  # W4A4: the activation rows go to NVFP4 first
        a_codes, a_scales, a_gain = quantize_rows_nvfp4(a)
        # FP4 MMAs take 128 weight rows; narrower dot_scaled tiles hit a Triton 3.6 assertion
        cfg = dataclasses.replace(cfg, block_n=max(cfg.block_n, 64 if gated else 128))
    num_stages = cfg.num_stages
    if mode in (0, 1) and a.is_cuda and torch.cuda.get_device_capability(a.device)[0] >= 10:
        # Triton 3.6's software pipeliner asserts on the register-decoded NVFP4 operand when
        # targeting sm_100 (seen compiling offline); unpipelined it compiles
        num_stages = 1
    stacked = w.data.dim() == 3
    bs = w.block_scale if w.fmt == "nvfp4" else w.data
    data, w_codes = w.data, 1
    if w.fmt == "nvfp4":
        # the dequantizing paths read 16-bit elements of 4 codes (zero-copy view; rows are 32-code
        # multiples); dot_scaled wants the bytes
        data, w_codes = (w.data, 2) if mode == 2 else (w.data.view(torch.int16), 4)
    rs = w.row_scale if w.row_scale is not None else w.data
    sorted_flag = sorted_ids is not None
    dummy = out
    split_stride = out.stride(0) if out.dim() == 3 else 0
    grid = (num_m_blocks * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _moe_gemm_kernel[grid](
        a_codes, a_codes.stride(0), a_scales, a_scales.stride(0), a_gain,
        data, data.stride(0) if stacked else 0, data.stride(-2),
        bs, bs.stride(0) if (stacked and w.fmt == "nvfp4") else 0, bs.stride(-2) if w.fmt == "nvfp4" else 0,
        rs, rs.stride(0) if (stacked and w.row_scale is not None) else 0,
        out, split_stride, out.stride(-2),
        sorted_ids if sorted_flag else dummy, expert_ids if sorted_flag else dummy,
        route_weights if route_weights is not None else dummy,
        num_rows, n, k, num_m_blocks,
        A_ROW_DIV=a_row_div, FMT=w.fmt, GATED=gated, ROUTE_WEIGHTED=route_weights is not None,
        SORTED=sorted_flag, SPLIT_K=cfg.split_k, EVEN_K=k % (cfg.block_k * cfg.split_k) == 0,
        NVFP4_MODE=mode, W_CODES=w_codes, A_FP4=mode == 2, COMPUTE=compute, PRECISION=precision,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=num_stages)


def silu_mul_reduce(ws: torch.Tensor, out: torch.Tensor):
    split, rows, two_n = ws.shape
    n = two_n // 2
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul_reduce_kernel[(rows, triton.cdiv(n, block))](
        ws, ws.stride(0), ws.stride(1), out, out.stride(0), n, SPLIT_K=split, BLOCK=block, num_warps=4)


def sum_reduce(part: torch.Tensor, out: torch.Tensor, group: int, pdl: bool = False):
    """out[t] = sum over the group's rows and the splits of part [split, rows, n]. pdl: launched with programmatic
    dependent launch (the previous kernel may still run: it must have written nothing else this reads)."""
    split, rows, n = part.shape
    block = min(1024, triton.next_power_of_2(n))
    _sum_reduce_kernel[(rows // group, triton.cdiv(n, block))](
        part, part.stride(0), part.stride(1), out, out.stride(0), n,
        GROUP=group, SPLIT_K=split, BLOCK=block, PDL=pdl, num_warps=4, **({"launch_pdl": True} if pdl else {}))
