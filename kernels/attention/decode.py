"""Paged decode attention (one new token per sequence), split-K flash-decoding, CUDA-graph safe.

Grid (B, kv_heads, NUM_SPLITS). One program loads the G query heads that share a kv head as one
[G_PAD >= 16, D] tile, so each K/V page is read once per kv head for all G heads. The context is
cut into NUM_SPLITS contiguous runs of whole BLOCK_N key tiles, sized from the sequence's own
length in the kernel (so every split gets an even share at any length), and each split writes its
normalized partial output and log-sum-exp. A second kernel merges the splits in a fixed order
(deterministic: no atomics, results independent of scheduling).

NUM_SPLITS depends only on shapes (B, kv_heads, block_tables' width) and the GPU's SM count, so a
captured CUDA graph replays the same launches correctly whatever seq_lens hold at replay.
With NUM_SPLITS == 1 the first kernel writes o directly and the merge is skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.attention.common import (
    LOG2E, LaunchConfig, attend_tiles, check_paged_inputs, default_decode_config, dot_flags, next_pow2, num_sms,
    output_like,
)

# Aim for this many programs per SM (flash-decoding needs a full wave even at batch 1) ...
PROGRAMS_PER_SM = 2
# ... but never more splits than this: each split costs a [Hq, D] f32 partial written and re-read.
MAX_SPLITS = 128


def decode_num_splits(batch: int, kv_heads: int, max_blocks: int, block_size: int, block_n: int,
                      sms: int) -> int:
    """Power-of-two split count from shapes only; at most one split per key tile of the longest
    context the block table can hold."""
    max_tiles = triton.cdiv(max_blocks * block_size, block_n)
    want = triton.cdiv(PROGRAMS_PER_SM * sms, max(1, batch * kv_heads))
    return max(1, min(next_pow2(want), MAX_SPLITS, next_pow2(max_tiles)))


@triton.jit
def _split_range(seq_len, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    """Key tiles per split (>= 1) for this length; the merge kernel recomputes the same numbers."""
    tiles = tl.cdiv(seq_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tiles, NUM_SPLITS), 1)
    return per_split, tiles


@triton.jit
def _decode_kernel(q_ptr, k_cache, v_cache, o_ptr, part_o, part_lse, seq_lens, block_tables, qk_scale,
                   stride_qt, stride_qh, stride_ot, stride_oh,
                   stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_bt,
                   HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    per_split, _ = _split_range(seq_len, BLOCK_N, NUM_SPLITS)
    lo = split * per_split * BLOCK_N
    hi = tl.minimum(lo + per_split * BLOCK_N, seq_len)
    if lo >= hi:  # split past the end of this sequence: the merge skips it
        return

    rows = tl.arange(0, G_PAD)
    head = kv_head * G + rows
    row_ok = rows < G
    offs_d = tl.arange(0, D)
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                mask=row_ok[:, None], other=0.0)
    acc = tl.zeros([G_PAD, D], dtype=tl.float32)
    l_i = tl.zeros([G_PAD], dtype=tl.float32)
    m_i = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    acc, l_i, m_i = attend_tiles(acc, l_i, m_i, q, rows, k_cache + kv_head * stride_kh, v_cache + kv_head * stride_vh,
                                 block_tables + seq.to(tl.int64) * stride_bt,
                                 stride_kb, stride_ks, stride_vb, stride_vs, lo, hi, hi, qk_scale,
                                 D, BS, BLOCK_N, 1, DOT_PRECISION, DOT_UPCAST)
    o = acc / l_i[:, None]
    if NUM_SPLITS == 1:
        tl.store(o_ptr + seq.to(tl.int64) * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                 o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:
        part = (seq.to(tl.int64) * HQ + head) * NUM_SPLITS + split  # part_o [B, Hq, NUM_SPLITS, D]
        tl.store(part_o + part[:, None] * D + offs_d[None, :], o, mask=row_ok[:, None])
        tl.store(part_lse + part, m_i + tl.log2(l_i), mask=row_ok)


@triton.jit
def _merge_kernel(part_o, part_lse, o_ptr, seq_lens, stride_ot, stride_oh,
                  HQ: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    d_block = tl.program_id(2)
    seq_len = tl.load(seq_lens + seq)
    per_split, tiles = _split_range(seq_len, BLOCK_N, NUM_SPLITS)
    splits = tl.arange(0, NUM_SPLITS)
    used = splits < tl.cdiv(tiles, per_split)
    part = (seq.to(tl.int64) * HQ + head) * NUM_SPLITS + splits
    lse = tl.load(part_lse + part, mask=used, other=float("-inf"))
    weight = tl.exp2(lse - tl.max(lse, 0))  # unused splits: exp2(-inf) = 0
    offs_d = d_block * BLOCK_D + tl.arange(0, BLOCK_D)
    po = tl.load(part_o + part[:, None] * D + offs_d[None, :], mask=used[:, None], other=0.0)
    o = tl.sum(weight[:, None] * po, 0) / tl.sum(weight, 0)
    tl.store(o_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, o.to(o_ptr.dtype.element_ty))


def decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, config: LaunchConfig | None = None,
                     num_splits: int | None = None, cu_seqlens: torch.Tensor | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query per sequence (q [B, Hq, D], row i = sequence i, at position
    seq_lens[i] - 1) over its first seq_lens[i] (>= 1) paged keys. Returns o [B, Hq, D] in q.dtype.

    num_splits overrides the split heuristic (a power of two); cu_seqlens is only shape-checked.
    """
    b = seq_lens.shape[0]
    check_paged_inputs(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables)
    if q.shape[0] != b:
        raise ValueError(f"decode takes one query per sequence: q has {q.shape[0]} rows for {b} sequences")
    if q.stride(-1) != 1:
        q = q.contiguous()
    _, hq, d = q.shape
    hkv, bs = k_cache.shape[2], k_cache.shape[1]
    cfg = config or default_decode_config(d, max(q.dtype, k_cache.dtype, key=lambda t: t.itemsize))
    if num_splits is None:
        dev = q.device.index if q.is_cuda else None
        num_splits = decode_num_splits(b, hkv, block_tables.shape[1], bs, cfg.block_n, num_sms(dev))
    elif num_splits < 1 or num_splits & (num_splits - 1):
        raise ValueError(f"num_splits must be a power of two >= 1; got {num_splits}")
    g = hq // hkv
    o = output_like(q, out)
    if b == 0:
        return o
    if num_splits > 1:
        part_o = torch.empty((b, hq, num_splits, d), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((b, hq, num_splits), dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = o  # unused
    precision, upcast = dot_flags(q.dtype, k_cache.dtype)
    _decode_kernel[(b, hkv, num_splits)](
        q, k_cache, v_cache, o, part_o, part_lse, seq_lens, block_tables, scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        HQ=hq, G=g, G_PAD=max(16, next_pow2(g)), D=d, BS=bs, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits,
        DOT_PRECISION=precision, DOT_UPCAST=upcast, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if num_splits > 1:
        block_d = min(d, 64)
        _merge_kernel[(b, hq, d // block_d)](
            part_o, part_lse, o, seq_lens, o.stride(0), o.stride(1),
            HQ=hq, D=d, BLOCK_D=block_d, BLOCK_N=cfg.block_n, NUM_SPLITS=num_splits, num_warps=4,
        )
    return o
