"""Paged KV cache for the full-attention layers only (GDN layers keep no KV).

kv [n_attn_layers, 2, num_blocks, block_size, kv_heads, head_dim]; block 0 is the dummy block that
padded rows write to. Global layer index -> attention-layer index lives in the model (attn_index).
"""
from __future__ import annotations

import torch

from linrnn_serve.batch import AttnLayerState
from linrnn_serve.config import ModelConfig


class PagedKVCache:
    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        self.num_blocks, self.block_size = num_blocks, block_size
        n_attn = len(cfg.attn_layers)
        self.kv = torch.zeros(n_attn, 2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim,
                              dtype=dtype, device=device)

    def layer(self, n: int) -> AttnLayerState:
        return AttnLayerState(self.kv[n, 0], self.kv[n, 1])

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        elt = torch.tensor([], dtype=dtype).element_size()
        return len(cfg.attn_layers) * 2 * block_size * cfg.num_key_value_heads * cfg.head_dim * elt
