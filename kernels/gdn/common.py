"""Pieces shared by the Gated-DeltaNet Triton kernels: gates (SPEC §1.5 step 4), hybrid-pool state
access (per-head partition, runtime dtype branch, each partition's layout: layout.py), launcher-side input checks."""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from linrnn_kernels.gdn.layout import bf16_pool_shape

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def softplus(x):
    """log(1 + exp(x)), returning x above 20 (torch / vLLM threshold). log1p is written out
    (Goldberg's trick) because log(1 + u) loses u when u = exp(x) is tiny."""
    u = tl.exp(tl.minimum(x, 20.0))
    w = 1.0 + u
    small = tl.where(w == 1.0, u, tl.log(w) * (u / (w - 1.0)))
    return tl.where(x > 20.0, x, small)


@triton.jit
def gates(a, b, A_log, dt_bias):
    """g = -exp(A_log) * softplus(a + dt_bias) (log-decay), beta = sigmoid(b); all f32 (SPEC §1.5.4)."""
    g = -tl.exp(A_log) * softplus(a.to(tl.float32) + dt_bias)
    beta = 1.0 / (1.0 + tl.exp(-b.to(tl.float32)))
    return g, beta


@triton.jit
def head_state_offset(head_is_bf16, head_local, i_h, slot, stride_f32_slot, stride_bf16_slot,
                      DK: tl.constexpr, DV: tl.constexpr):
    """Where natural head i_h of `slot` lives: (is_bf16, element offset into its partition pool)."""
    is_bf16 = tl.load(head_is_bf16 + i_h)
    loc = tl.load(head_local + i_h).to(tl.int64)
    slot = slot.to(tl.int64)
    if is_bf16 != 0:
        base = slot * stride_bf16_slot + loc * (DK * DV)
    else:
        base = slot * stride_f32_slot + loc * (DK * DV)
    return is_bf16, base


@triton.jit
def state_tile_base(i_v, BV: tl.constexpr, DK: tl.constexpr, BLOCK: tl.constexpr):
    """Element offset of the [DK, BV] tile i_v (columns i_v * BV ..) within one head's state stored
    [DV / BLOCK, DK, BLOCK] (the bf16 partition, layout.py); add state_tile_offsets(.., BLOCK) to it."""
    if BV <= BLOCK:
        # a [DK, BV] piece of block i_v // (BLOCK // BV): rows BLOCK apart, one contiguous run if BV == BLOCK
        NSUB: tl.constexpr = BLOCK // BV
        tile = (i_v // NSUB).to(tl.int64) * (DK * BLOCK) + (i_v % NSUB) * BV
    else:
        # BV // BLOCK adjacent whole blocks: one contiguous DK * BV run
        tile = i_v.to(tl.int64) * (DK * BV)
    return tile


@triton.jit
def state_tile_offsets(i_v, BV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr):
    """[DK, BV] element offsets of tile i_v of one head's state: BLOCK = 0, the head is [DK, DV] (the f32
    partition; the whole offset, the expression the kernels used before the blocked layout, so they compile
    as before); else relative to state_tile_base (the bf16 partition, [DV / BLOCK, DK, BLOCK])."""
    o_k = tl.arange(0, DK)
    j = tl.arange(0, BV)
    if BLOCK == 0:
        offs = o_k[:, None] * DV + (i_v * BV + j)[None, :]
    elif BV <= BLOCK:
        offs = o_k[:, None] * BLOCK + j[None, :]
    else:
        offs = (j // BLOCK)[None, :] * (DK * BLOCK) + o_k[:, None] * BLOCK + (j % BLOCK)[None, :]
    return offs


@triton.jit
def load_state(ssm_f32, ssm_bf16, is_bf16, base, i_v, BV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
               BF16_BLOCK: tl.constexpr, EVICT: tl.constexpr, CACHE: tl.constexpr):
    """Tile i_v ([DK, BV]) of one head's state from its partition, in f32 (either dtype in, f32 registers out).
    EVICT / CACHE: L2 eviction policy and PTX cache operator ("" = defaults)."""
    if is_bf16 != 0:
        ptr = ssm_bf16 + (base + state_tile_base(i_v, BV, DK, BF16_BLOCK)) + state_tile_offsets(i_v, BV, DK, DV,
                                                                                                  BF16_BLOCK)
        s = tl.load(ptr, eviction_policy=EVICT, cache_modifier=CACHE).to(tl.float32)
    else:
        offs = state_tile_offsets(i_v, BV, DK, DV, 0)
        s = tl.load(ssm_f32 + base + offs, eviction_policy=EVICT, cache_modifier=CACHE)
    return s


@triton.jit
def store_state(ssm_f32, ssm_bf16, is_bf16, base, i_v, s, BV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                BF16_BLOCK: tl.constexpr, EVICT: tl.constexpr, CACHE: tl.constexpr):
    """Store an f32 state tile back in its partition's dtype and layout (round-to-nearest-even for bf16)."""
    if is_bf16 != 0:
        ptr = ssm_bf16 + (base + state_tile_base(i_v, BV, DK, BF16_BLOCK)) + state_tile_offsets(i_v, BV, DK, DV,
                                                                                                  BF16_BLOCK)
        tl.store(ptr, s.to(tl.bfloat16), eviction_policy=EVICT, cache_modifier=CACHE)
    else:
        offs = state_tile_offsets(i_v, BV, DK, DV, 0)
        tl.store(ssm_f32 + base + offs, s, eviction_policy=EVICT, cache_modifier=CACHE)


# ---- launcher-side checks (host metadata only: no device syncs, CUDA-graph safe) -------------------


def check_pools(ssm_f32, ssm_bf16, head_is_bf16, head_local, Hv: int, Dk: int, Dv: int):
    if ssm_f32.dtype != torch.float32 or ssm_bf16.dtype != torch.bfloat16:
        raise TypeError(f"state pools must be float32 / bfloat16, got {ssm_f32.dtype} / {ssm_bf16.dtype}")
    bf16_head = bf16_pool_shape(0, 0, Dk, Dv)[2:]
    for name, p, per_head in (("ssm_f32", ssm_f32, (Dk, Dv)), ("ssm_bf16", ssm_bf16, bf16_head)):
        if p.dim() != 2 + len(per_head) or tuple(p.shape[2:]) != per_head:
            raise ValueError(f"{name} must be [slots, heads, {', '.join(map(str, per_head))}] per head "
                             f"(kernels/gdn/layout.py), got {tuple(p.shape)}")
        if p.shape[1] and not p[0].is_contiguous():
            raise ValueError(f"{name} must be contiguous within a slot (strides {p.stride()})")
    if ssm_f32.shape[1] + ssm_bf16.shape[1] != Hv:
        raise ValueError(f"partitions hold {ssm_f32.shape[1]} f32 + {ssm_bf16.shape[1]} bf16 heads, "
                         f"but the layer has {Hv} value heads")
    if ssm_f32.shape[1] and ssm_bf16.shape[1] and ssm_f32.shape[0] != ssm_bf16.shape[0]:
        raise ValueError(f"partitions have different slot counts: {ssm_f32.shape[0]} vs {ssm_bf16.shape[0]}")
    for name, t in (("head_is_bf16", head_is_bf16), ("head_local", head_local)):
        if t.shape != (Hv,) or t.dtype != torch.int32:
            raise ValueError(f"{name} must be int32 [{Hv}], got {t.dtype} {tuple(t.shape)}")


def check_qkv(q, k, v, a, b, A_log, dt_bias):
    """Shapes of q, k [T, Hk, Dk], v [T, Hv, Dv], a, b [T, Hv]; returns (T, Hk, Hv, Dk, Dv)."""
    if q.dim() != 3 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [T, Hk, Dk], got {tuple(q.shape)} and {tuple(k.shape)}")
    T, Hk, Dk = q.shape
    if v.dim() != 3 or v.shape[0] != T:
        raise ValueError(f"v must be [T={T}, Hv, Dv], got {tuple(v.shape)}")
    Hv, Dv = v.shape[1], v.shape[2]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, t in (("a", a), ("b", b)):
        if t.shape != (T, Hv):
            raise ValueError(f"{name} must be [T={T}, Hv={Hv}], got {tuple(t.shape)}")
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        if t.shape != (Hv,):
            raise ValueError(f"{name} must be [Hv={Hv}], got {tuple(t.shape)}")
    for name, d in (("Dk", Dk), ("Dv", Dv)):
        if d < 16 or d & (d - 1) or d > 256:
            raise ValueError(f"head dim {name}={d} must be a power of two in [16, 256]")
    return T, Hk, Hv, Dk, Dv


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """A [T, H, D] (or [T, H]) view whose last dim is unit-stride; split views of a fused projection
    already are, so this copies only unusual layouts."""
    return x if x.stride(-1) == 1 else x.contiguous()


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    if INTERPRET or not torch.cuda.is_available():
        return 132
    return torch.cuda.get_device_properties(device_index).multi_processor_count
