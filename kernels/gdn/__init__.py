"""Gated-DeltaNet ops: decode (one token per sequence), varlen chunked prefill, causal conv1d.

Triton kernels (decode.py, prefill.py, conv.py) for CUDA tensors, the naive reference (naive.py)
otherwise or inside linrnn_kernels.dispatch.reference_ops(). Signatures are those of naive.py.
Under TRITON_INTERPRET=1 (CPU tests) call the kernel modules directly.
State pools: f32 heads [slots, H_f32, Dk, Dv], bf16 heads [slots, H_bf16, Dv / 64, Dk, 64] (layout.py).
"""
from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.gdn import conv as _conv
from linrnn_kernels.gdn import decode as _decode
from linrnn_kernels.gdn import naive
from linrnn_kernels.gdn import prefill as _prefill
from linrnn_kernels.gdn.naive import gdn_gates, l2norm  # noqa: F401  (shared helpers)
from linrnn_kernels.gdn.prefill import VarlenPlan, varlen_plan  # noqa: F401  (a forward's prefill bookkeeping)


def gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices):
    """One token per sequence; returns o [B, Hv, Dv] and updates the hybrid pools in place."""
    impl = _decode.gdn_decode if use_triton(q) else naive.gdn_decode
    return impl(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices)


def gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16, head_local,
                state_indices, plan=None):
    """Varlen chunked prefill from the pooled states; returns o [T, Hv, Dv], final states written back.
    plan: the batch's varlen_plan (optional; the Triton path builds one when not given)."""
    if use_triton(q):
        return _prefill.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16,
                                    head_local, state_indices, plan=plan)
    return naive.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu_seqlens, ssm_f32, ssm_bf16, head_is_bf16, head_local,
                             state_indices)


def conv1d_decode(x, weight, conv_state, state_indices):
    """Causal conv1d + SiLU for one token per sequence; conv_state [slots, K-1, C] updated in place."""
    impl = _conv.conv1d_decode if use_triton(x) else naive.conv1d_decode
    return impl(x, weight, conv_state, state_indices)


def conv1d_varlen(x, weight, conv_state, cu_seqlens, state_indices, plan=None):
    """Causal conv1d + SiLU over a flattened varlen batch; conv_state updated per sequence (plan: as gdn_prefill)."""
    if use_triton(x):
        return _conv.conv1d_varlen(x, weight, conv_state, cu_seqlens, state_indices,
                                   seq_of_token=None if plan is None else plan.seq_of_token)
    return naive.conv1d_varlen(x, weight, conv_state, cu_seqlens, state_indices)
