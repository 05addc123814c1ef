"""Triton kernels for the fused row-wise ops of kernels/norm/naive.py.

Each op is one launch over rows; they exist to keep the decode step's kernel count low (every
separate elementwise torch op is a graph node of a few microseconds).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


@triton.jit
def _add_rmsnorm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, h_ptr, a_ptr, g_ptr, N, eps, sx, sr, sy, sh, sa, sg,
                        HAS_RES: tl.constexpr, HAS_GATE: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_GATE:  # x = addend + sigmoid(g) * x, each op rounded to the activation dtype as the torch chain
        act = x_ptr.dtype.element_ty
        g = tl.load(g_ptr + row * sg).to(tl.float32)
        s = (1.0 / (1.0 + tl.exp(-g))).to(act).to(tl.float32)
        a = tl.load(a_ptr + row * sa + cols, mask=mask, other=0.0).to(tl.float32)
        x = (a + (s * x).to(act).to(tl.float32)).to(act).to(tl.float32)
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0).to(tl.float32)
        # round the residual stream to the activation dtype before normalising (as transformers)
        h = (x + r).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + row * sh + cols, h, mask=mask)
        x = h.to(tl.float32)
    elif HAS_GATE:
        tl.store(h_ptr + row * sh + cols, x.to(h_ptr.dtype.element_ty), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * sy + cols, (x * rstd * (1.0 + w)).to(y_ptr.dtype.element_ty), mask=mask)


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                addend: torch.Tensor | None = None, gate_logit: torch.Tensor | None = None):
    """With addend and gate_logit ([rows, 1], may be strided): x is first replaced by addend + sigmoid(g) * x
    (the shared expert joining the routed experts' sum) in the same pass."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    y = torch.empty_like(x2)
    gated = addend is not None
    h = x2 if residual is None and not gated else torch.empty_like(x2)
    r2 = x2 if residual is None else residual.reshape(-1, N)
    a2 = addend.reshape(-1, N) if gated else x2
    g2 = gate_logit.reshape(-1, 1) if gated else x2
    BLOCK = triton.next_power_of_2(N)
    if x2.shape[0]:
        _add_rmsnorm_kernel[(x2.shape[0],)](
            x2, r2, weight, y, h, a2, g2, N, eps, x2.stride(0), r2.stride(0), y.stride(0), h.stride(0),
            a2.stride(0), g2.stride(0), HAS_RES=residual is not None, HAS_GATE=gated, BLOCK=BLOCK,
            num_warps=_warps(BLOCK))
    return y.view(x.shape), h.view(x.shape)


@triton.jit
def _gated_rmsnorm_kernel(x_ptr, z_ptr, w_ptr, y_ptr, R, H, D, eps, sx_t, sx_h, sz_t, sz_h,
                          ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """ROWS (token, head) rows of D per program (one row of 128 per 1-warp program left the H200 at 1/3 of
    its bandwidth at prefill sizes)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    t = rows // H
    hh = rows % H
    cols = tl.arange(0, BLOCK)
    mask = (rows < R)[:, None] & (cols < D)[None, :]
    x = tl.load(x_ptr + (t * sx_t + hh * sx_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + (t * sz_t + hh * sz_h)[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    # transformers rounds the normalised x, and w * x, to the activation dtype (arithmetic in f32 here)
    act = y_ptr.dtype.element_ty
    n = (x / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)[:, None]).to(act).to(tl.float32)
    y = (w[None, :] * n).to(act).to(tl.float32) * (z / (1.0 + tl.exp(-z)))
    tl.store(y_ptr + rows[:, None] * D + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=mask)


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x, z [T, H, D] (z may be a strided view of the input projection) -> [T, H, D] contiguous."""
    T, H, D = x.shape
    assert x.stride(2) == 1 and z.stride(2) == 1, "last dim must be contiguous"
    y = torch.empty(T, H, D, dtype=x.dtype, device=x.device)
    BLOCK = triton.next_power_of_2(D)
    R = T * H
    ROWS = max(1, min(16, 2048 // BLOCK, triton.next_power_of_2(R)))  # ~2048 elements per program
    if T:
        _gated_rmsnorm_kernel[(triton.cdiv(R, ROWS),)](x, z, weight, y, R, H, D, eps, x.stride(0), x.stride(1),
                                                       z.stride(0), z.stride(1), ROWS=ROWS, BLOCK=BLOCK,
                                                       num_warps=_warps(ROWS * BLOCK))
    return y


@triton.jit
def _silu_mul_kernel(h_ptr, y_ptr, I, sh, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(h_ptr + row * sh + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(h_ptr + row * sh + I + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * I + cols, (g / (1.0 + tl.exp(-g)) * u).to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    I = h.shape[-1] // 2
    h2 = h.reshape(-1, 2 * I)
    y = torch.empty(h2.shape[0], I, dtype=h.dtype, device=h.device)
    BLOCK = min(1024, triton.next_power_of_2(I))
    if h2.shape[0]:
        _silu_mul_kernel[(h2.shape[0], triton.cdiv(I, BLOCK))](h2, y, I, h2.stride(0), BLOCK=BLOCK,
                                                               num_warps=_warps(BLOCK))
    return y.view(*h.shape[:-1], I)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, qw_ptr, kw_ptr, pos_ptr, inv_ptr, qo_ptr, ko_ptr,
                         HQ, HK, D, eps, sq_t, sq_h, sk_t, sk_h,
                         v_ptr, sv_t, sv_h, kc_ptr, vc_ptr, slot_ptr, s_cb, s_cs, s_ch,
                         HALF: tl.constexpr, BLOCK: tl.constexpr, WRITE_KV: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    hh = tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    is_v = False
    if WRITE_KV:  # k goes to its cache page, not to ko; programs past the k heads copy v to its page
        slot = tl.load(slot_ptr + t).to(tl.int64)
        page = (slot // BS) * s_cb + (slot % BS) * s_cs
        is_v = hh >= HQ + HK
        if is_v:
            if slot >= 0:
                hv = hh - HQ - HK
                xv = tl.load(v_ptr + t * sv_t + hv * sv_h + cols, mask=mask, other=0.0)
                tl.store(vc_ptr + page + hv * s_ch + cols, xv.to(vc_ptr.dtype.element_ty), mask=mask)
    is_q = hh < HQ
    if is_q:
        src = q_ptr + t * sq_t + hh * sq_h
        w_ptr = qw_ptr
        dst = qo_ptr + (t * HQ + hh) * D
    else:  # (v programs compute on their last k head's row, in bounds, and store nothing)
        src = k_ptr + t * sk_t + tl.minimum(hh - HQ, HK - 1) * sk_h
        w_ptr = kw_ptr
        dst = ko_ptr + (t * HK + (hh - HQ)) * D
    x = tl.load(src + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / D + eps)
    xn = x * rstd * (1.0 + tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32))
    # NeoX rotate-half over the first 2*HALF dims: partner of i is i +- HALF
    rot = cols < 2 * HALF
    partner = tl.where(cols < HALF, cols + HALF, cols - HALF)
    xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
    xp = xp * rstd * (1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32))
    freq = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_ptr + (cols % HALF), mask=rot, other=0.0)
    sign = tl.where(cols < HALF, -1.0, 1.0)
    out = tl.where(rot, xn * tl.cos(freq) + sign * xp * tl.sin(freq), xn)
    if WRITE_KV:
        if is_q:
            tl.store(dst + cols, out.to(qo_ptr.dtype.element_ty), mask=mask)
        else:
            if slot >= 0:
                if not is_v:  # k: rounded to the activation dtype (the unfused output), then the cache's
                    kv = out.to(qo_ptr.dtype.element_ty)
                    tl.store(kc_ptr + page + (hh - HQ) * s_ch + cols, kv.to(kc_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(dst + cols, out.to(qo_ptr.dtype.element_ty), mask=mask)


def qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps: float):
    """q [T,Hq,D], k [T,Hkv,D] (strided views allowed, last dim contiguous) -> contiguous q, k."""
    T, HQ, D = q.shape
    HK = k.shape[1]
    assert q.stride(2) == 1 and k.stride(2) == 1
    qo = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    ko = torch.empty(T, HK, D, dtype=k.dtype, device=k.device)
    BLOCK = triton.next_power_of_2(D)
    if T:
        _qk_norm_rope_kernel[(T, HQ + HK)](q, k, q_weight, k_weight, positions, inv_freq, qo, ko, HQ, HK, D, eps,
                                           q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                                           q, 0, 0, q, q, positions, 0, 0, 0,
                                           HALF=inv_freq.numel(), BLOCK=BLOCK, WRITE_KV=False, BS=1,
                                           num_warps=_warps(BLOCK))
    return qo, ko


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, eps: float, k_cache, v_cache,
                          slot_mapping):
    """qk_norm_rope, with the normed, rotated k and the raw v scattered straight into their cache pages
    ([num_blocks, block_size, Hkv, D], slot_mapping [T]; negative slots skipped) in the same launch.
    Returns the contiguous q only (k is read back from the cache by attention)."""
    from linrnn_kernels.attention.common import check_cache

    check_cache(k_cache, v_cache)
    T, HQ, D = q.shape
    HK = k.shape[1]
    _, bs, hkv, d = k_cache.shape
    if k.shape != (T, hkv, d) or v.shape != (T, hkv, d) or d != D:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [T={T}, {hkv}, {d}] to match the cache")
    if slot_mapping.shape != (T,) or k_cache.stride() != v_cache.stride():
        raise ValueError(f"slot_mapping must be [T={T}] and the K / V caches laid out alike")
    assert q.stride(2) == 1 and k.stride(2) == 1 and v.stride(2) == 1
    qo = torch.empty(T, HQ, D, dtype=q.dtype, device=q.device)
    BLOCK = triton.next_power_of_2(D)
    if T:
        _qk_norm_rope_kernel[(T, HQ + 2 * HK)](
            q, k, q_weight, k_weight, positions, inv_freq, qo, qo, HQ, HK, D, eps,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v, v.stride(0), v.stride(1), k_cache, v_cache, slot_mapping,
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            HALF=inv_freq.numel(), BLOCK=BLOCK, WRITE_KV=True, BS=bs, num_warps=_warps(BLOCK))
    return qo
