"""Naive PyTorch reference for the sparse-MoE ops (SPEC §1.8). The oracle for kernels/moe/*."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linrnn_kernels.quant import WeightTensor, nvfp4


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


def moe_experts(x, topk_weights, topk_ids, w13: WeightTensor, w2: WeightTensor,
                activations: str = "float"):
    """sum_j w_j * W2[e_j] (silu(W1[e_j] x) * W3[e_j] x), dequantizing only the experts hit.

    x [T, H]; w13 [E, 2I, H] (rows [0, I) = gate, [I, 2I) = up); w2 [E, H, I] (any WeightTensor
    format). Accumulates in f32, returns x.dtype. activations="nvfp4" rounds the GEMM inputs (x and
    the SiLU*up intermediate) to NVFP4 first: the W4A4 reference.
    """
    out = torch.zeros(x.shape[0], w2.out_features, dtype=torch.float32, device=x.device)
    inter = w13.out_features // 2
    act = fake_quantize_rows_nvfp4 if activations == "nvfp4" else (lambda t: t.float())
    for e in topk_ids.unique().tolist():
        tok, slot = (topk_ids == e).nonzero(as_tuple=True)
        h = act(x[tok]) @ expert_weight(w13, e).dequantize().t()
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = act(h) @ expert_weight(w2, e).dequantize().t()
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int):
    """Reference for align.moe_align_block_size: (sorted_ids, expert_ids, num_padded) with pairs
    p = t * k + j grouped by expert in ascending order, each expert's run padded to a multiple of
    block_m with the sentinel T * k; expert_ids[b] = expert of block b, -1 past the used blocks.
    Sized to the used length (the kernel's buffers are larger; compare the first num_padded)."""
    flat = topk_ids.reshape(-1).long()
    P = flat.numel()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        pairs = (flat == e).nonzero().flatten().tolist()
        if not pairs:
            continue
        padded = -(-len(pairs) // block_m) * block_m
        sorted_ids += pairs + [P] * (padded - len(pairs))
        expert_ids += [e] * (padded // block_m)
    dev = topk_ids.device
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
            torch.tensor(expert_ids, dtype=torch.int32, device=dev), len(sorted_ids))


def moe_pair_blocks(topk_ids: torch.Tensor, block_m: int):
    """Reference for align.moe_pair_blocks (T <= block_m tokens, distinct ids per token): block b = pair b;
    sorted_ids[b * block_m + n] = token n's pair routed to expert ids[b] (else the sentinel P); expert_ids[b] =
    ids[b] where no earlier token routes to that expert, else -1; num_padded = P * block_m."""
    T, k = topk_ids.shape
    P = T * k
    flat = topk_ids.reshape(-1).long().tolist()
    sorted_ids, expert_ids = [], []
    for b, e in enumerate(flat):
        slots = [P] * block_m
        for n in range(T):
            for j in range(k):
                if flat[n * k + j] == e:
                    slots[n] = n * k + j
        sorted_ids += slots
        expert_ids.append(e if all(flat[q] != e for q in range((b // k) * k)) else -1)
    dev = topk_ids.device
    return (torch.tensor(sorted_ids, dtype=torch.int32, device=dev),
            torch.tensor(expert_ids, dtype=torch.int32, device=dev), P * block_m)


def quantize_rows_nvfp4(x: torch.Tensor):
    """Reference for grouped_gemm.quantize_rows_nvfp4 (W4A4 activations): each row quantized as its
    own tensor with ModelOpt's NVFP4 rounding. Returns (codes [R, K/2], scales [R, K/16], gain [R])."""
    packed, scales, gain = nvfp4.quantize(x.float()[:, None, :])
    return packed[:, 0], scales[:, 0], gain


def fake_quantize_rows_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """x rounded to NVFP4 per row and back, f32."""
    packed, scales, gain = quantize_rows_nvfp4(x)
    return nvfp4.dequantize(packed, scales, gain)
