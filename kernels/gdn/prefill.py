"""Chunked Gated-DeltaNet prefill for a flattened varlen batch (SPEC §1.5 step 7, chunk form).

Per sequence and value head, tokens are cut into chunks of BT = 64 (the last one partial). Within a
chunk, with k, q L2-normalised (q also scaled by Dk^-1/2), gc the in-chunk cumulative sum of g and
D_ij = exp(gc_i - gc_j):
    A   = strict_lower(diag(beta) K K^T * D)                  (KK^T with decay)
    T   = (I + A)^-1                                          (UT transform: triangular solve)
    W   = T diag(beta exp(gc)) K,   U = T diag(beta) V        (w/u recompute, WY form)
    V'  = U - W S                                             (delta-rule residual against the chunk's start state)
    O   = diag(exp(gc)) Q S + (Q K^T * D)_causal V'
    S  <- exp(gc_last) S + (diag(exp(gc_last - gc)) K)^T V'   (inter-chunk recurrence)
which equals the token-by-token recurrence exactly in real arithmetic (naive.chunk_gated_delta_rule).

Three launches (same split as flash-linear-attention, our own kernels):
  1. _chunk_wy_kernel     (chunk x value head, parallel): gates, gc, A, T, W, U.
     T is built from four 16x16 diagonal blocks solved by forward substitution (stable even for
     near-parallel keys, where a Neumann/doubling inverse cancels catastrophically), merged by
     block formulas.
  2. _chunk_state_kernel  (sequence x value head x Dv tile, sequential over chunks): loads the pooled
     state (f32 or bf16 partition, each in its layout: layout.py), stores each chunk's start state H_c
     ([Dk, Dv] scratch) and V', writes the final state back into the head's partition. This is the only
     sequential part, kept to two matmuls per chunk.
  3. _chunk_output_kernel (chunk x value head x Dv tile, parallel): O from H_c and V'.

Precision modes (`precision`, or LINRNN_GDN_PREFILL_PRECISION):
  "bf16"   matmul operands and the W/U/V'/H scratch in bf16, f32 accumulation (what fla does; the running
           state stays f32 in registers and is written back exactly). Default for bf16 activations.
           A torch emulation at Qwen3.5 shapes (512 tokens) puts o within 4e-3 and the final f32 state
           within 3e-3 (relative Frobenius) of exact f32 arithmetic.
  "tf32"   f32 scratch, TF32 tensor-core matmuls: o 2e-3 (the bf16 output rounding), state 4e-4.
  "ieee"   exact f32 (default for f32 activations): a correctness mode; its FMA matmuls spill on sm_90.
  "tf32x3" near-f32 on tensor cores; also spills at these tiles (kept for experiments).

No host syncs: the chunk table (VarlenPlan) is built on the device with an upper bound T/64 + B on the chunk
count, once per forward by the model and shared by every layer.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from linrnn_kernels.gdn.common import (
    INTERPRET, check_pools, check_qkv, gates, head_state_offset, load_state, num_sms, rows_view, store_state,
)
from linrnn_kernels.gdn.layout import bf16_block

BT = 64  # chunk length
BC = 16  # diagonal block of the triangular solve
PRECISIONS = ("bf16", "tf32", "tf32x3", "ieee")


@triton.jit
def _mm(a, b, DOT_BF16: tl.constexpr, PREC: tl.constexpr):
    """a @ b, f32 accumulate. DOT_BF16: bf16 operands (tensor-core bf16 MMA); else f32 operands at PREC."""
    if DOT_BF16:
        if PREC == "interpret":  # the interpreter cannot multiply bf16 blocks: round, then multiply in f32
            return tl.dot(a.to(tl.bfloat16).to(tl.float32), b.to(tl.bfloat16).to(tl.float32), input_precision="ieee")
        return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16))
    else:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision=PREC)


# ---- 1. intra-chunk: gates, cumulative decay, UT transform, W and U ---------------------------------
# q and k stay raw (bf16 activations are exact bf16 matmul operands); the L2 norms, beta and decays are
# applied as row / column scalings of the results or of the small 16x16 blocks instead.


@triton.jit
def _rnorm(x):
    """1 / ||row|| of a raw [rows, D] tile, in f32 (SPEC §1.4 #3: rsqrt(sum x^2 + 1e-6))."""
    x = x.to(tl.float32)
    return tl.rsqrt(tl.sum(x * x, 1) + 1e-6)


@triton.jit
def _kkt_block(ki, kj, si, sj, gc_i, gc_j, DIAG: tl.constexpr, SUB: tl.constexpr, DOT_BF16: tl.constexpr,
               PREC: tl.constexpr):
    """Block (i, j) of A = diag(beta) Kn Kn^T * D from raw keys: (k_i k_j^T) * si sj^T * D with
    si = beta_i / ||k_i||, sj = 1 / ||k_j||; strictly lower on a diagonal block (DIAG)."""
    o = tl.arange(0, SUB)
    if DIAG:
        keep = o[:, None] > o[None, :]
        decay = tl.where(keep, tl.exp(tl.where(keep, gc_i[:, None] - gc_j[None, :], 0.0)), 0.0)
    else:  # i > j: every entry lies below the diagonal, gc_i <= gc_j
        decay = tl.exp(gc_i[:, None] - gc_j[None, :])
    return _mm(ki, tl.trans(kj), DOT_BF16, PREC) * (si[:, None] * sj[None, :]) * decay


@triton.jit
def _stack4(x0, x1, x2, x3):
    """[NB=4, R, C] batch from four [R, C] blocks."""
    # join stacks along a new last axis: [R, C, 2, 2] with [..., i, jj] = (x0, x2 | x1, x3)[jj][i] -> block 2i + jj
    j = tl.join(tl.join(x0, x2), tl.join(x1, x3))
    return tl.permute(tl.reshape(j, [x0.shape[0], x0.shape[1], 4]), (2, 0, 1))


@triton.jit
def _pick(x, j, NB: tl.constexpr):
    """Block j of a [NB, ...] batch (2-D or 3-D)."""
    sel = tl.arange(0, NB) == j
    if len(x.shape) == 3:
        return tl.sum(tl.where(sel[:, None, None], x, 0.0), 0)
    else:
        return tl.sum(tl.where(sel[:, None], x, 0.0), 0)


@triton.jit
def _subst_row(negA, X, i, SUB: tl.constexpr):
    """Row i of the forward substitution X = I - A X on a batch of strictly-lower blocks [NB, SUB, SUB]
    (X holds X - I on rows < i, and -A on the rows not yet done)."""
    o = tl.arange(0, SUB)
    row = tl.sum(tl.where(((o == i)[:, None] & (o < i)[None, :])[None, :, :], negA, 0.0), 1)  # [NB, SUB]
    row = row + tl.sum(row[:, :, None] * X, 1)
    return tl.where((o == i)[None, :, None], row[:, None, :], X)


@triton.jit
def _block_row(X0, X1, X2, X3, s0, s1, s2, s3, y0, y1, y2, y3, I: tl.constexpr, DOT_BF16: tl.constexpr,
               PREC: tl.constexpr):
    """sum_{j <= I} (X_j diag(s_j)) @ y_j: row-block I of T diag(s) Y, the scaling on T's small blocks."""
    acc = _mm(X0 * s0[None, :], y0, DOT_BF16, PREC)
    if I >= 1:
        acc += _mm(X1 * s1[None, :], y1, DOT_BF16, PREC)
    if I >= 2:
        acc += _mm(X2 * s2[None, :], y2, DOT_BF16, PREC)
    if I >= 3:
        acc += _mm(X3 * s3[None, :], y3, DOT_BF16, PREC)
    return acc


@triton.jit
def _store_rows(p, x, m, W: tl.constexpr):
    tl.store(p + tl.arange(0, W)[None, :], x.to(p.dtype.element_ty), mask=m[:, None])


@triton.jit
def _chunk_wy_kernel(
    k, v, a, b, A_log, dt_bias, cu_seqlens, chunk_seq, chunk_t0,
    gc_out, w_out, u_out,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, SUB: tl.constexpr,
    DOT_BF16: tl.constexpr, PREC: tl.constexpr, SOLVE_PREC: tl.constexpr,
):
    NB: tl.constexpr = 4  # sub-chunks of SUB rows (BT = NB * SUB)
    i_c = tl.program_id(0)
    i_h = tl.program_id(1)
    seq = tl.load(chunk_seq + i_c)
    if seq < 0:  # chunk slot beyond the batch's real chunk count
        return
    t0 = tl.load(chunk_t0 + i_c).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    i_hk = i_h // GROUP
    o_b = tl.arange(0, NB)
    o_i = tl.arange(0, SUB)
    r = t0 + o_b[:, None] * SUB + o_i[None, :]  # [NB, SUB] token rows, sub-chunk-major
    m = r < eos
    g, beta = gates(tl.load(a + r * stride_a_tok + i_h, mask=m, other=0.0),
                    tl.load(b + r * stride_b_tok + i_h, mask=m, other=0.0),
                    tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    g = tl.where(m, g, 0.0)  # rows past the end: no decay; beta 0 and k 0 make them inert
    beta = tl.where(m, beta, 0.0)
    # cumulative log-decay over the 64-token chunk: within each sub-chunk + the sub-chunks before it
    g_tot = tl.sum(g, 1)
    gc = tl.cumsum(g, 1) + (tl.cumsum(g_tot, 0) - g_tot)[:, None]
    tl.store(gc_out + r * HV + i_h, gc, mask=m)
    gc0, gc1, gc2, gc3 = _pick(gc, 0, NB), _pick(gc, 1, NB), _pick(gc, 2, NB), _pick(gc, 3, NB)
    b0, b1, b2, b3 = _pick(beta, 0, NB), _pick(beta, 1, NB), _pick(beta, 2, NB), _pick(beta, 3, NB)

    r0, r1, r2, r3 = t0 + o_i, t0 + SUB + o_i, t0 + 2 * SUB + o_i, t0 + 3 * SUB + o_i
    m0, m1, m2, m3 = r0 < eos, r1 < eos, r2 < eos, r3 < eos
    p_k = k + i_hk * stride_k_head + tl.arange(0, DK)[None, :]
    k0 = tl.load(p_k + r0[:, None] * stride_k_tok, mask=m0[:, None], other=0.0)
    k1 = tl.load(p_k + r1[:, None] * stride_k_tok, mask=m1[:, None], other=0.0)
    k2 = tl.load(p_k + r2[:, None] * stride_k_tok, mask=m2[:, None], other=0.0)
    k3 = tl.load(p_k + r3[:, None] * stride_k_tok, mask=m3[:, None], other=0.0)
    n0, n1, n2, n3 = _rnorm(k0), _rnorm(k1), _rnorm(k2), _rnorm(k3)

    # A = diag(beta) Kn Kn^T * D: the diagonal blocks batched for the substitution, then the rest
    negA = -_stack4(_kkt_block(k0, k0, b0 * n0, n0, gc0, gc0, True, SUB, DOT_BF16, PREC),
                    _kkt_block(k1, k1, b1 * n1, n1, gc1, gc1, True, SUB, DOT_BF16, PREC),
                    _kkt_block(k2, k2, b2 * n2, n2, gc2, gc2, True, SUB, DOT_BF16, PREC),
                    _kkt_block(k3, k3, b3 * n3, n3, gc3, gc3, True, SUB, DOT_BF16, PREC))
    A10 = _kkt_block(k1, k0, b1 * n1, n0, gc1, gc0, False, SUB, DOT_BF16, PREC)
    A20 = _kkt_block(k2, k0, b2 * n2, n0, gc2, gc0, False, SUB, DOT_BF16, PREC)
    A21 = _kkt_block(k2, k1, b2 * n2, n1, gc2, gc1, False, SUB, DOT_BF16, PREC)
    A30 = _kkt_block(k3, k0, b3 * n3, n0, gc3, gc0, False, SUB, DOT_BF16, PREC)
    A31 = _kkt_block(k3, k1, b3 * n3, n1, gc3, gc1, False, SUB, DOT_BF16, PREC)
    A32 = _kkt_block(k3, k2, b3 * n3, n2, gc3, gc2, False, SUB, DOT_BF16, PREC)
    # (I + A_jj)^-1 by forward substitution (stable for near-parallel keys, unlike a Neumann/doubling inverse)
    X = negA
    for i in range(2, SUB):  # rows 0 and 1 of -A are already rows of X - I
        X = _subst_row(negA, X, i, SUB)
    X += (o_i[:, None] == o_i[None, :]).to(tl.float32)[None, :, :]
    X00, X11, X22, X33 = _pick(X, 0, NB), _pick(X, 1, NB), _pick(X, 2, NB), _pick(X, 3, NB)
    # off-diagonal blocks of T = (I + A)^-1: X_ij = -X_ii sum_{j <= m < i} A_im X_mj
    X10 = -_mm(X11, _mm(A10, X00, False, SOLVE_PREC), False, SOLVE_PREC)
    X21 = -_mm(X22, _mm(A21, X11, False, SOLVE_PREC), False, SOLVE_PREC)
    X32 = -_mm(X33, _mm(A32, X22, False, SOLVE_PREC), False, SOLVE_PREC)
    X20 = -_mm(X22, _mm(A20, X00, False, SOLVE_PREC) + _mm(A21, X10, False, SOLVE_PREC), False, SOLVE_PREC)
    X31 = -_mm(X33, _mm(A31, X11, False, SOLVE_PREC) + _mm(A32, X21, False, SOLVE_PREC), False, SOLVE_PREC)
    X30 = -_mm(X33, _mm(A30, X00, False, SOLVE_PREC) + _mm(A31, X10, False, SOLVE_PREC)
               + _mm(A32, X20, False, SOLVE_PREC), False, SOLVE_PREC)

    # W = T diag(beta exp(gc) / ||k||) K
    s0, s1, s2, s3 = b0 * n0 * tl.exp(gc0), b1 * n1 * tl.exp(gc1), b2 * n2 * tl.exp(gc2), b3 * n3 * tl.exp(gc3)
    p_w = w_out + i_h * DK
    _store_rows(p_w + r0[:, None] * (HV * DK),
                _block_row(X00, X00, X00, X00, s0, s0, s0, s0, k0, k0, k0, k0, 0, DOT_BF16, PREC), m0, DK)
    _store_rows(p_w + r1[:, None] * (HV * DK),
                _block_row(X10, X11, X11, X11, s0, s1, s1, s1, k0, k1, k1, k1, 1, DOT_BF16, PREC), m1, DK)
    _store_rows(p_w + r2[:, None] * (HV * DK),
                _block_row(X20, X21, X22, X22, s0, s1, s2, s2, k0, k1, k2, k2, 2, DOT_BF16, PREC), m2, DK)
    _store_rows(p_w + r3[:, None] * (HV * DK),
                _block_row(X30, X31, X32, X33, s0, s1, s2, s3, k0, k1, k2, k3, 3, DOT_BF16, PREC), m3, DK)

    # U = T diag(beta) V
    p_v = v + i_h * stride_v_head + tl.arange(0, DV)[None, :]
    v0 = tl.load(p_v + r0[:, None] * stride_v_tok, mask=m0[:, None], other=0.0)
    v1 = tl.load(p_v + r1[:, None] * stride_v_tok, mask=m1[:, None], other=0.0)
    v2 = tl.load(p_v + r2[:, None] * stride_v_tok, mask=m2[:, None], other=0.0)
    v3 = tl.load(p_v + r3[:, None] * stride_v_tok, mask=m3[:, None], other=0.0)
    p_u = u_out + i_h * DV
    _store_rows(p_u + r0[:, None] * (HV * DV),
                _block_row(X00, X00, X00, X00, b0, b0, b0, b0, v0, v0, v0, v0, 0, DOT_BF16, PREC), m0, DV)
    _store_rows(p_u + r1[:, None] * (HV * DV),
                _block_row(X10, X11, X11, X11, b0, b1, b1, b1, v0, v1, v1, v1, 1, DOT_BF16, PREC), m1, DV)
    _store_rows(p_u + r2[:, None] * (HV * DV),
                _block_row(X20, X21, X22, X22, b0, b1, b2, b2, v0, v1, v2, v2, 2, DOT_BF16, PREC), m2, DV)
    _store_rows(p_u + r3[:, None] * (HV * DV),
                _block_row(X30, X31, X32, X33, b0, b1, b2, b3, v0, v1, v2, v3, 3, DOT_BF16, PREC), m3, DV)


# ---- 2. inter-chunk state recurrence (sequential over a sequence's chunks) -----------------------------


@triton.jit
def _chunk_state_kernel(
    k, w, u, gc, cu_seqlens, chunk_offsets, state_indices,
    ssm_f32, ssm_bf16, head_is_bf16, head_local,
    h_out, vnew_out,
    stride_k_tok, stride_k_head, stride_f32_slot, stride_bf16_slot,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr, BF16_BLOCK: tl.constexpr,
):
    NV: tl.constexpr = DV // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_nh = pid // NV
    i_n = i_nh // HV
    i_h = i_nh % HV
    i_hk = i_h // GROUP
    bos = tl.load(cu_seqlens + i_n).to(tl.int64)
    eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    if eos == bos:  # an empty sequence (CUDA-graph padding, runner/prefill_graphs.py): its state is unchanged
        return
    first_chunk = tl.load(chunk_offsets + i_n).to(tl.int64)
    slot = tl.load(state_indices + i_n)

    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    offs = o_k[:, None] * DV + o_v[None, :]  # of the per-chunk states h ([Dk, Dv] per head)
    is_bf16, base = head_state_offset(head_is_bf16, head_local, i_h, slot, stride_f32_slot, stride_bf16_slot, DK, DV)
    s = load_state(ssm_f32, ssm_bf16, is_bf16, base, i_v, BV, DK, DV, BF16_BLOCK, "", "")

    for c in range(tl.cdiv(eos - bos, BT)):
        t = bos + c * BT + o_t
        m_t = t < eos
        tl.store(h_out + ((first_chunk + c) * HV + i_h) * (DK * DV) + offs, s.to(h_out.dtype.element_ty))
        b_w = tl.load(w + (t * HV + i_h)[:, None] * DK + o_k[None, :], mask=m_t[:, None], other=0.0)
        b_u = tl.load(u + (t * HV + i_h)[:, None] * DV + o_v[None, :], mask=m_t[:, None], other=0.0)
        v_new = b_u.to(tl.float32) - _mm(b_w, s, DOT_BF16, PREC)
        tl.store(vnew_out + (t * HV + i_h)[:, None] * DV + o_v[None, :], v_new.to(vnew_out.dtype.element_ty),
                 mask=m_t[:, None])
        b_gc = tl.load(gc + t * HV + i_h, mask=m_t, other=0.0)
        g_last = tl.load(gc + (tl.minimum(bos + c * BT + BT, eos) - 1) * HV + i_h)
        b_k = tl.load(k + t[:, None] * stride_k_tok + i_hk * stride_k_head + o_k[None, :], mask=m_t[:, None],
                      other=0.0)
        # S <- exp(g_last) S + Kn^T diag(exp(g_last - gc)) V', the row scaling applied to V' (raw keys)
        row_scale = tl.where(m_t, _rnorm(b_k) * tl.exp(g_last - b_gc), 0.0)
        s = s * tl.exp(g_last) + _mm(tl.trans(b_k), v_new * row_scale[:, None], DOT_BF16, PREC)

    store_state(ssm_f32, ssm_bf16, is_bf16, base, i_v, s, BV, DK, DV, BF16_BLOCK, "", "")


# ---- 3. outputs (parallel over chunks) ------------------------------------------------------------------


@triton.jit
def _chunk_output_kernel(
    q, k, gc, h, v_new, cu_seqlens, chunk_seq, chunk_t0, o,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    BT: tl.constexpr, DOT_BF16: tl.constexpr, PREC: tl.constexpr,
):
    NV: tl.constexpr = DV // BV
    i_c = tl.program_id(0)
    i_v = tl.program_id(1) % NV
    i_h = tl.program_id(1) // NV
    seq = tl.load(chunk_seq + i_c)
    if seq < 0:
        return
    t0 = tl.load(chunk_t0 + i_c).to(tl.int64)
    eos = tl.load(cu_seqlens + seq + 1).to(tl.int64)
    i_hk = i_h // GROUP
    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    t = t0 + o_t
    m_t = t < eos
    b_q = tl.load(q + t[:, None] * stride_q_tok + i_hk * stride_q_head + o_k[None, :], mask=m_t[:, None], other=0.0)
    b_k = tl.load(k + t[:, None] * stride_k_tok + i_hk * stride_k_head + o_k[None, :], mask=m_t[:, None], other=0.0)
    q_scale = _rnorm(b_q) * scale
    b_gc = tl.load(gc + t * HV + i_h, mask=m_t, other=0.0)
    causal = (o_t[:, None] >= o_t[None, :]) & m_t[:, None] & m_t[None, :]
    decay = tl.where(causal, tl.exp(tl.where(causal, b_gc[:, None] - b_gc[None, :], 0.0)), 0.0)
    # (Qn Kn^T * D) from raw q, k: row scale |q|^-1 * scale, column scale |k|^-1
    attn = _mm(b_q, tl.trans(b_k), DOT_BF16, PREC) * (q_scale[:, None] * _rnorm(b_k)[None, :]) * decay
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_h) * (DK * DV) + o_k[:, None] * DV + o_v[None, :])
    b_vn = tl.load(v_new + (t * HV + i_h)[:, None] * DV + o_v[None, :], mask=m_t[:, None], other=0.0)
    b_o = _mm(b_q, b_h, DOT_BF16, PREC) * (q_scale * tl.exp(b_gc))[:, None] + _mm(attn, b_vn, DOT_BF16, PREC)
    tl.store(o + (t * HV + i_h)[:, None] * DV + o_v[None, :], b_o.to(o.dtype.element_ty), mask=m_t[:, None])


# ---- launcher -----------------------------------------------------------------------------------------------


class VarlenPlan(NamedTuple):
    """Device-side bookkeeping of a flattened varlen batch, shared by every GDN layer of a forward (the
    model builds it once: layers/gdn.py) instead of ~20 small launches per layer.

    chunk_offsets [B] first global chunk of each sequence; chunk_seq [N] the sequence of global chunk p, or
    -1 past the real count; chunk_t0 [N] its first token; N = T // BT + B >= the real number of chunks (each
    sequence adds at most one partial chunk); seq_of_token [T] each token's sequence (conv.py)."""
    chunk_offsets: torch.Tensor
    chunk_seq: torch.Tensor
    chunk_t0: torch.Tensor
    num_chunk_slots: int
    seq_of_token: torch.Tensor


def varlen_plan(cu_seqlens: torch.Tensor, T: int) -> VarlenPlan:
    """The plan of a batch of T tokens with cu_seqlens [B+1], without host syncs."""
    B = cu_seqlens.shape[0] - 1
    cu = cu_seqlens.to(torch.int64)
    n_chunks = (cu[1:] - cu[:-1] + BT - 1) // BT
    ends = torch.cumsum(n_chunks, 0)
    offsets = ends - n_chunks
    N = T // BT + B
    p = torch.arange(max(N, T), device=cu.device)
    seq = torch.searchsorted(ends, p[:N], right=True)
    valid = seq < B
    seq_c = seq.clamp(max=max(B - 1, 0))
    t0 = cu[seq_c] + (p[:N] - offsets[seq_c]) * BT
    chunk_seq = torch.where(valid, seq_c, -1).to(torch.int32)
    seq_of_token = torch.searchsorted(cu[1:], p[:T], right=True).to(torch.int32)
    return VarlenPlan(offsets.to(torch.int32), chunk_seq, t0.to(torch.int32), N, seq_of_token)


def check_plan(plan: VarlenPlan | None, cu_seqlens: torch.Tensor, T: int) -> VarlenPlan:
    """The caller's plan after a shape check (its values are the caller's promise), or a fresh one."""
    if plan is None:
        return varlen_plan(cu_seqlens, T)
    B = cu_seqlens.shape[0] - 1
    if (plan.chunk_offsets.shape != (B,) or plan.num_chunk_slots != T // BT + B or plan.seq_of_token.shape != (T,)
            or plan.chunk_seq.shape != (plan.num_chunk_slots,)):
        raise ValueError(f"varlen plan does not match this batch (B={B}, T={T}): build it with varlen_plan")
    return plan


def prefill_config(B: int, Hv: int, Dv: int, device, dot_bf16: bool, override: dict | None = None) -> dict:
    """Tile sizes / warps per kernel (register counts from ptxas for sm_90 at Qwen3.5 shapes: the
    intra-chunk kernel needs 8 warps with f32 operands to avoid spills). With bf16 operands the intra-chunk
    kernel runs on 2 warps: its 16-row substitutions and small-block products are reductions and layout
    shuffles that cost less within fewer warps (H200, 64 x 128 tokens: 179 us per layer vs 282 with 4 warps,
    540 with 8; benchmarks/results/prefill/round3), and the output pass takes the whole Dv = 128 in one tile
    (142 vs 158 us). The state pass is the sequential part: split Dv finer (32) when B x Hv x Dv/64
    programs would leave SMs idle, else 64 (fewer redundant W/K loads per program); 2 stages prefetch the
    next chunk's W/U/K (1, 3 stages, 8 warps and 128-wide tiles all measured slower). Computing the outputs
    inside the state pass (no H / V' scratch, one launch fewer) measured slower too: 566 vs 552 us at 64 x 128
    tokens, the output work then sitting in the sequential loop."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    cfg = dict(state_bv=32 if B * Hv * (Dv // 64) < 2 * sms else 64, output_bv=128 if dot_bf16 else 64,
               wy_warps=2 if dot_bf16 else 8, state_warps=4, state_stages=2, output_warps=4)
    unknown = set(override or {}) - set(cfg)
    if unknown:
        raise ValueError(f"unknown prefill config keys {sorted(unknown)} (known: {sorted(cfg)})")
    cfg.update(override or {})
    cfg["state_bv"], cfg["output_bv"] = min(cfg["state_bv"], Dv), min(cfg["output_bv"], Dv)
    if device.type == "cuda" and cfg["output_bv"] < min(64, Dv):
        # Compiled for sm_90 (H200, triton 3.6) output tiles of 32 at Dv=128 gave wrong results (rel. error
        # 2.2) while the interpreter is exact: likely the narrow chained tensor-core product; not diagnosed.
        raise ValueError(f"prefill output tiles narrower than 64 are not supported on CUDA (got {cfg['output_bv']})")
    return cfg


def resolve_precision(dtype: torch.dtype, precision: str | None) -> str:
    precision = precision or os.environ.get("LINRNN_GDN_PREFILL_PRECISION") or (
        "ieee" if dtype == torch.float32 else "bf16")
    if precision not in PRECISIONS:
        raise ValueError(f"prefill precision {precision!r} is not one of {PRECISIONS}")
    return precision


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16, head_local,
                state_indices, chunk_size: int = 64, precision: str | None = None, config: dict | None = None,
                plan: VarlenPlan | None = None):
    """Varlen chunked prefill: q, k [T, Hk, Dk] raw, v [T, Hv, Dv], a, b [T, Hv], cu_seqlens [B+1] int32.

    Starts from each sequence's pooled state (zeroed by the allocator for new requests), writes the final
    states back into each head's partition, returns o [T, Hv, Dv] in v.dtype. q/k/v/a/b may be strided
    views with a unit-stride last dim. `config` overrides prefill_config's tiles / warps (benchmarks);
    `plan`: the batch's varlen_plan when the caller already has it."""
    if chunk_size != BT:
        raise ValueError(f"the Triton prefill kernels use chunk_size {BT}, got {chunk_size}")
    T, Hk, Hv, Dk, Dv = check_qkv(q, k, v, a, b, A_log, dt_bias)
    check_pools(ssm_f32, ssm_bf16, head_is_bf16, head_local, Hv, Dk, Dv)
    B = cu_seqlens.shape[0] - 1
    if cu_seqlens.dim() != 1 or B < 0 or cu_seqlens.dtype != torch.int32:
        raise ValueError(f"cu_seqlens must be int32 [B+1], got {cu_seqlens.dtype} {tuple(cu_seqlens.shape)}")
    if state_indices.shape != (B,):
        raise ValueError(f"state_indices must be [B={B}], got {tuple(state_indices.shape)}")
    q, k, v, a, b = (rows_view(t) for t in (q, k, v, a, b))
    o = torch.empty(T, Hv, Dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    precision = resolve_precision(q.dtype, precision)
    dot_bf16 = precision == "bf16"
    prec = "interpret" if (INTERPRET and dot_bf16) else ("ieee" if dot_bf16 else precision)
    solve_prec = "ieee" if INTERPRET else ("tf32" if dot_bf16 else precision)
    scratch_dtype = torch.bfloat16 if dot_bf16 else torch.float32
    cfg = prefill_config(B, Hv, Dv, q.device, dot_bf16, config)
    offsets, chunk_seq, chunk_t0, N, _ = check_plan(plan, cu_seqlens, T)
    dev = q.device
    gc = torch.empty(T, Hv, dtype=torch.float32, device=dev)
    w = torch.empty(T, Hv, Dk, dtype=scratch_dtype, device=dev)
    u = torch.empty(T, Hv, Dv, dtype=scratch_dtype, device=dev)
    v_new = torch.empty(T, Hv, Dv, dtype=scratch_dtype, device=dev)
    h = torch.empty(N, Hv, Dk, Dv, dtype=scratch_dtype, device=dev)
    common = dict(HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, DOT_BF16=dot_bf16, PREC=prec)
    if T:
        _chunk_wy_kernel[(N, Hv)](
            k, v, a, b, A_log, dt_bias, cu_seqlens, chunk_seq, chunk_t0, gc, w, u,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1), a.stride(0), b.stride(0),
            SUB=BC, SOLVE_PREC=solve_prec, num_warps=cfg["wy_warps"], **common)
    _chunk_state_kernel[(B * Hv * (Dv // cfg["state_bv"]),)](
        k, w, u, gc, cu_seqlens, offsets, state_indices, ssm_f32, ssm_bf16, head_is_bf16, head_local, h, v_new,
        k.stride(0), k.stride(1), ssm_f32.stride(0), ssm_bf16.stride(0),
        BV=cfg["state_bv"], BT=BT, BF16_BLOCK=bf16_block(Dv), num_warps=cfg["state_warps"],
        num_stages=cfg["state_stages"], **common)
    if T:
        _chunk_output_kernel[(N, Hv * (Dv // cfg["output_bv"]))](
            q, k, gc, h, v_new, cu_seqlens, chunk_seq, chunk_t0, o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), Dk ** -0.5,
            BV=cfg["output_bv"], BT=BT, num_warps=cfg["output_warps"], **common)
    return o
