"""Skinny GEMM / split-K GEMV for decode-sized batches, with fused prologues and epilogues.

  fused_linear(x, w: WeightTensor, **options) -> y, or (normed, h) with norm_w
      options (naive.py defines each as the chain of ops it replaces):
        prologue_kind "none" | "rmsnorm" | "gated_norm" | "sigmoid_gate" (gate, pro_w, head, pro_eps)
        epilogue "none" | "silu_mul" | "gate_add" (addend or addend_parts, gate_logit), residual, norm_w / norm_eps
        addend_parts = (part [S, M * G, N] f32, G): the routed experts' uncombined partials in place of the
        addend (combined inside the kernel as sum_reduce would: one launch and one round trip fewer)

On CUDA with the skinny GEMM enabled for the shape (config.py: switches and the tuning table) it is
one launch of skinny.py's kernel; otherwise the unfused chain runs: the projection through
linrnn_kernels.quant.linear (cuBLAS for dense weights) and the existing norm / elementwise kernels
(their naive references on CPU). Either way the result equals naive.skinny_linear up to rounding
order.
"""
from __future__ import annotations

import torch

from linrnn_kernels import norm as norm_ops
from linrnn_kernels.dispatch import use_triton
from linrnn_kernels.gemv import config, naive
from linrnn_kernels.quant import WeightTensor, linear

__all__ = ["fused_linear", "takes", "takes_rows", "combine", "fusion_kind", "config", "naive"]


def takes(x: torch.Tensor, w: WeightTensor, epilogue: str = "none") -> bool:
    """Whether fused_linear runs the skinny kernel for this input (else the unfused chain): layers ask
    before using an epilogue with no unfused twin here (the GDN in_proj's conv)."""
    return use_triton(x) and config.skinny_enabled(x.shape[0], _out_features(w, epilogue), x.shape[1], w.fmt,
                                                   fusion_kind("none", epilogue))


def fusion_kind(prologue_kind: str, epilogue: str) -> str:
    """The fusion a call is tuned by (config.table_key): its prologue, else its epilogue."""
    return prologue_kind if prologue_kind != "none" else epilogue


def _out_features(w: WeightTensor, epilogue: str) -> int:
    return w.out_features // 2 if epilogue == "silu_mul" else w.out_features


def fused_linear(x: torch.Tensor, w: WeightTensor, *, prologue_kind: str = "none", gate=None, pro_w=None,
                 head: int = 0, pro_eps: float = 1e-6, epilogue: str = "none", addend=None, gate_logit=None,
                 residual=None, norm_w=None, norm_eps: float = 1e-6, conv=None, addend_parts=None):
    M, K = x.shape
    kind = fusion_kind(prologue_kind, epilogue)
    if use_triton(x) and config.skinny_enabled(M, _out_features(w, epilogue), K, w.fmt, kind):
        from linrnn_kernels.gemv import skinny

        cfg = config.skinny_config(M, _out_features(w, epilogue), K, w.fmt, x.device, head, kind)
        return skinny.skinny_linear(x, w, cfg, prologue_kind=prologue_kind, gate=gate, pro_w=pro_w, head=head,
                                    pro_eps=pro_eps, epilogue=epilogue, addend=addend, gate_logit=gate_logit,
                                    residual=residual, norm_w=norm_w, norm_eps=norm_eps, conv=conv,
                                    addend_parts=addend_parts)
    if epilogue == "conv":
        raise ValueError("the conv epilogue has no unfused twin here: check takes() first")
    if addend_parts is not None:
        addend = combine(*addend_parts, x.dtype)
    return compose(x, w, prologue_kind=prologue_kind, gate=gate, pro_w=pro_w, head=head, pro_eps=pro_eps,
                   epilogue=epilogue, addend=addend, gate_logit=gate_logit, residual=residual, norm_w=norm_w,
                   norm_eps=norm_eps)


def takes_rows(M: int, x: torch.Tensor, w: WeightTensor, epilogue: str = "none") -> bool:
    """takes() for an M-row input to w that is not computed yet (x: any tensor on the input's device)."""
    return use_triton(x) and config.skinny_enabled(M, _out_features(w, epilogue), w.in_features, w.fmt,
                                                   fusion_kind("none", epilogue))


def combine(part: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """The routed experts' partials [S, T * group, N] f32 -> [T, N] in dtype (the experts' own combine)."""
    if use_triton(part):
        from linrnn_kernels.moe.grouped_gemm import sum_reduce

        out = torch.empty(part.shape[1] // group, part.shape[2], dtype=dtype, device=part.device)
        sum_reduce(part, out, group)
        return out
    return naive.combine_parts(part, group, dtype)


def compose(x, w: WeightTensor, *, prologue_kind="none", gate=None, pro_w=None, head=0, pro_eps=1e-6,
            epilogue="none", addend=None, gate_logit=None, residual=None, norm_w=None, norm_eps=1e-6):
    """The unfused chain with the model's existing kernels (the skinny GEMM switched off or unsupported)."""
    T, K = x.shape
    if prologue_kind == "rmsnorm":
        x = norm_ops.add_rmsnorm(x, None, pro_w, pro_eps)[0]
    elif prologue_kind == "gated_norm":
        x = norm_ops.gated_rmsnorm(x.reshape(T, K // head, head), gate.reshape(T, K // head, head), pro_w,
                                   pro_eps).reshape(T, K)
    elif prologue_kind == "sigmoid_gate":
        x = x * torch.sigmoid(gate.reshape(T, K))
    elif prologue_kind != "none":
        raise ValueError(f"unknown prologue {prologue_kind!r}")
    y = linear(x, w)
    if epilogue == "gate_add" and norm_w is not None:  # gate, add, residual add and norm in one pass
        return norm_ops.add_rmsnorm(y, residual, norm_w, norm_eps, addend=addend, gate_logit=gate_logit)
    if epilogue == "silu_mul":
        y = norm_ops.silu_mul(y)
    elif epilogue == "gate_add":
        y = addend + torch.sigmoid(gate_logit.reshape(-1, 1)) * y
    elif epilogue != "none":
        raise ValueError(f"unknown epilogue {epilogue!r}")
    if norm_w is not None:
        return norm_ops.add_rmsnorm(y, residual, norm_w, norm_eps)
    if residual is not None:
        return y + residual
    return y
