"""Triton paged attention entry point: picks the decode or the varlen prefill kernel from shapes."""
from __future__ import annotations

import torch

from linrnn_kernels.attention.common import LaunchConfig, check_gate
from linrnn_kernels.attention.decode import decode_attention
from linrnn_kernels.attention.prefill import prefill_attention


def paged_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, *,
                    prefill_config: LaunchConfig | None = None, decode_config: LaunchConfig | None = None,
                    num_splits: int | None = None, out: torch.Tensor | None = None,
                    gate: torch.Tensor | None = None) -> torch.Tensor:
    """Same contract as naive.paged_attention (q [T, Hq, D] -> o [T, Hq, D] in q.dtype, times sigmoid(gate)
    when a gate is given: in the prefill kernel's epilogue; after the decode kernel in torch, since decode
    batches fuse the gate into the output projection's GEMV instead, layers/attention.py).

    T == B (one row per sequence) takes the split-K decode kernel. The choice reads shapes only
    (no host sync), so it assumes what the runner guarantees: every sequence has >= 1 new token,
    hence T == B means one token each. `out` (optional, [T, Hq, D]) receives the result.
    """
    if q.dim() == 3 and q.shape[0] == seq_lens.shape[0]:
        check_gate(gate, q)
        o = decode_attention(q, k_cache, v_cache, seq_lens, block_tables, scale, config=decode_config,
                             num_splits=num_splits, cu_seqlens=cu_seqlens, out=out)
        return o if gate is None else o.mul_(torch.sigmoid(gate.float()))
    return prefill_attention(q, k_cache, v_cache, cu_seqlens, seq_lens, block_tables, scale, config=prefill_config,
                             out=out, gate=gate)
