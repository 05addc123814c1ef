"""Router kernel (SPEC §1.8): f32 softmax over all experts, top-k, optional renormalisation.

One program handles BLOCK_T tokens with the whole expert row in registers (E <= 1024); top-k is k
rounds of argmax-and-mask. The default is one token per single-warp program: every reduction is
then a warp shuffle. (16 tokens on 4 warps cost a flat ~51 us per call inside the 35B decode step on
an H200: 18 dependent cross-warp reductions; the launch is on the decode critical path 40 times.)
Ties pick the lowest expert index (torch.topk leaves the order of ties unspecified).
logit_topk: the same results on 32-bit keys of 16-bit logits (the fused router's finishing program).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.gemv.config import pdl_launch_kwargs
from linrnn_kernels.gemv.skinny import gdc_launch_dependents, gdc_wait


@triton.jit
def softmax_topk(logits, row_ok, col, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_K: tl.constexpr):
    """f32 softmax over each row of `logits` [rows, BLOCK_E] (-inf where masked), then top-k as k rounds
    of argmax-and-mask; returns (weights [rows, BLOCK_K], ids, slot index). Shared with the fused router."""
    # rows past the end read -inf everywhere: keep their max and sum finite so they stay NaN-free
    row_max = tl.where(row_ok, tl.max(logits, axis=1), 0.0)
    p = tl.exp(logits - row_max[:, None])
    p = p / tl.where(row_ok, tl.sum(p, axis=1), 1.0)[:, None]
    slot = tl.arange(0, BLOCK_K)
    top_w = tl.zeros((logits.shape[0], BLOCK_K), tl.float32)
    top_i = tl.zeros((logits.shape[0], BLOCK_K), tl.int32)
    # one max-reduction per round on a packed key: the probability's bits (p >= 0, so its int32 bits order
    # as the floats do; a removed winner's -1 orders below every p) above the inverted expert index (ties
    # pick the lowest index)
    top: tl.constexpr = logits.shape[1] - 1
    inv = (col * -1 + top).to(tl.int64)
    for j in tl.static_range(TOP_K):
        key = tl.max((p.to(tl.int32, bitcast=True).to(tl.int64) << 32) | inv[None, :], axis=1)
        best = ((key & 0xFFFFFFFF) * -1 + top).to(tl.int32)
        best_p = (key >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        top_w = tl.where(slot[None, :] == j, best_p[:, None], top_w)
        top_i = tl.where(slot[None, :] == j, best[:, None], top_i)
        # probabilities are >= 0 and padded experts are 0, so -1 removes the winner for good
        p = tl.where(col[None, :] == best[:, None], -1.0, p)
    if RENORMALIZE:
        top_w = top_w / tl.where(row_ok, tl.sum(top_w, axis=1), 1.0)[:, None]
    return top_w, top_i, slot


@triton.jit
def logit_topk(logits, row_ok, col, KEY_DTYPE: tl.constexpr, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
               BLOCK_K: tl.constexpr):
    """softmax_topk's results for logits that are exactly KEY_DTYPE values (a 16-bit float: the fused router's
    rounded logits), with the top-k on 32-bit keys (the logit's order-preserving 16 bits above the inverted
    expert index) instead of softmax_topk's 64-bit ones: one shuffle per reduction step instead of two. The
    weights are computed by the same expressions (exp(l - max) / sum over the same tensor), so they are the same
    bits. Ties pick the lowest index among equal logits; softmax_topk breaks ties among equal probabilities, which
    differ only where distinct logits round to the same f32 probability (|logit| < ~1e-5, or probabilities
    underflowing to 0): both are top-k of the same probabilities."""
    bits = (logits + 0.0).to(KEY_DTYPE).to(tl.int16, bitcast=True).to(tl.int32)  # + 0.0: -0 keys as +0
    ordered = bits ^ ((bits >> 15) & 0x7FFF)  # sign-magnitude -> two's complement order
    top: tl.constexpr = logits.shape[1] - 1
    key = (ordered << 16) | (col * -1 + top)[None, :]
    slot = tl.arange(0, BLOCK_K)
    top_l = tl.zeros((logits.shape[0], BLOCK_K), tl.float32)
    top_i = tl.zeros((logits.shape[0], BLOCK_K), tl.int32)
    row_max = tl.zeros((logits.shape[0],), tl.float32)
    for j in tl.static_range(TOP_K):
        best_key = tl.max(key, axis=1)
        best = (best_key & 0xFFFF) * -1 + top
        o = best_key >> 16
        best_l = (o ^ ((o >> 15) & 0x7FFF)).to(tl.int16).to(KEY_DTYPE, bitcast=True).to(tl.float32)
        if j == 0:
            # rows past the end read -inf everywhere: keep their max finite so they stay NaN-free
            row_max = tl.where(row_ok, best_l, 0.0)
        top_l = tl.where(slot[None, :] == j, best_l[:, None], top_l)
        top_i = tl.where(slot[None, :] == j, best[:, None], top_i)
        key = tl.where(col[None, :] == best[:, None], -2147483648, key)
    p = tl.exp(logits - row_max[:, None])
    total = tl.where(row_ok, tl.sum(p, axis=1), 1.0)
    top_w = tl.where(slot[None, :] < TOP_K, tl.exp(top_l - row_max[:, None]) / total[:, None], 0.0)
    if RENORMALIZE:
        top_w = top_w / tl.where(row_ok, tl.sum(top_w, axis=1), 1.0)[:, None]
    return top_w, top_i, slot


@triton.jit
def _route_kernel(logits_ptr, stride_lt, weights_ptr, ids_ptr, T, E,
                  TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                  BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the logits' writer first, then the next kernel may launch (it waits for this one)
        gdc_wait()
        gdc_launch_dependents()
    tok = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    col = tl.arange(0, BLOCK_E)
    tok_ok = tok < T
    logits = tl.load(logits_ptr + tok[:, None].to(tl.int64) * stride_lt + col[None, :],
                     mask=tok_ok[:, None] & (col < E)[None, :], other=float("-inf")).to(tl.float32)
    top_w, top_i, slot = softmax_topk(logits, tok_ok, col, TOP_K, RENORMALIZE, BLOCK_K)
    out = tok[:, None].to(tl.int64) * TOP_K + slot[None, :]
    out_mask = tok_ok[:, None] & (slot < TOP_K)[None, :]
    tl.store(weights_ptr + out, top_w.to(weights_ptr.dtype.element_ty), mask=out_mask)
    tl.store(ids_ptr + out, top_i, mask=out_mask)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, block_t: int = 1, num_warps: int = 1,
          weight_dtype: torch.dtype = torch.float32, pdl: bool | None = None):
    """Triton twin of naive.route: (topk_weights [T, k] in weight_dtype (rounded once from f32; the MoE
    layer wants the activation dtype, so no separate cast launch), topk_ids [T, k] int32). pdl: launched with
    programmatic dependent launch (default: chain_pdl())."""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [T, E], got shape {tuple(router_logits.shape)}")
    T, E = router_logits.shape
    if not 1 <= top_k <= E:
        raise ValueError(f"top_k={top_k} must be in [1, num_experts={E}]")
    if E > 1024:
        raise ValueError(f"route kernel keeps a token's {E} expert logits in registers; at most 1024")
    logits = router_logits if router_logits.stride(1) == 1 else router_logits.contiguous()
    weights = torch.empty(T, top_k, dtype=weight_dtype, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.int32, device=logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    _route_kernel[(triton.cdiv(T, block_t),)](
        logits, logits.stride(0), weights, ids, T, E,
        TOP_K=top_k, RENORMALIZE=bool(renormalize), BLOCK_T=block_t, BLOCK_E=block_e,
        BLOCK_K=triton.next_power_of_2(top_k), num_warps=num_warps, **chain_pdl_kwargs(logits, pdl))
    return weights, ids


# route() and the one-launch alignment are launched with PDL (each waits for its input's writer, then lets the next
# kernel launch; the MoE gate_up waits for them). H200, one 35B-A3B layer, route -> align -> experts (round 6 call 1,
# benchmarks/results/kernels/moe/round6_small/): 21.2 vs 22.2 us at B = 1, 53.5 vs 54.4 at 8, 141.2 vs 142.5 at 64,
# 156.5 vs 157.7 at 128, 188.0 vs 188.6 at 256
ROUTE_PDL = True


def chain_pdl() -> bool:
    """Whether route() and the one-launch alignment (align.moe_align_block_size) are launched with PDL by default:
    ROUTE_PDL, unless LINRNN_ROUTE_PDL=0 (where PDL is available: pdl_launch_kwargs)."""
    import os

    return ROUTE_PDL and os.environ.get("LINRNN_ROUTE_PDL", "1") != "0"


def chain_pdl_kwargs(x: torch.Tensor, pdl: bool | None) -> dict:
    """Launch options of route / align: pdl_launch_kwargs where pdl (None: chain_pdl()) is on, else PDL off."""
    return pdl_launch_kwargs(x) if (chain_pdl() if pdl is None else pdl) else {"PDL": False}
