"""Naive compositions the fused skinny-GEMM kernel (skinny.py) must equal: each is the chain of
separate ops the model ran before fusion, with the same roundings to the activation dtype.

  prologue  "none"          a = x
            "rmsnorm"       a = add_rmsnorm(x, None, pro_w)[0]          (zero-centred, SPEC §1.4 #1)
            "gated_norm"    a = gated_rmsnorm(x, gate, pro_w) per head of `head` columns (GDN out_proj)
            "sigmoid_gate"  a = x * sigmoid(gate)                      (attention output gate)
            gate: [M, K] or a per-head strided view [M, K / head, head]
  GEMM      y = a W^T        (rounded to the activation dtype, as cuBLAS' bf16 output)
  epilogue  "none"          y
            "silu_mul"      silu(y[:, :N]) * y[:, N:]   with W = [gate rows; up rows] (2N rows)
            "gate_add"      addend + sigmoid(gate_logit[:, None]) * y   (shared expert into the MoE sum);
                            addend_parts = (part [S, M * G, N] f32, G) in place of the addend: the routed
                            experts' split-K / top-k partials, addend = sum_reduce(part) (sum over the G
                            pairs of a row and the S splits in f32, rounded to the activation dtype)
            "conv"          y[:, :C] -> conv1d_decode(y[:, :C], conv weight, conv state, state indices)
                            (GDN in_proj: causal conv + SiLU of the q/k/v channels, state updated)
  residual  h = y + residual (optional)
  row norm  (normed, h) = add_rmsnorm(h, None, norm_w)   (optional: the next layer's input norm)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from linrnn_kernels.norm import naive as norm_naive
from linrnn_kernels.quant import WeightTensor


def prologue(x, kind: str, gate=None, pro_w=None, head: int = 0, eps: float = 1e-6):
    if kind == "none":
        return x
    if kind == "rmsnorm":
        return norm_naive.add_rmsnorm(x, None, pro_w, eps)[0]
    if kind == "gated_norm":
        T, K = x.shape
        return norm_naive.gated_rmsnorm(x.reshape(T, K // head, head), gate.reshape(T, K // head, head),
                                        pro_w, eps).reshape(T, K)
    if kind == "sigmoid_gate":
        return x * torch.sigmoid(gate.reshape(x.shape))
    raise ValueError(f"unknown prologue {kind!r}")


def combine_parts(part: torch.Tensor, group: int, dtype) -> torch.Tensor:
    """sum_reduce's result: out[t] = sum_j sum_s part[s, t * group + j] (f32), in `dtype`."""
    S, P, N = part.shape
    return part.float().reshape(S, P // group, group, N).sum(dim=(0, 2)).to(dtype)


def skinny_linear(x, w: WeightTensor, *, prologue_kind="none", gate=None, pro_w=None, head=0, pro_eps=1e-6,
                  epilogue="none", addend=None, gate_logit=None, residual=None, norm_w=None, norm_eps=1e-6,
                  conv=None, addend_parts=None):
    """The unfused reference: returns y, or (normed, h) when norm_w is given."""
    if addend_parts is not None:
        addend = combine_parts(addend_parts[0], addend_parts[1], x.dtype)
    a = prologue(x, prologue_kind, gate, pro_w, head, pro_eps)
    y = F.linear(a.float(), w.dequantize(torch.float32)).to(x.dtype)
    if epilogue == "silu_mul":
        y = norm_naive.silu_mul(y)
    elif epilogue == "gate_add":
        y = addend + torch.sigmoid(gate_logit.reshape(-1, 1)) * y
    elif epilogue == "conv":
        from linrnn_kernels.gdn import naive as gdn_naive

        cw, cs, idx = conv
        C = cw.shape[0]
        y = torch.cat([gdn_naive.conv1d_decode(y[:, :C], cw, cs, idx), y[:, C:]], -1)
    elif epilogue != "none":
        raise ValueError(f"unknown epilogue {epilogue!r}")
    if norm_w is not None:
        return norm_naive.add_rmsnorm(y, residual, norm_w, norm_eps)
    if residual is not None:
        return (y.float() + residual.float()).to(y.dtype)
    return y
