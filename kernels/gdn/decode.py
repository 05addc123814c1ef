"""Gated-DeltaNet decode: one token per sequence, the whole batch in one launch (SPEC §1.5 steps 4-7).

Per (sequence b, value head h, Dv tile): gates, L2-norm + scale of q/k (key head h // (Hv/Hk)),
then with the [Dk, BV] state tile in f32 registers
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
The state tile is read from the head's partition (f32 or bf16, runtime branch on head_is_bf16[h])
and written back in place in that dtype through state_indices; padded rows index the dummy slot 0.

Bandwidth design: the state is read and written exactly once (B x Hv x Dk x Dv x 4 B each way for
f32 heads dominates everything else), each row of a tile is BV contiguous elements (>= 64 B), and
the grid is B x Hv x Dv/BV programs: 128 at B=1 with BV=32 (256 with BV=16), one wave of small
programs that keeps every SM streaming.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.gdn.common import (
    check_pools, check_qkv, gates, head_state_offset, load_state, num_sms, rows_view, store_state,
)


@triton.jit
def _gdn_decode_kernel(
    q, k, v, a, b, A_log, dt_bias,
    ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_a_tok, stride_b_tok, stride_f32_slot, stride_bf16_slot,
    scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
):
    NV: tl.constexpr = DV // BV
    pid = tl.program_id(0)
    i_v = pid % NV
    i_bh = pid // NV
    i_b = (i_bh // HV).to(tl.int64)
    i_h = i_bh % HV
    i_hk = i_h // GROUP  # consecutive value heads share a key head (SPEC §1.5.6)

    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)

    # the state tile first: its address needs two dependent tiny loads, and it is the bulk of the bytes
    slot = tl.load(state_indices + i_b)
    is_bf16, base = head_state_offset(head_is_bf16, head_local, i_h, slot, stride_f32_slot, stride_bf16_slot,
                                      DK, DV)
    offs = o_k[:, None] * DV + o_v[None, :]
    s = load_state(ssm_f32, ssm_bf16, is_bf16, base, offs)

    b_q = tl.load(q + i_b * stride_q_tok + i_hk * stride_q_head + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_tok + i_hk * stride_k_head + o_k).to(tl.float32)
    b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 0) + 1e-6) * scale  # SPEC §1.4 #3, §1.5.5
    b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 0) + 1e-6)
    b_v = tl.load(v + i_b * stride_v_tok + i_h * stride_v_head + o_v).to(tl.float32)
    g, beta = gates(tl.load(a + i_b * stride_a_tok + i_h), tl.load(b + i_b * stride_b_tok + i_h),
                    tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))

    # SPEC §1.5.7: S <- exp(g) S; u = beta (v - S^T k); S <- S + k u^T; o = S^T q
    s = s * tl.exp(g)
    u = beta * (b_v - tl.sum(s * b_k[:, None], 0))
    s = s + b_k[:, None] * u[None, :]
    b_o = tl.sum(s * b_q[:, None], 0)

    tl.store(o + (i_b * HV + i_h) * DV + o_v, b_o.to(o.dtype.element_ty))
    store_state(ssm_f32, ssm_bf16, is_bf16, base, offs, s)


def decode_config(B: int, Hv: int, Dk: int, Dv: int, device) -> tuple[int, int]:
    """(BV, num_warps). Wide tiles (BV=32: 128 B rows of f32) once there are enough programs to fill
    every SM a few times over; narrow ones (BV=16) at small batch so that more SMs stream."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    bv = 32 if B * Hv * (Dv // 32) >= 4 * sms else 16
    bv = min(bv, Dv)
    return bv, 4 if Dk * bv >= 4096 else 2


def gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices,
               config: tuple[int, int] | None = None):
    """One token per sequence: q, k [B, Hk, Dk] (raw, post-conv), v [B, Hv, Dv], a, b [B, Hv].

    Updates the pools in place at state_indices [B] and returns o [B, Hv, Dv] in v.dtype. q/k/v/a/b
    may be strided views (e.g. splits of the conv output); only their last dim must be unit-stride
    (otherwise they are copied). `config` = (BV, num_warps) overrides the tile choice (benchmarks).
    """
    B, Hk, Hv, Dk, Dv = check_qkv(q, k, v, a, b, A_log, dt_bias)
    check_pools(ssm_f32, ssm_bf16, head_is_bf16, head_local, Hv, Dk, Dv)
    if state_indices.shape != (B,):
        raise ValueError(f"state_indices must be [B={B}], got {tuple(state_indices.shape)}")
    q, k, v, a, b = (rows_view(t) for t in (q, k, v, a, b))
    o = torch.empty(B, Hv, Dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    bv, warps = config or decode_config(B, Hv, Dk, Dv, q.device)
    grid = (B * Hv * (Dv // bv),)
    _gdn_decode_kernel[grid](
        q, k, v, a, b, A_log, dt_bias,
        ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), ssm_f32.stride(0), ssm_bf16.stride(0),
        Dk ** -0.5,
        HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BV=bv, num_warps=warps,
    )
    return o
