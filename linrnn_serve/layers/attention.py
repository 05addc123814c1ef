"""Gated full attention (SPEC §1.7): per-head [q | gate] interleave, ZC q/k norm, partial NeoX RoPE,
GQA over the paged KV cache, sigmoid output gate.

q_proj, k_proj and v_proj form one FusedLinear `qkv_proj` with parts
q (Hq * 2D rows, per-head [q_h | gate_h]), k (Hkv*D), v (Hkv*D).
"""
from __future__ import annotations

import torch
from torch import nn

import linrnn_kernels.attention as attn_ops
import linrnn_kernels.gemv as gemv_ops
import linrnn_kernels.norm as norm_ops
from linrnn_serve.batch import AttnLayerState, ForwardBatch
from linrnn_serve.config import ModelConfig
from linrnn_serve.layers.linear import DenseWeights, FusedLinear, Linear
from linrnn_serve.layers.norms import PostNorm


class GatedAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt=lambda name: DenseWeights):
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.eps = cfg.rms_norm_eps
        self.scale = self.d ** -0.5
        self.qkv_proj = FusedLinear(
            cfg.hidden_size,
            [("q", self.hq * self.d * 2), ("k", self.hkv * self.d), ("v", self.hkv * self.d)],
            dtype,
            {p: fmt(f"self_attn.{p}_proj") for p in ("q", "k", "v")},
        )
        self.q_norm = nn.Parameter(torch.zeros(self.d, dtype=dtype), requires_grad=False)
        self.k_norm = nn.Parameter(torch.zeros(self.d, dtype=dtype), requires_grad=False)
        self.o_proj = Linear(self.hq * self.d, cfg.hidden_size, dtype, fmt("self_attn.o_proj"))
        # partial NeoX RoPE frequencies; cos/sin come from positions on the fly (graph-static shapes)
        rd = cfg.rotary_dim
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch, st: AttnLayerState, post: PostNorm | None = None):
        """Mixer output [T, H]; with `post`, (post-normed output, new residual), the output gate, o_proj,
        residual add and post norm fused into one kernel where the skinny GEMM takes the shape."""
        T = x.shape[0]
        qg, k, v = torch.split(self.qkv_proj(x), [self.hq * self.d * 2, self.hkv * self.d, self.hkv * self.d], -1)
        qg = qg.reshape(T, self.hq, 2 * self.d)
        q, gate = qg[..., : self.d], qg[..., self.d:]
        q = norm_ops.qk_norm_rope_write_kv(q, k.reshape(T, self.hkv, self.d), v.reshape(T, self.hkv, self.d),
                                           self.q_norm, self.k_norm, batch.positions, self.inv_freq, self.eps,
                                           st.k_cache, st.v_cache, batch.slot_mapping)
        # prefill: the output gate in the attention kernel's epilogue; decode: in the o_proj GEMV's prologue
        gate_in_attention = not batch.is_decode
        o = attn_ops.paged_attention(q, st.k_cache, st.v_cache, batch.cu_seqlens, batch.seq_lens,
                                     batch.block_tables, self.scale, gate=gate if gate_in_attention else None)
        o = o.reshape(T, self.hq * self.d)
        w = self.o_proj.weight_tensor()
        if post is not None and w is not None:
            if gate_in_attention:
                return gemv_ops.fused_linear(o, w, **post.fused_options())
            return gemv_ops.fused_linear(o, w, prologue_kind="sigmoid_gate", gate=gate, head=self.d,
                                         **post.fused_options())
        if not gate_in_attention:
            o = o * torch.sigmoid(gate.reshape(T, self.hq * self.d))
        h = self.o_proj(o)
        return h if post is None else post(h)
