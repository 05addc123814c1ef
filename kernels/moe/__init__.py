"""Sparse-MoE ops: routing and expert computation (SPEC §1.8).

Triton kernels on CUDA tensors (linrnn_kernels.dispatch.use_triton), the naive reference otherwise:
  route(router_logits [T, E], top_k, renormalize) -> (topk_weights f32 [T, k], topk_ids [T, k])
      (int32 ids from the kernel, int64 from the reference)
  moe_experts(x [T, H], topk_weights, topk_ids, w13: WeightTensor [E, 2I, H], w2: WeightTensor [E, H, I])
      -> [T, H] in x.dtype
Modules: router.py (softmax/top-k), align.py (expert-sorted blocks), grouped_gemm.py (the one
GEMM kernel for dense / fp8 / nvfp4 weights, also behind linrnn_kernels.quant.linear), experts.py
(the pipeline), naive.py (the oracle).
NVFP4 experts repacked at load time (nvfp4_layout.py, WeightTensor.packed) run decode batches on
Hopper through the Gluon MMA-fragment kernel (nvfp4_mma.py; `mma_path_available()`).
`nvfp4_gemm_path()` names the NVFP4 GEMM implementation in use ("asm": W4A16 dequantize-in-register
on Hopper; "dot_scaled": W4A4 on FP4 tensor cores, sm_100+, untested) and `describe_nvfp4_gemm()`
is the matching startup log line.
"""
from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.moe import naive
from linrnn_kernels.moe.grouped_gemm import describe_nvfp4_gemm, nvfp4_gemm_path

__all__ = ["route", "moe_experts", "describe_nvfp4_gemm", "nvfp4_gemm_path", "mma_path_available"]


def mma_path_available(device=None) -> bool:
    """Whether NVFP4 experts should be repacked for the MMA-fragment decode kernel (nvfp4_mma.py)."""
    from linrnn_kernels.moe import nvfp4_mma

    return nvfp4_mma.available(device)


def route(router_logits, top_k: int, renormalize: bool):
    if use_triton(router_logits):
        from linrnn_kernels.moe.router import route as route_triton

        return route_triton(router_logits, top_k, renormalize)
    return naive.route(router_logits, top_k, renormalize)


def moe_experts(x, topk_weights, topk_ids, w13, w2):
    if use_triton(x):
        from linrnn_kernels.moe import experts

        if experts.supported(x, w13, w2):
            return experts.moe_experts(x, topk_weights, topk_ids, w13, w2)
    return naive.moe_experts(x, topk_weights, topk_ids, w13, w2)
