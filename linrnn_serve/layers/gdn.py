"""Gated-DeltaNet token mixer (SPEC §1.5; Qwen3-Next's fused layout is de-interleaved at load, §1.6).

The four input projections form one FusedLinear `in_proj` with parts
qkv [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)], z (Hv*Dv), b (Hv), a (Hv): one GEMM when they share a format.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

import linrnn_kernels.gdn as gdn_ops
import linrnn_kernels.gemv as gemv_ops
import linrnn_kernels.norm as norm_ops
from linrnn_serve.batch import ForwardBatch, GDNLayerState
from linrnn_serve.config import ModelConfig
from linrnn_serve.layers.linear import DenseWeights, FusedLinear, Linear
from linrnn_serve.layers.norms import PostNorm


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt=lambda name: DenseWeights):
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim, self.conv_dim = cfg.key_dim, cfg.value_dim, cfg.conv_dim
        self.eps = cfg.rms_norm_eps
        K = cfg.linear_conv_kernel_dim
        self.in_proj = FusedLinear(
            cfg.hidden_size,
            [("qkv", self.conv_dim), ("z", self.value_dim), ("b", self.hv), ("a", self.hv)],
            dtype,
            {p: fmt(f"linear_attn.in_proj_{p}") for p in ("qkv", "z", "b", "a")},
        )
        self.conv1d_weight = nn.Parameter(torch.empty(self.conv_dim, K, dtype=dtype), requires_grad=False)
        # A_log / dt_bias kept in f32 whatever the model dtype (SPEC §1.5: gates are computed in f32)
        self.A_log = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv, dtype=torch.float32), requires_grad=False)
        self.norm_weight = nn.Parameter(torch.empty(self.dv, dtype=dtype), requires_grad=False)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, dtype, fmt("linear_attn.out_proj"))

    @staticmethod
    def with_plan(batch: ForwardBatch) -> ForwardBatch:
        """A prefill batch's copy carrying its varlen plan (chunk table, token -> sequence map), built once for
        all GDN layers of the forward; decode batches need none."""
        if batch.is_decode or batch.gdn_plan is not None:
            return batch
        return dataclasses.replace(batch, gdn_plan=gdn_ops.varlen_plan(batch.cu_seqlens, batch.num_tokens))

    def forward(self, x: torch.Tensor, batch: ForwardBatch, st: GDNLayerState, post: PostNorm | None = None):
        """Mixer output [T, H]; with `post`, (post-normed output, new residual), the gated norm, out_proj,
        residual add and post norm fused into one kernel where the skinny GEMM takes the shape."""
        T = x.shape[0]
        w_in = self.in_proj.weight_tensor()
        if batch.is_decode and w_in is not None and gemv_ops.takes(x, w_in, "conv"):
            # one kernel: in_proj, then the causal conv + SiLU of the q/k/v channels in its epilogue
            proj = gemv_ops.fused_linear(x, w_in, epilogue="conv",
                                         conv=(self.conv1d_weight, st.conv, batch.state_indices))
            qkv, z, b, a = torch.split(proj, [self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        else:
            proj = self.in_proj(x)
            qkv, z, b, a = torch.split(proj, [self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
            if batch.is_decode:
                qkv = gdn_ops.conv1d_decode(qkv, self.conv1d_weight, st.conv, batch.state_indices)
            else:
                qkv = gdn_ops.conv1d_varlen(qkv, self.conv1d_weight, st.conv, batch.cu_seqlens,
                                            batch.state_indices, plan=batch.gdn_plan)
        q, k, v = torch.split(qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(T, self.hk, self.dk)
        k = k.reshape(T, self.hk, self.dk)
        v = v.reshape(T, self.hv, self.dv)
        pools = (st.ssm_f32, st.ssm_bf16, st.head_is_bf16, st.head_local)
        if batch.is_decode:
            o = gdn_ops.gdn_decode(q, k, v, a, b, self.A_log, self.dt_bias, *pools, batch.state_indices)
        else:
            o = gdn_ops.gdn_prefill(q, k, v, a, b, self.A_log, self.dt_bias, batch.cu_seqlens, *pools,
                                    batch.state_indices, plan=batch.gdn_plan)
        w = self.out_proj.weight_tensor()
        if post is not None and w is not None:
            return gemv_ops.fused_linear(o.reshape(T, self.value_dim), w, prologue_kind="gated_norm", gate=z,
                                         pro_w=self.norm_weight, head=self.dv, pro_eps=self.eps,
                                         **post.fused_options())
        y = norm_ops.gated_rmsnorm(o, z.reshape(T, self.hv, self.dv), self.norm_weight, self.eps)
        h = self.out_proj(y.reshape(T, self.value_dim))
        return h if post is None else post(h)
