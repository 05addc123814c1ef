"""Naive PyTorch reference for paged attention (SPEC §1.7). The oracle for kernels/attention/*.

Paged KV layout per attention layer: k_cache / v_cache [num_blocks, block_size, kv_heads, head_dim];
token slot s lives at block s // block_size, offset s % block_size. GQA: query head h reads kv head
h // (Hq // Hkv) (transformers' repeat_kv).
"""
from __future__ import annotations

import torch


def write_kv(k, v, k_cache, v_cache, slot_mapping):
    """Scatter new keys/values [T, Hkv, D] into their slots (slot_mapping [T])."""
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d)[slot_mapping.long()] = k.to(k_cache.dtype)
    v_cache.view(nb * bs, h, d)[slot_mapping.long()] = v.to(v_cache.dtype)


def gather_kv(cache, block_table, length):
    """Keys (or values) of positions [0, length) of one sequence: [length, Hkv, D]."""
    bs = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.long()[pos // bs]
    return cache[blocks, pos % bs]


def paged_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, gate=None):
    """Causal attention of each sequence's new queries over its whole paged context.

    q [T, Hq, D]; sequence i's queries are its last q_len_i positions of seq_lens[i]. Softmax in f32.
    Returns o [T, Hq, D] in q.dtype; with gate [T, Hq, D], o * sigmoid(gate) (in f32, rounded once).
    """
    out = torch.empty_like(q)
    cu = cu_seqlens.tolist()
    hq, hkv = q.shape[1], k_cache.shape[2]
    for i in range(len(cu) - 1):
        s, e = cu[i], cu[i + 1]
        if e == s:
            continue
        L = int(seq_lens[i])
        n = e - s
        k = gather_kv(k_cache, block_tables[i], L).float().repeat_interleave(hq // hkv, dim=1)
        v = gather_kv(v_cache, block_tables[i], L).float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[s:e].float(), k) * scale
        qpos = torch.arange(L - n, L, device=q.device)[:, None]
        kpos = torch.arange(L, device=q.device)[None, :]
        scores = scores.masked_fill(kpos > qpos, float("-inf"))
        p = torch.softmax(scores, dim=-1)
        o = torch.einsum("hqk,khd->qhd", p, v)
        out[s:e] = (o if gate is None else o * torch.sigmoid(gate[s:e].float())).to(q.dtype)
    return out
