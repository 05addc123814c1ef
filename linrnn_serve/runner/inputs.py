"""Build a ForwardBatch from per-sequence work items (host lists -> device tensors), and `to_device`, the
runner's one way to move small host tensors to the GPU without a host sync."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from linrnn_serve.batch import ForwardBatch


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor -> device, stream-ordered, without a host sync on CUDA: staged through pinned memory
    (a pageable source makes the copy wait for the whole stream). The caching host allocator keeps the
    pinned block until the copy has run."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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
    i64 = _packed([ids, pos, slots], torch.long, device)  # two uploads, not seven
    i32 = _packed([cu, lens, [w.state_slot for w in work], [b for t in tables for b in t]], torch.int32, device)
    return ForwardBatch(
        input_ids=i64[0], positions=i64[1], cu_seqlens=i32[0], seq_lens=i32[1], state_indices=i32[2],
        block_tables=i32[3].view(len(work), max_blocks), slot_mapping=i64[2],
        is_decode=all(len(w.token_ids) == 1 for w in work),
        max_query_len=max(len(w.token_ids) for w in work),
        max_seq_len=max(lens),
    )


def _packed(fields: list[list[int]], dtype: torch.dtype, device) -> list[torch.Tensor]:
    """The lists in one host tensor and one upload; each field starts 16-byte aligned (kernels specialise
    on pointer alignment)."""
    align = 16 // torch.tensor([], dtype=dtype).element_size()
    starts, flat = [], []
    for f in fields:
        starts.append(len(flat))
        flat += f
        flat += [0] * (-len(flat) % align)
    t = to_device(torch.tensor(flat, dtype=dtype), device)
    return [t[s:s + len(f)] for s, f in zip(starts, fields)]
