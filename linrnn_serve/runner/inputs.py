"""Build a ForwardBatch from per-sequence work items (host lists -> device tensors)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from linrnn_serve.batch import ForwardBatch


@dataclass
class SeqWork:
    """New tokens of one sequence for one forward pass."""

    token_ids: list[int]  # tokens to run now
    start_pos: int  # position of token_ids[0] (= tokens already in the caches)
    state_slot: int
    block_table: list[int]


def build_forward_batch(work: list[SeqWork], block_size: int, device, all_logits_rows: bool = False) -> ForwardBatch:
    ids, pos, slots, cu, lens = [], [], [], [0], []
    for w in work:
        n = len(w.token_ids)
        if (w.start_pos + n + block_size - 1) // block_size > len(w.block_table):
            raise ValueError(f"block table of {len(w.block_table)} blocks cannot hold {w.start_pos + n} tokens")
        ids += w.token_ids
        p = range(w.start_pos, w.start_pos + n)
        pos += p
        slots += [w.block_table[q // block_size] * block_size + q % block_size for q in p]
        cu.append(cu[-1] + n)
        lens.append(w.start_pos + n)
    max_blocks = max(1, max(len(w.block_table) for w in work))
    tables = [w.block_table + [0] * (max_blocks - len(w.block_table)) for w in work]
    i32 = dict(dtype=torch.int32, device=device)
    return ForwardBatch(
        input_ids=torch.tensor(ids, dtype=torch.long, device=device),
        positions=torch.tensor(pos, dtype=torch.long, device=device),
        cu_seqlens=torch.tensor(cu, **i32),
        seq_lens=torch.tensor(lens, **i32),
        state_indices=torch.tensor([w.state_slot for w in work], **i32),
        block_tables=torch.tensor(tables, **i32),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        is_decode=all(len(w.token_ids) == 1 for w in work),
        max_query_len=max(len(w.token_ids) for w in work),
        max_seq_len=max(lens),
    )
