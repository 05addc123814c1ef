"""Pieces shared by the paged attention kernels (SPEC §1.7): the online-softmax inner loop over a
sequence's pages, launch configs, and shape checks.

Paged KV layout: cache [num_blocks, block_size, kv_heads, head_dim]; key position p of a sequence
lives in block block_table[p // block_size] at offset p % block_size.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one kernel launch.

    block_m: query rows per program (prefill: tokens x query heads of one kv head); unused by decode.
    block_n: keys per inner-loop step (gathered across pages, so any power of two works).
    """

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 0


# Defaults for bf16 head_dim 256 come from compiling for sm_90 with Triton 3.6 (no GPU needed:
# `python -m linrnn_bench.kernels.attention --resources`); registers / spills / smem per program
# are quoted beside each choice.

def default_prefill_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    if dtype.itemsize >= 4:  # f32 (tests): IEEE dot runs on FMA units, keep tiles and smem small
        return LaunchConfig(block_m=32, block_n=32, num_warps=4, num_stages=1)
    # head_dim 256: the 64 x 256 f32 accumulator alone is 128 registers per thread in one warpgroup
    # (64 x 64 keys on 4 warps spills). 128 rows (16 tokens x 8 GQA heads) x 64 keys on 8 warps, 2 stages:
    # each K/V tile serves twice the queries, so a short chunk over a long paged context reads its K/V half as
    # often (H200, 16 x 129-token continuations after 3072 cached tokens: 393 vs 492 us per layer for 64 x 32
    # on 4 warps, 3 stages; 64 x 128 fresh prompts: 153 vs 154 us; benchmarks/results/prefill/round3).
    if head_dim >= 256:
        return LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=2)
    return LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)


def default_decode_config(head_dim: int, dtype: torch.dtype = torch.bfloat16) -> LaunchConfig:
    if dtype.itemsize >= 4:
        return LaunchConfig(block_n=32, num_warps=4, num_stages=1)
    # Memory-bound: the query tile is only 16 (padded) heads, so spend smem on K/V in flight.
    # head_dim 256, 64 keys, 2 stages: 168 regs, no spills, 74 KB smem (3 programs per SM).
    if head_dim >= 256:
        return LaunchConfig(block_n=64, num_warps=4, num_stages=2)
    return LaunchConfig(block_n=64, num_warps=4, num_stages=3)


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_flags(q_dtype: torch.dtype, cache_dtype: torch.dtype) -> tuple[str, bool]:
    """(input_precision, upcast) for tl.dot on q/cache operands.

    f32 operands use exact IEEE products (TF32 would cost ~1e-3 relative error); the Triton 3.6
    interpreter computes bf16 tl.dot wrongly (garbage ~1e10), so under it bf16 operands are upcast.
    """
    dtypes = (q_dtype, cache_dtype)
    precision = "ieee" if torch.float32 in dtypes else "tf32"
    return precision, triton_interpret() and torch.bfloat16 in dtypes


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if device_index is None or not torch.cuda.is_available():
        return 8  # CPU (interpreter): few splits keep kernel tests fast; tests force split counts
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def next_pow2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache/v_cache must both be [num_blocks, block_size, kv_heads, head_dim]; "
                         f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype or not k_cache.dtype.is_floating_point:
        raise ValueError(f"k_cache/v_cache must share one float dtype; got {k_cache.dtype}, {v_cache.dtype}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache/v_cache must be contiguous along head_dim")
    bs, d = k_cache.shape[1], k_cache.shape[3]
    if not _is_pow2(bs):
        raise ValueError(f"block_size must be a power of two; got {bs}")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16; got {d}")


def check_paged_inputs(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables) -> None:
    """Shape/dtype/device checks only (no values: reading them would sync the host)."""
    check_cache(k_cache, v_cache)
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, q_heads, head_dim]; got {tuple(q.shape)}")
    hq, hkv, d = q.shape[1], k_cache.shape[2], k_cache.shape[3]
    if q.shape[2] != d:
        raise ValueError(f"q head_dim {q.shape[2]} != cache head_dim {d}")
    if hq % hkv:
        raise ValueError(f"q_heads {hq} is not a multiple of kv_heads {hkv}")
    if not q.dtype.is_floating_point:
        raise ValueError(f"q must be a float tensor; got {q.dtype}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [B]; got {tuple(seq_lens.shape)}")
    b = seq_lens.shape[0]
    if cu_seqlens is not None and cu_seqlens.shape != (b + 1,):
        raise ValueError(f"cu_seqlens must be [B+1] = [{b + 1}]; got {tuple(cu_seqlens.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != b:
        raise ValueError(f"block_tables must be [B={b}, max_blocks]; got {tuple(block_tables.shape)}")
    index_tensors = [("seq_lens", seq_lens), ("block_tables", block_tables)]
    if cu_seqlens is not None:  # decode does not read it
        index_tensors.append(("cu_seqlens", cu_seqlens))
    for name, t in index_tensors:
        if t.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"{name} must be int32 or int64; got {t.dtype}")
    for name, t in [("k_cache", k_cache)] + index_tensors:
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along max_blocks")


def check_gate(gate: torch.Tensor | None, q: torch.Tensor) -> None:
    """The output gate, if any: [T, Hq, D] like q, on q's device, unit stride along head_dim (any row / head
    strides: the gate half of the fused q projection is a strided view)."""
    if gate is None:
        return
    if gate.shape != q.shape or gate.device != q.device or gate.stride(-1) != 1:
        raise ValueError(f"gate must be {tuple(q.shape)} on {q.device} with unit stride along head_dim, got "
                         f"{tuple(gate.shape)} on {gate.device} (strides {gate.stride()})")


def output_like(q: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """A fresh [T, Hq, D] tensor in q.dtype, or the caller's `out` after checking it fits."""
    if out is None:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} on {q.device}, contiguous along head_dim; "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    return out


@triton.jit
def attend_tiles(acc, l_i, m_i, q, qpos, k_base, v_base, block_table,
                 stride_kb, stride_ks, stride_vb, stride_vs,
                 lo, hi, kv_end, qk_scale,
                 D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, MASK: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """Online-softmax update of (acc [M, D], l_i [M], m_i [M]) with key positions [lo, hi).

    q [M, D] holds query rows of one kv head; qpos [M] their positions. k_base/v_base point at the
    kv head's column of the caches; block_table at the sequence's row of block ids. Scores are
    kept in the log2 domain (qk_scale = softmax scale * log2 e), so exp2 replaces exp.
    MASK: 0 = every key of [lo, hi) is visible to every row (no masking code at all),
          1 = keys < kv_end are visible,  2 = keys < kv_end and key <= qpos (causal diagonal).
    Keys at or past kv_end are never loaded: pages past a sequence's end may hold anything.
    """
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    for start in range(lo, hi, BLOCK_N):
        kpos = start + offs_n
        if MASK == 0:
            block = tl.load(block_table + kpos // BS).to(tl.int64)
            k = tl.load(k_base + block[:, None] * stride_kb + (kpos % BS)[:, None] * stride_ks + offs_d[None, :])
        else:
            key_ok = kpos < kv_end
            block = tl.load(block_table + kpos // BS, mask=key_ok, other=0).to(tl.int64)
            k = tl.load(k_base + block[:, None] * stride_kb + (kpos % BS)[:, None] * stride_ks + offs_d[None, :],
                        mask=key_ok[:, None], other=0.0)
        if DOT_UPCAST:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision=DOT_PRECISION)
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION)
        s = s * qk_scale
        if MASK == 1:
            s = tl.where(key_ok[None, :], s, float("-inf"))
        if MASK == 2:
            s = tl.where(key_ok[None, :] & (kpos[None, :] <= qpos[:, None]), s, float("-inf"))
        # m_i starts finite (-1e30), so a row with no visible key in this tile gets p = 0, alpha = 1
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASK == 0:
            v = tl.load(v_base + block[:, None] * stride_vb + (kpos % BS)[:, None] * stride_vs + offs_d[None, :])
        else:
            v = tl.load(v_base + block[:, None] * stride_vb + (kpos % BS)[:, None] * stride_vs + offs_d[None, :],
                        mask=key_ok[:, None], other=0.0)
        if DOT_UPCAST:
            pv = tl.dot(p, v.to(tl.float32), input_precision=DOT_PRECISION)
        else:
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    return acc, l_i, m_i
