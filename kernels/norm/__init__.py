"""Fused row-wise ops: residual add + zero-centred RMSNorm, gated RMSNorm, SiLU*mul, q/k norm + RoPE
(optionally with the KV-cache write of k and v in the same launch)."""
from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.norm import naive


def add_rmsnorm(x, residual, weight, eps, addend=None, gate_logit=None):
    """(normed, residual sum); with addend / gate_logit, x is addend + sigmoid(gate_logit) * x first (naive.py)."""
    if use_triton(x):
        from linrnn_kernels.norm.fused import add_rmsnorm as k
        return k(x, residual, weight, eps, addend, gate_logit)
    return naive.add_rmsnorm(x, residual, weight, eps, addend, gate_logit)


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


def qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache, slot_mapping):
    """q/k norm + RoPE, k and v written to their KV-cache pages; returns q. One launch on CUDA (default;
    LINRNN_FUSED_ROPE_KV=0: qk_norm_rope and the attention write_kv, two launches)."""
    import os

    if use_triton(q):
        if os.environ.get("LINRNN_FUSED_ROPE_KV", "1") != "0":
            from linrnn_kernels.norm.fused import qk_norm_rope_write_kv as kern
            return kern(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache, slot_mapping)
        from linrnn_kernels.attention import write_kv

        q, k = qk_norm_rope(q, k, q_weight, k_weight, positions, inv_freq, eps)
        write_kv(k, v, k_cache, v_cache, slot_mapping)
        return q
    return naive.qk_norm_rope_write_kv(q, k, v, q_weight, k_weight, positions, inv_freq, eps, k_cache, v_cache,
                                       slot_mapping)
