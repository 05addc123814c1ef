"""Qwen3.5-MoE / Qwen3-Next text decoder (SPEC §1.3).

    h = Embed(ids)
    for each layer: h += Mixer(ZC-RMSNorm(h))   # GatedDeltaNet or GatedAttention
                    h += MoE(ZC-RMSNorm(h))     # or a dense MLP on Qwen3-Next's mlp_only layers
    logits = lm_head(ZC-RMSNorm(h))             # untied

Each residual add + norm runs after the sublayer that produces its input (PostNorm), so a sublayer's
last projection can fuse it (decode-sized batches: one kernel for the projection, the add and the
norm; kernels/gemv).

The forward runs one flattened varlen batch (linrnn_serve/batch.py) against the caches' per-layer
views; the same code serves prefill, chunked prefill and decode, on CPU (reference ops) and GPU.

Tensor / expert parallel (linrnn_serve/parallel.py): built with a `Shard`, the layers are those of
`local_config(cfg, shard)` (this rank's heads, intermediate slices, experts, vocab rows); each
mixer and MLP output is a partial sum, all-reduced once per sublayer here; the embedding is
vocab-parallel (all-reduce) and the lm_head too (all-gather: every rank gets full logits rows).
`self.cfg` stays the whole model's config, `self.local_cfg` is the slice's.
"""
from __future__ import annotations

import torch
from torch import nn

from linrnn_serve.batch import ForwardBatch
from linrnn_serve.config import ModelConfig
from linrnn_serve.layers.attention import GatedAttention
from linrnn_serve.layers.gdn import GatedDeltaNet
from linrnn_serve.layers.linear import DenseWeights, Linear
from linrnn_serve.layers.moe import MLP, SparseMoE
from linrnn_serve.layers.norms import PostNorm, ZCRMSNorm
from linrnn_serve.parallel import SINGLE, Shard, expert_shard, local_config


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, dtype: torch.dtype, quant, shard: Shard = SINGLE, experts=None):
        """`cfg` is this rank's local config; `experts` the ExpertShard of its routed experts."""
        super().__init__()
        self.shard = shard
        # storage format of each HF module of this layer (dense unless the checkpoint quantizes it)
        fmt = (lambda name: quant.format_of(f"model.layers.{i}.{name}")) if quant else (lambda name: DenseWeights)
        self.is_gdn = cfg.layer_types[i] == "linear_attention"
        self.input_layernorm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        if self.is_gdn:
            self.linear_attn = GatedDeltaNet(cfg, dtype, fmt)
        else:
            self.self_attn = GatedAttention(cfg, dtype, fmt)
        if cfg.is_moe_layer(i):
            self.mlp = SparseMoE(cfg, dtype, fmt, experts)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, dtype, fmt)

    def forward(self, x, residual, batch: ForwardBatch, st, next_norm: ZCRMSNorm):
        """x: this layer's normed input (its input_layernorm already applied); returns the next layer's
        normed input and the residual stream. Each norm is fused with the preceding residual add, and
        with the sublayer's last projection where the kernels allow (layers/norms.py::PostNorm)."""
        mixer = self.linear_attn if self.is_gdn else self.self_attn
        if self.shard.parallel:
            # partial sums per rank: all-reduced before the residual add + norm, so nothing fuses them
            h = self.shard.all_reduce(mixer(x, batch, st))
            x, residual = self.post_attention_layernorm(h, residual)
            return next_norm(self.shard.all_reduce(self.mlp(x)), residual)
        x, residual = mixer(x, batch, st, post=PostNorm(self.post_attention_layernorm, residual))
        return self.mlp(x, post=PostNorm(next_norm, residual))


class HybridMoEForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, quant=None, shard: Shard = SINGLE):
        super().__init__()
        self.cfg, self.dtype, self.shard = cfg, dtype, shard
        self.local_cfg = lc = local_config(cfg, shard)
        self.vocab_start = shard.rank * lc.vocab_size
        self.embed_tokens = nn.Parameter(torch.empty(lc.vocab_size, cfg.hidden_size, dtype=dtype),
                                         requires_grad=False)
        experts = expert_shard(cfg, shard)
        self.layers = nn.ModuleList(DecoderLayer(lc, i, dtype, quant, shard, experts)
                                    for i in range(cfg.num_hidden_layers))
        self.norm = ZCRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, lc.vocab_size, dtype,
                              quant.format_of("lm_head") if quant else DenseWeights)
        # global layer index -> index into the GDN state pool / the paged KV cache
        self.gdn_index = {li: n for n, li in enumerate(cfg.gdn_layers)}
        self.attn_index = {li: n for n, li in enumerate(cfg.attn_layers)}

    def forward(self, batch: ForwardBatch, caches, all_logits: bool = False) -> torch.Tensor:
        """Logits [B, V] for each sequence's last token (or [T, V] for every token if all_logits,
        or the rows in batch.logits_indices)."""
        h = self.hidden_states(batch, caches)
        if all_logits:
            idx = None
        elif batch.logits_indices is not None:
            idx = batch.logits_indices
        else:
            idx = batch.last_token_indices()
        if idx is not None:
            h = h.index_select(0, idx)
        logits = self.lm_head(h)
        return self.shard.comm.all_gather_last(logits) if self.shard.parallel else logits

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        if not self.shard.parallel:
            return self.embed_tokens[ids]
        local = ids - self.vocab_start
        mine = (local >= 0) & (local < self.local_cfg.vocab_size)
        e = self.embed_tokens[torch.where(mine, local, 0)]
        return self.shard.all_reduce(torch.where(mine[:, None], e, torch.zeros((), dtype=e.dtype, device=e.device)))

    def hidden_states(self, batch: ForwardBatch, caches) -> torch.Tensor:
        """Final-normed hidden states [T, H]."""
        if self.gdn_index:
            batch = GatedDeltaNet.with_plan(batch)
        x, residual = self.layers[0].input_layernorm(self.embed(batch.input_ids), None)
        for i, layer in enumerate(self.layers):
            st = caches.gdn_layer(self.gdn_index[i]) if layer.is_gdn else caches.attn_layer(self.attn_index[i])
            next_norm = self.layers[i + 1].input_layernorm if i + 1 < len(self.layers) else self.norm
            x, residual = layer(x, residual, batch, st, next_norm)
        return x


__all__ = ["HybridMoEForCausalLM", "DecoderLayer"]
