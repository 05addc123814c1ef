"""Naive PyTorch reference for the sparse-MoE ops (SPEC §1.8). The oracle for kernels/moe/*."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linrnn_kernels.quant import WeightTensor


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool):
    """f32 softmax over all experts, top-k, optional renormalisation.

    Returns (topk_weights [T, k] f32, topk_ids [T, k] int64).
    """
    p = torch.softmax(router_logits.float(), dim=-1)
    w, ids = torch.topk(p, top_k, dim=-1)
    if renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w, ids


def expert_weight(w: WeightTensor, e: int) -> WeightTensor:
    """Expert e's slice of stacked expert weights."""
    return WeightTensor(w.fmt, *(None if t is None else t[e] for t in (w.data, w.block_scale, w.row_scale)))


def moe_experts(x, topk_weights, topk_ids, w13: WeightTensor, w2: WeightTensor):
    """sum_j w_j * W2[e_j] (silu(W1[e_j] x) * W3[e_j] x), dequantizing only the experts hit.

    x [T, H]; w13 [E, 2I, H] (rows [0, I) = gate, [I, 2I) = up); w2 [E, H, I] (any WeightTensor
    format). Accumulates in f32, returns x.dtype.
    """
    out = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float32, device=x.device)
    inter = w13.out_features // 2
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = x[tok].float() @ expert_weight(w13, e).dequantize().t()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = h @ expert_weight(w2, e).dequantize().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)
