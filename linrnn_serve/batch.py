"""Plain dataclasses shared by the runner, the model and the layers (bottom of the import graph).

A forward pass runs a *flattened varlen batch*: the new tokens of B sequences laid end to end
(T tokens in all). Sequence i owns tokens `cu_seqlens[i]:cu_seqlens[i+1]`; its context after this
step is `seq_lens[i]` tokens, so its new tokens sit at positions `seq_lens[i] - q_len_i ...
seq_lens[i] - 1`. Decode steps (every q_len = 1) are flagged `is_decode` so layers take the
one-token kernels, which is also the shape captured in CUDA graphs.

Padding (CUDA-graph buckets larger than the live batch) is by sentinel, not branching: padded
rows use recurrent-state slot 0 and KV block 0, both reserved dummies that no live sequence owns.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

DUMMY_STATE_SLOT = 0
DUMMY_KV_BLOCK = 0


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64, absolute position of each token
    cu_seqlens: torch.Tensor  # [B+1] int32, new-token offsets per sequence
    seq_lens: torch.Tensor  # [B] int32, context length after this step (incl. new tokens)
    state_indices: torch.Tensor  # [B] int32, recurrent-state slot per sequence (0 = dummy)
    block_tables: torch.Tensor  # [B, max_blocks] int32, KV blocks per sequence
    slot_mapping: torch.Tensor  # [T] int64, KV slot (block * block_size + offset) per token
    is_decode: bool  # every sequence has exactly one new token
    max_query_len: int  # host ints: grid sizes for prefill kernels and the naive path
    max_seq_len: int
    # token rows whose logits are wanted (default: last token of each sequence)
    logits_indices: torch.Tensor | None = None
    # the GDN layers' varlen bookkeeping (linrnn_kernels.gdn.VarlenPlan), built once per prefill forward by the
    # model on its own copy of the batch (GatedDeltaNet.with_plan): never stale under CUDA-graph capture
    gdn_plan: object | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.shape[0]

    def last_token_indices(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - 1).long()


@dataclass
class GDNLayerState:
    """One GDN layer's view of the hybrid recurrent-state pool (cache/state_pool.py).

    State orientation is [Dk, Dv] (as transformers and fla), kept everywhere:
      ssm_f32  [slots, H_f32,  Dk, Dv] float32   -- long-memory heads
      ssm_bf16 [slots, H_bf16, Dv / W, Dk, W] bfloat16  -- short-memory heads, each head's [Dk, Dv] stored
          as Dv / W column blocks (W = 64; linrnn_kernels/gdn/layout.py: a decode tile is one contiguous run)
      head_is_bf16 [Hv] int32, head_local [Hv] int32 -- natural head h lives in partition
          (bf16 if head_is_bf16[h] else f32) at index head_local[h]
      conv     [slots, K-1, conv_dim] activation dtype -- last K-1 pre-conv q/k/v inputs
    """

    ssm_f32: torch.Tensor
    ssm_bf16: torch.Tensor
    head_is_bf16: torch.Tensor
    head_local: torch.Tensor
    conv: torch.Tensor


@dataclass
class AttnLayerState:
    """One full-attention layer's paged KV: [num_blocks, block_size, kv_heads, head_dim] each."""

    k_cache: torch.Tensor
    v_cache: torch.Tensor
