"""Varlen causal attention over paged KV (prefill and chunked prefill), flash-attention style.

One program = one tile of BLOCK_Q consecutive new tokens of one sequence x the G query heads that
share one kv head (GQA packing: rows are (token, head) pairs, so each K/V tile is loaded once for
all G heads and a short query, even a single token, still fills the tile). The program walks the
sequence's pages from position 0 to its last query: first the key tiles every row sees in full
(no masking code), then the causal diagonal. Context from earlier steps (chunked prefill) is just
the leading part of that walk.

Grid: (T // BLOCK_Q + B, kv_heads). Sequence i's tiles start at program cu_seqlens[i] // BLOCK_Q + i,
an upper-bound layout that needs no prefix sum over tile counts; programs past a sequence's last
tile exit at once. The grid depends only on shapes, so launching needs no host sync.

`gate` (optional, [T, Hq, D], e.g. the strided gate half of the layer's fused q projection): the output is
o * sigmoid(gate), applied to the f32 result before its one rounding (the attention layer's output gate,
SPEC §1.7; without it the layer spent a strided copy, a sigmoid and a multiply per prefill).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.attention.common import (
    LOG2E, LaunchConfig, attend_tiles, check_gate, check_paged_inputs, default_prefill_config, dot_flags, next_pow2, output_like,
)


@triton.jit
def _find_seq(cu_seqlens, tile, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest i with cu_seqlens[i] // BLOCK_Q + i <= tile (binary search; that value is nondecreasing in i)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_seqlens + mid) // BLOCK_Q + mid <= tile:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(q_ptr, k_cache, v_cache, o_ptr, gate_ptr, cu_seqlens, seq_lens, block_tables, qk_scale, num_seqs,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_gt, stride_gh,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr, HAS_GATE: tl.constexpr):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(cu_seqlens, tile, num_seqs, BLOCK_Q)
    q_begin = tl.load(cu_seqlens + seq)
    q_len = tl.load(cu_seqlens + seq + 1) - q_begin
    n_tiles = tl.cdiv(q_len, BLOCK_Q)
    local = tile - (q_begin // BLOCK_Q + seq)
    if local >= n_tiles:
        return
    # Later tiles see more keys: hand them to the lowest program ids so they start first.
    local = n_tiles - 1 - local
    seq_len = tl.load(seq_lens + seq)
    first_qpos = seq_len - q_len + local * BLOCK_Q
    kv_end = tl.minimum(first_qpos + BLOCK_Q, seq_len)  # keys this tile may see: [0, kv_end)

    BLOCK_M: tl.constexpr = BLOCK_Q * G_PAD
    rows = tl.arange(0, BLOCK_M)
    tok = local * BLOCK_Q + rows // G_PAD
    head = kv_head * G + rows % G_PAD
    row_ok = (tok < q_len) & (rows % G_PAD < G)
    qpos = seq_len - q_len + tok
    offs_d = tl.arange(0, D)
    token = (q_begin + tok).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    block_table = block_tables + seq.to(tl.int64) * stride_bt
    k_base = k_cache + kv_head * stride_kh
    v_base = v_cache + kv_head * stride_vh
    full_end = (first_qpos + 1) // BLOCK_N * BLOCK_N  # key tiles at or before every row's position
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, block_table,
                                 stride_kb, stride_ks, stride_vb, stride_vs, 0, full_end, kv_end, qk_scale,
                                 D, BS, BLOCK_N, 0, DOT_PRECISION, DOT_UPCAST)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, block_table,
                                 stride_kb, stride_ks, stride_vb, stride_vs, full_end, kv_end, kv_end, qk_scale,
                                 D, BS, BLOCK_N, 2, DOT_PRECISION, DOT_UPCAST)
    o = acc / l_i[:, None]
    if HAS_GATE:
        gate = tl.load(gate_ptr + token[:, None] * stride_gt + head[:, None] * stride_gh + offs_d[None, :],
                       mask=row_ok[:, None], other=0.0).to(tl.float32)
        o = o / (1.0 + tl.exp(-gate))
    tl.store(o_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def prefill_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale,
                      config: LaunchConfig | None = None, out: torch.Tensor | None = None,
                      gate: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries (q [T, Hq, D]) over its paged context.

    Sequence i's queries are tokens cu_seqlens[i]:cu_seqlens[i+1] at positions
    seq_lens[i] - q_len_i .. seq_lens[i] - 1; their K/V must already be in the pages (write_kv).
    Returns o [T, Hq, D] in q.dtype (times sigmoid(gate) when a gate is given).
    """
    check_paged_inputs(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables)
    check_gate(gate, q)
    if q.stride(-1) != 1:
        q = q.contiguous()
    T, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    b = seq_lens.shape[0]
    cfg = config or default_prefill_config(d, max(q.dtype, k_cache.dtype, key=lambda t: t.itemsize))
    g = hq // hkv
    g_pad = next_pow2(g)
    block_q = max(1, cfg.block_m // g_pad)
    o = output_like(q, out)
    if T == 0 or b == 0:
        return o
    precision, upcast = dot_flags(q.dtype, k_cache.dtype)
    grid = (T // block_q + b, hkv)
    _prefill_kernel[grid](
        q, k_cache, v_cache, o, o if gate is None else gate, cu_seqlens, seq_lens, block_tables, scale * LOG2E, b,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        *((0, 0) if gate is None else (gate.stride(0), gate.stride(1))),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        G=g, G_PAD=g_pad, D=d, BS=bs, BLOCK_Q=block_q, BLOCK_N=cfg.block_n,
        DOT_PRECISION=precision, DOT_UPCAST=upcast, HAS_GATE=gate is not None, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o
