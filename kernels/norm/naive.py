"""Naive references for the fused elementwise / row-reduction ops (SPEC §1.4)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                addend: torch.Tensor | None = None, gate_logit: torch.Tensor | None = None):
    """h = x + residual (rounded to x.dtype, as transformers' bf16 residual stream), then
    zero-centred RMSNorm: h_f32 * rsqrt(mean(h^2) + eps) * (1 + w) (SPEC §1.4 #1).
    Returns (normed, h); with residual None, h = x. With addend / gate_logit [rows, 1], x is first
    addend + sigmoid(gate_logit) * x (the sigmoid-gated shared expert joining the routed sum, SPEC §1.8)."""
    if addend is not None:
        x = addend + torch.sigmoid(gate_logit.reshape(-1, 1)) * x
    h = x if residual is None else (x.float() + residual.float()).to(x.dtype)
    hf = h.float()
    y = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return y.to(x.dtype), h


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """GDN output norm over the last dim, plain weight, norm before gate: w * RMSNorm(x) * silu(z)
    (SPEC §1.4 #2; cast order as transformers)."""
    dtype = x.dtype
    xf = x.float()
    n = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return ((weight * n) * F.silu(z.float())).to(dtype)


def silu_mul(h: torch.Tensor) -> torch.Tensor:
    """[.., 2I] -> silu(h[.., :I]) * h[.., I:]."""
    i = h.shape[-1] // 2
    return (F.silu(h[..., :i].float()) * h[..., i:].float()).to(h.dtype)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight, k_weight, positions, inv_freq, eps: float):
    """Per-head zero-centred RMSNorm of q [T,Hq,D] and k [T,Hkv,D], then partial NeoX RoPE over the
    first 2*len(inv_freq) dims (SPEC §1.7). Returns new contiguous q, k."""
    rd = 2 * inv_freq.numel()
    out = []
    freqs = positions[:, None].float() * inv_freq.float()
    cos = torch.cat([freqs, freqs], -1).cos()[:, None, :]
    sin = torch.cat([freqs, freqs], -1).sin()[:, None, :]
    for x, w in ((q, q_weight), (k, k_weight)):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())
        xr, xp = xf[..., :rd], xf[..., rd:]
        rot = torch.cat([-xr[..., rd // 2:], xr[..., : rd // 2]], -1)
        out.append(torch.cat([xr * cos + rot * sin, xp], -1).to(x.dtype))
    return out[0], out[1]


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, eps: float, k_cache, v_cache,
                          slot_mapping):
    """qk_norm_rope, then the attention write_kv of (k, v): returns q."""
    from linrnn_kernels.attention import naive as attn_naive

    q, k = qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)
    attn_naive.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return q
