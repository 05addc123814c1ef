"""Scatter new keys/values into their pages (slot = block * block_size + offset).

A Triton kernel rather than two torch index_put_ calls: one launch writes both K and V, converts
to the cache dtype in registers, and reads k/v through their strides (v is usually a strided slice
of the fused qkv projection), so no contiguous copies. No host sync: CUDA-graph capturable.
Negative slots are skipped.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.attention.common import check_cache, next_pow2


@triton.jit
def _write_kv_kernel(k, v, k_cache, v_cache, slot_mapping,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + t).to(tl.int64)
    if slot < 0:
        return
    block = slot // BS
    offset = slot % BS
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D)
    mask = (h < H)[:, None]
    kt = tl.load(k + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(k_cache + block * stride_kcb + offset * stride_kcs + h[:, None] * stride_kch + d[None, :],
             kt.to(k_cache.dtype.element_ty), mask=mask)
    vt = tl.load(v + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vcs + h[:, None] * stride_vch + d[None, :],
             vt.to(v_cache.dtype.element_ty), mask=mask)


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k, v [T, Hkv, D] -> k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    check_cache(k_cache, v_cache)
    _, bs, hkv, d = k_cache.shape
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (hkv, d):
        raise ValueError(f"k and v must both be [T, {hkv}, {d}] to match the cache; "
                         f"got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"slot_mapping must be int32/int64 [T={k.shape[0]}]; got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    for name, t in (("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("slot_mapping", slot_mapping)):
        if t.device != k.device:
            raise ValueError(f"{name} is on {t.device} but k is on {k.device}")
    if k.shape[0] == 0:
        return
    k = k if k.stride(-1) == 1 else k.contiguous()
    v = v if v.stride(-1) == 1 else v.contiguous()
    _write_kv_kernel[(k.shape[0],)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0), v_cache.stride(1),
        v_cache.stride(2), H=hkv, H_PAD=next_pow2(hkv), D=d, BS=bs, num_warps=2,
    )
