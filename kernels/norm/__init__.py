"""Fused row-wise ops: residual add + zero-centred RMSNorm, gated RMSNorm, SiLU*mul, q/k norm + RoPE."""
from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.norm import naive


def add_rmsnorm(x, residual, weight, eps):
    if use_triton(x):
        from linrnn_kernels.norm.fused import add_rmsnorm as k
        return k(x, residual, weight, eps)
    return naive.add_rmsnorm(x, residual, weight, eps)


def gated_rmsnorm(x, z, weight, eps):
    if use_triton(x):
        from linrnn_kernels.norm.fused import gated_rmsnorm as k
        return k(x, z, weight, eps)
    return naive.gated_rmsnorm(x, z, weight, eps)


def silu_mul(h):
    if use_triton(h):
        from linrnn_kernels.norm.fused import silu_mul as k
        return k(h)
    return naive.silu_mul(h)


def qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps):
    if use_triton(q):
        from linrnn_kernels.norm.fused import qk_norm_rope as kern
        return kern(q, k, q_weight, k_weight, positions, inv_freq, eps)
    return naive.qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)
