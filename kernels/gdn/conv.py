"""Causal depthwise conv1d + SiLU over the q/k/v channels with a pooled conv state (SPEC §1.5 step 2).

    y_t[c] = silu( sum_j w[c, j] * xx_{t-(K-1)+j}[c] ),   xx = cat(previous K-1 inputs, new inputs)

conv_state [slots, K-1, C] holds each sequence's last K-1 pre-conv inputs, oldest first, in the
activation dtype. Arithmetic in f32; w[:, K-1] multiplies the current token.

Decode: one program per (row, channel tile) reads the K-1 stored rows + the new input, writes y and
the shifted state in place (each row owns its slot; padded rows all hit the dummy slot 0).
Varlen: a fully parallel pass over (token tile, channel tile) reading earlier inputs from x or, for a
sequence's first K-1 tokens, from its stored state; then a per-sequence pass that writes the new
state. Two launches because a token tile may read a sequence's old state while another tile would
overwrite it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _conv1d_decode_kernel(
    x, weight, conv_state, state_indices, y,
    stride_x_tok, stride_state_slot, C,
    K: tl.constexpr, BC: tl.constexpr,
):
    i_b = tl.program_id(0).to(tl.int64)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    slot = tl.load(state_indices + i_b).to(tl.int64)
    p_state = conv_state + slot * stride_state_slot + o_c
    x_new = tl.load(x + i_b * stride_x_tok + o_c, mask=m_c, other=0.0)
    acc = tl.zeros([BC], dtype=tl.float32)
    for j in tl.static_range(K - 1):
        xj = tl.load(p_state + j * C, mask=m_c, other=0.0)
        w_j = tl.load(weight + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)
        acc += xj.to(x.dtype.element_ty).to(tl.float32) * w_j
        if j > 0:  # shift the window: row j moves to row j-1 (row j-1 was read one iteration earlier)
            tl.store(p_state + (j - 1) * C, xj, mask=m_c)
    acc += x_new.to(tl.float32) * tl.load(weight + o_c * K + (K - 1), mask=m_c, other=0.0).to(tl.float32)
    tl.store(p_state + (K - 2) * C, x_new.to(conv_state.dtype.element_ty), mask=m_c)
    tl.store(y + i_b * C + o_c, _silu(acc).to(y.dtype.element_ty), mask=m_c)


@triton.jit
def _conv1d_varlen_kernel(
    x, weight, conv_state, cu_seqlens, seq_of_token, state_indices, y,
    stride_x_tok, stride_state_slot, T, C,
    K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
):
    o_t = tl.program_id(0) * BT + tl.arange(0, BT)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_t = o_t < T
    m_c = o_c < C
    seq = tl.load(seq_of_token + o_t, mask=m_t, other=0)
    start = tl.load(cu_seqlens + seq, mask=m_t, other=0)
    slot = tl.load(state_indices + seq, mask=m_t, other=0).to(tl.int64)
    acc = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(K):
        src = o_t - (K - 1) + j  # input row feeding tap j; before `start` it comes from the stored state
        in_x = src >= start
        m = m_t[:, None] & m_c[None, :]
        xv = tl.load(x + src.to(tl.int64)[:, None] * stride_x_tok + o_c[None, :], mask=m & in_x[:, None], other=0.0)
        srow = (K - 1) + src - start
        sv = tl.load(conv_state + slot[:, None] * stride_state_slot + srow[:, None] * C + o_c[None, :],
                     mask=m & (~in_x)[:, None], other=0.0)
        xj = tl.where(in_x[:, None], xv.to(tl.float32), sv.to(x.dtype.element_ty).to(tl.float32))
        acc += xj * tl.load(weight + o_c * K + j, mask=m_c, other=0.0).to(tl.float32)[None, :]
    tl.store(y + o_t.to(tl.int64)[:, None] * C + o_c[None, :], _silu(acc).to(y.dtype.element_ty),
             mask=m_t[:, None] & m_c[None, :])


@triton.jit
def _conv_state_update_kernel(
    x, conv_state, cu_seqlens, state_indices,
    stride_x_tok, stride_state_slot, C,
    K: tl.constexpr, KP: tl.constexpr, BC: tl.constexpr,
):
    """New state = last K-1 rows of cat(old state, x_seq): row r comes from old row L + r if that is
    < K-1 (sequence shorter than K-1), else from x. All reads happen before the in-place writes."""
    i_n = tl.program_id(0)
    o_c = tl.program_id(1) * BC + tl.arange(0, BC)
    m_c = o_c < C
    bos = tl.load(cu_seqlens + i_n)
    L = tl.load(cu_seqlens + i_n + 1) - bos
    slot = tl.load(state_indices + i_n).to(tl.int64)
    o_r = tl.arange(0, KP)
    m_r = o_r < K - 1
    src = L + o_r
    from_old = src < K - 1
    m = m_r[:, None] & m_c[None, :]
    p_state = conv_state + slot * stride_state_slot + o_r[:, None] * C + o_c[None, :]
    old = tl.load(conv_state + slot * stride_state_slot + src[:, None] * C + o_c[None, :],
                  mask=m & from_old[:, None], other=0.0)
    xrow = (bos + src - (K - 1)).to(tl.int64)
    new = tl.load(x + xrow[:, None] * stride_x_tok + o_c[None, :], mask=m & (~from_old)[:, None], other=0.0)
    tl.store(p_state, tl.where(from_old[:, None], old, new.to(conv_state.dtype.element_ty)), mask=m)


def _check(x, weight, conv_state, n_seqs, state_indices):
    if x.dim() != 2:
        raise ValueError(f"x must be [tokens, C], got {tuple(x.shape)}")
    C = x.shape[1]
    if weight.dim() != 2 or weight.shape[0] != C or not weight.is_contiguous():
        raise ValueError(f"conv weight must be a contiguous [C={C}, K] tensor, got {tuple(weight.shape)}")
    K = weight.shape[1]
    if K < 2:
        raise ValueError(f"conv kernel size must be >= 2, got {K}")
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (K - 1, C) or not conv_state[0].is_contiguous():
        raise ValueError(f"conv_state must be [slots, K-1={K - 1}, C={C}] (contiguous per slot), "
                         f"got {tuple(conv_state.shape)}")
    if state_indices.shape != (n_seqs,):
        raise ValueError(f"state_indices must be [{n_seqs}], got {tuple(state_indices.shape)}")
    if x.stride(1) != 1:
        x = x.contiguous()
    return x, C, K


def conv1d_decode(x, weight, conv_state, state_indices):
    """x [B, C] (one new token per sequence, may be a row-strided view) -> y [B, C]; conv_state updated."""
    x, C, K = _check(x, weight, conv_state, x.shape[0], state_indices)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    BC = 256
    grid = (x.shape[0], triton.cdiv(C, BC))
    if x.shape[0]:
        _conv1d_decode_kernel[grid](x, weight, conv_state, state_indices, y, x.stride(0), conv_state.stride(0), C,
                                    K=K, BC=BC, num_warps=2)
    return y


CONV_VARLEN_CONFIG = dict(bt=32, bc=128, warps=4)  # tokens x channels per program of the varlen conv


def conv1d_varlen(x, weight, conv_state, cu_seqlens, state_indices, seq_of_token=None, config: dict | None = None):
    """Flattened varlen batch x [T, C] with cu_seqlens [B+1] -> y [T, C]; conv_state updated per sequence.

    No host syncs: the token -> sequence map (seq_of_token [T] int32, prefill.varlen_plan's, or computed here
    when not given) is computed on the device. `config` overrides CONV_VARLEN_CONFIG's keys (benchmarks)."""
    cfg = dict(CONV_VARLEN_CONFIG)
    if set(config or {}) - set(cfg):
        raise ValueError(f"unknown conv config keys {sorted(set(config) - set(cfg))} (known: {sorted(cfg)})")
    cfg.update(config or {})
    B = cu_seqlens.shape[0] - 1
    x, C, K = _check(x, weight, conv_state, B, state_indices)
    T = x.shape[0]
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if B == 0:
        return y
    BC = 128
    if T:
        if seq_of_token is None:
            seq_of_token = torch.searchsorted(cu_seqlens[1:], torch.arange(T, device=x.device, dtype=cu_seqlens.dtype),
                                              right=True).to(torch.int32)
        elif seq_of_token.shape != (T,) or seq_of_token.dtype != torch.int32:
            raise ValueError(f"seq_of_token must be int32 [{T}], got {seq_of_token.dtype} {tuple(seq_of_token.shape)}")
        BT, BCV = cfg["bt"], cfg["bc"]
        _conv1d_varlen_kernel[(triton.cdiv(T, BT), triton.cdiv(C, BCV))](
            x, weight, conv_state, cu_seqlens, seq_of_token, state_indices, y,
            x.stride(0), conv_state.stride(0), T, C, K=K, BT=BT, BC=BCV, num_warps=cfg["warps"])
    _conv_state_update_kernel[(B, triton.cdiv(C, BC))](
        x, conv_state, cu_seqlens, state_indices, x.stride(0), conv_state.stride(0), C,
        K=K, KP=triton.next_power_of_2(K - 1), BC=BC, num_warps=2)
    return y
