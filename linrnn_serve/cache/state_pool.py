"""Hybrid per-head f32/bf16 recurrent-state pool for the GDN layers (DESIGN "Hybrid recurrent state").

Per GDN layer n:
  ssm_f32[n]  [slots, H_f32(n),  Dk, Dv] float32
  ssm_bf16[n] [slots, H_bf16(n), Dv / W, Dk, W] bfloat16 (W = 64: blocked, linrnn_kernels/gdn/layout.py)
  head_is_bf16[n], head_local[n]  [Hv] int32: natural head h -> (partition, index in partition)
  conv[n]     [slots, K-1, conv_dim] in the activation dtype
State orientation [Dk, Dv] everywhere (transformers / fla); the bf16 partition stores each head's
[Dk, Dv] as Dv / W column blocks [Dk, W], so a decode tile of W columns is one contiguous run. Slot 0
is the dummy that padded rows write to; live sequences get slots 1..max_num_seqs from a SlotAllocator.

With every head in f32 (tau threshold inf) the bf16 partitions are empty and the pool is exactly an
all-f32 pool: the same kernels run with the same inputs, so outputs are bit-identical.
"""
from __future__ import annotations

import torch

from linrnn_kernels.gdn.layout import bf16_pool_shape
from linrnn_serve.batch import GDNLayerState
from linrnn_serve.config import ModelConfig


class HybridStateCache:
    def __init__(self, cfg: ModelConfig, num_slots: int, act_dtype: torch.dtype, device,
                 bf16_heads: list[list[bool]] | None = None):
        n_gdn = len(cfg.gdn_layers)
        hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        if bf16_heads is None:
            bf16_heads = [[False] * hv for _ in range(n_gdn)]
        if len(bf16_heads) != n_gdn or any(len(m) != hv for m in bf16_heads):
            raise ValueError(f"bf16 head map must be [{n_gdn} GDN layers][{hv} heads]")
        self.num_slots = num_slots
        self.bf16_heads = [list(map(bool, m)) for m in bf16_heads]
        self.ssm_f32, self.ssm_bf16, self.head_is_bf16, self.head_local = [], [], [], []
        for m in self.bf16_heads:
            local, nf, nb = [], 0, 0
            for is_b in m:
                local.append(nb if is_b else nf)
                nb, nf = nb + is_b, nf + (not is_b)
            self.ssm_f32.append(torch.zeros(num_slots, nf, dk, dv, dtype=torch.float32, device=device))
            self.ssm_bf16.append(torch.zeros(bf16_pool_shape(num_slots, nb, dk, dv), dtype=torch.bfloat16,
                                             device=device))
            self.head_is_bf16.append(torch.tensor(m, dtype=torch.int32, device=device))
            self.head_local.append(torch.tensor(local, dtype=torch.int32, device=device))
        K = cfg.linear_conv_kernel_dim
        self.conv = torch.zeros(n_gdn, num_slots, K - 1, cfg.conv_dim, dtype=act_dtype, device=device)

    def layer(self, n: int) -> GDNLayerState:
        return GDNLayerState(self.ssm_f32[n], self.ssm_bf16[n], self.head_is_bf16[n], self.head_local[n],
                             self.conv[n])

    def reset_slots(self, slots: torch.Tensor | list[int]) -> None:
        """Zero the state of newly allocated slots (a new request starts from an empty state)."""
        idx = torch.as_tensor(slots, dtype=torch.long, device=self.conv.device)
        for t in self.ssm_f32 + self.ssm_bf16:
            t.index_fill_(0, idx, 0)
        self.conv.index_fill_(1, idx, 0)

    def copy_slot(self, src: int, dst: int) -> None:
        """Fork a sequence's state (n > 1 samples share a prompt)."""
        for t in self.ssm_f32 + self.ssm_bf16:
            t[dst].copy_(t[src])
        self.conv[:, dst].copy_(self.conv[:, src])

    @property
    def layout_key(self) -> tuple:
        """What a slot's bytes mean: the head map (which heads are bf16) and the conv dtype."""
        return (tuple(tuple(m) for m in self.bf16_heads), str(self.conv.dtype), tuple(self.conv.shape[2:]))

    def copy_to(self, dst: "HybridStateCache", src_slots: list[int] | torch.Tensor,
                dst_slots: list[int] | torch.Tensor) -> None:
        """Copy whole slots into another pool of the same layout (prefix-cache snapshot save and
        restore: bit-exact, each head in its partition's dtype). Slots as lists, or as device tensors
        (the runner's, uploaded without a host sync)."""
        if len(src_slots) == 0:
            return
        if dst.layout_key != self.layout_key:
            raise RuntimeError("state pools of different head maps / dtypes: a snapshot taken under one "
                               "ssm_bf16_tau cannot be restored under another")
        dev = self.conv.device
        si = torch.as_tensor(src_slots, dtype=torch.long, device=dev)
        di = torch.as_tensor(dst_slots, dtype=torch.long, device=dev)
        for s, d in zip(self.ssm_f32 + self.ssm_bf16, dst.ssm_f32 + dst.ssm_bf16):
            d.index_copy_(0, di, s.index_select(0, si))
        dst.conv.index_copy_(1, di, self.conv.index_select(1, si))

    def bytes_per_seq(self) -> int:
        per = sum(t[0].numel() * t.element_size() for t in self.ssm_f32 + self.ssm_bf16)
        return per + self.conv[:, 0].numel() * self.conv.element_size()

    def f32_fraction(self) -> float:
        total = sum(len(m) for m in self.bf16_heads)
        return sum(not b for m in self.bf16_heads for b in m) / max(total, 1)
