"""Drive a few sequences through the model directly, without the scheduler.

Used by tests (prefill then decode from carried state), perplexity and the KL gate. The engine's
ModelRunner does the same through its scheduler, with CUDA graphs for decode.
"""
from __future__ import annotations

import torch

from linrnn_serve.cache import BlockAllocator, HybridStateCache, ModelCaches, PagedKVCache, SlotAllocator
from linrnn_serve.runner.inputs import SeqWork, build_forward_batch


class Session:
    def __init__(self, model, max_seqs: int, max_len: int, block_size: int = 16,
                 bf16_heads: list[list[bool]] | None = None):
        self.model, self.block_size = model, block_size
        cfg = getattr(model, "local_cfg", model.cfg)  # a tensor-parallel shard's caches hold its heads
        device = next(model.parameters()).device
        self.device = device
        blocks_per_seq = -(-max_len // block_size)
        self.caches = ModelCaches(
            HybridStateCache(cfg, max_seqs + 1, model.dtype, device, bf16_heads),
            PagedKVCache(cfg, max_seqs * blocks_per_seq + 1, block_size, model.dtype, device),
        )
        self.slots = SlotAllocator(max_seqs + 1)
        self.blocks = BlockAllocator(max_seqs * blocks_per_seq + 1)
        self.seqs: dict[int, dict] = {}
        self._next = 0

    def new_seq(self) -> int:
        slot = self.slots.alloc()
        if slot is None:
            raise RuntimeError("no free state slot")
        self.caches.state.reset_slots([slot])
        sid, self._next = self._next, self._next + 1
        self.seqs[sid] = {"slot": slot, "blocks": [], "len": 0}
        return sid

    def free(self, sid: int) -> None:
        s = self.seqs.pop(sid)
        self.slots.free(s["slot"])
        self.blocks.free(s["blocks"])

    @torch.inference_mode()
    def forward(self, sids: list[int], tokens: list[list[int]], all_logits: bool = False,
                rows: list[int] | None = None) -> torch.Tensor:
        """Append tokens[i] to sequence sids[i]; logits of each sequence's last token [B, V], of every
        new token [T, V] with all_logits, or of the given flattened token rows."""
        work = []
        for sid, toks in zip(sids, tokens):
            s = self.seqs[sid]
            need = -(-(s["len"] + len(toks)) // self.block_size) - len(s["blocks"])
            if need > 0:
                new = self.blocks.alloc(need)
                if new is None:
                    raise RuntimeError("out of KV blocks")
                s["blocks"] += new
            work.append(SeqWork(list(toks), s["len"], s["slot"], s["blocks"]))
            s["len"] += len(toks)
        batch = build_forward_batch(work, self.block_size, self.device)
        if rows is not None:
            batch.logits_indices = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model(batch, self.caches, all_logits=all_logits and rows is None)
