"""Paged attention ops for the full-attention layers: KV write, varlen causal attention over pages.

Triton kernels (kv_write.py, prefill.py, decode.py via paged.py) for CUDA tensors, the naive
reference (naive.py) otherwise or inside linrnn_kernels.reference_ops().
"""
from linrnn_kernels.attention import naive
from linrnn_kernels.attention import kv_write as _kv_write
from linrnn_kernels.attention import paged as _paged
from linrnn_kernels.dispatch import use_triton


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Scatter k, v [T, Hkv, D] into k_cache/v_cache [num_blocks, block_size, Hkv, D] at slot_mapping [T]."""
    if use_triton(k):
        return _kv_write.write_kv(k, v, k_cache, v_cache, slot_mapping)
    return naive.write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, gate=None):
    """Causal attention of each sequence's new queries q [T, Hq, D] over its paged context -> [T, Hq, D]
    (times sigmoid(gate) when an output gate [T, Hq, D] is given)."""
    if use_triton(q):
        return _paged.paged_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, gate=gate)
    return naive.paged_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, gate=gate)
