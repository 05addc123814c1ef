"""Sparse-MoE ops: routing and expert computation (SPEC §1.8).

Triton kernels on CUDA tensors (linrnn_kernels.dispatch.use_triton), the naive reference otherwise:
  route(router_logits [T, E], top_k, renormalize, weight_dtype=f32) -> (topk_weights [T, k], topk_ids [T, k])
      (int32 ids from the kernel, int64 from the reference)
  moe_experts(x [T, H], topk_weights, topk_ids, w13: WeightTensor [E, 2I, H], w2: WeightTensor [E, H, I],
              alignment=None, combine=True) -> [T, H] in x.dtype (combine=False: experts.Partials, the
              uncombined f32 partials, where the Triton path has them, for a consumer that combines them)
  route_align(x [T, K], gate_w: WeightTensor [E (+ shared gate), K], E, top_k, renormalize, shared_w13=None)
      -> (logits [T, NL] in x.dtype, topk_weights in x.dtype, topk_ids, alignment or None, h or None):
      the whole router; decode-sized batches run it as one kernel (router_fused.py, whose alignment the
      expert pipeline then reuses: pair blocks where the MMA kernel takes one block per expert, <= 8 tokens,
      align.py; with shared_w13 it also returns the shared expert's SiLU(gate)*up h),
      else the gate GEMM, route() and a cast (h None: the caller computes it)
Modules: router.py (softmax/top-k), router_fused.py (gate GEMM + routing + alignment), align.py (expert-sorted blocks), grouped_gemm.py (the one
GEMM kernel for dense / fp8 / nvfp4 weights, also behind linrnn_kernels.quant.linear), experts.py
(the pipeline), naive.py (the oracle).
NVFP4 experts repacked at load time (nvfp4_layout.py, WeightTensor.packed) run decode batches on
Hopper through the Gluon MMA-fragment kernel (nvfp4_mma.py; `mma_path_available()`) and prefill-sized
ones through the wgmma kernel over the same layout (nvfp4_wgmma.py, from experts.WGMMA_MIN_MEAN_PAIRS).
`nvfp4_gemm_path()` names the NVFP4 GEMM implementation in use ("asm": W4A16 dequantize-in-register
on Hopper; "dot_scaled": W4A4 on FP4 tensor cores, sm_100+, untested) and `describe_nvfp4_gemm()`
is the matching startup log line.
"""
import torch

from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.moe import naive
from linrnn_kernels.moe.grouped_gemm import describe_nvfp4_gemm, nvfp4_gemm_path

__all__ = ["route", "route_align", "moe_experts", "describe_nvfp4_gemm", "nvfp4_gemm_path", "mma_path_available"]


def mma_path_available(device=None) -> bool:
    """Whether NVFP4 experts should be repacked for the MMA-fragment decode kernel (nvfp4_mma.py)."""
    from linrnn_kernels.moe import nvfp4_mma

    return nvfp4_mma.available(device)


def route(router_logits, top_k: int, renormalize: bool, weight_dtype=None):
    """weight_dtype: the dtype of the returned weights (default f32)."""
    weight_dtype = weight_dtype or torch.float32
    if use_triton(router_logits):
        from linrnn_kernels.moe.router import route as route_triton

        return route_triton(router_logits, top_k, renormalize, weight_dtype=weight_dtype)
    w, ids = naive.route(router_logits, top_k, renormalize)
    return w.to(weight_dtype), ids


def route_align(x, gate_w, num_experts: int, top_k: int, renormalize: bool, shared_w13=None, experts_w=None):
    """experts_w: the routed experts' (w13, w2), so the fused router aligns for the block size the expert
    kernels will use (else expert_block_m's)."""
    from linrnn_kernels.gemv import config as gemv_config
    from linrnn_kernels.gemv import fused_linear

    M = x.shape[0]
    if (use_triton(x) and gemv_config.fused_router_enabled(M) and gate_w.fmt == "dense" and 1 <= M <= 32
            and M * top_k <= 512 and num_experts <= 1024):
        from linrnn_kernels.moe import experts, router_fused

        block_m = (experts.alignment_block_m(x, top_k, *experts_w) if experts_w is not None
                   else experts.expert_block_m(M, top_k, num_experts))
        # pair blocks (a shorter serial tail) where the experts take them: distinct ids per token, so not for
        # expert-parallel layers (experts_w None there: they re-align their local ids)
        pair_blocks = experts_w is not None and experts.takes_pair_blocks(x, top_k, *experts_w)
        shared = shared_w13 if shared_w13 is not None and shared_w13.fmt == "dense" else None
        n_all = gate_w.out_features + (shared.out_features // 2 if shared is not None else 0)
        cfg = gemv_config.router_config(M, n_all, gate_w.in_features, x.device)
        logits, w, ids, (sorted_ids, expert_ids, num_padded), h = router_fused.route_align(
            x, gate_w, num_experts, top_k, renormalize, block_m, cfg, shared_w13=shared, pair_blocks=pair_blocks)
        return logits, w, ids, experts.Alignment(sorted_ids, expert_ids, num_padded, block_m, pair_blocks), h
    logits = fused_linear(x, gate_w)
    w, ids = route(logits[:, :num_experts], top_k, renormalize, weight_dtype=x.dtype)
    return logits, w, ids, None, None


def moe_experts(x, topk_weights, topk_ids, w13, w2, alignment=None, combine: bool = True):
    """combine=False: the uncombined experts.Partials where the Triton path has them, else the output."""
    if use_triton(x):
        from linrnn_kernels.moe import experts

        if experts.supported(x, w13, w2):
            return experts.moe_experts(x, topk_weights, topk_ids, w13, w2, alignment=alignment, combine=combine)
    return naive.moe_experts(x, topk_weights, topk_ids, w13, w2)
