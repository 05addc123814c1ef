"""Sort (token, expert) pairs into expert-contiguous blocks of BLOCK_M rows for the grouped GEMM
(the job of vLLM's `moe_align_block_size`), entirely on the device with static output sizes so a
decode step can be captured in a CUDA graph.

Pair p = t * top_k + j (row-major over topk_ids [T, k]). Outputs:
  sorted_ids  [max_padded]  int32  pair ids grouped by expert, ascending within an expert, each
                                   expert's run padded to a multiple of BLOCK_M with the sentinel P
                                   (entries at and past num_padded are unspecified)
  expert_ids  [max_blocks]  int32  expert of each BLOCK_M block; -1 for blocks past num_padded
  num_padded  [1]           int32  total padded length (a multiple of BLOCK_M)
max_padded = P + min(E, P) * (BLOCK_M - 1), rounded up to BLOCK_M: at most min(E, P) experts are hit
and each wastes fewer than BLOCK_M rows.

One program per expert: each counts all experts (histogram) to get its own offset, then scans the
pairs again to place its own ones (rank = running count of earlier matches). Both passes read the
ids from L2 (P * 4 bytes each); no atomics, so the order is deterministic. That is one launch, cheap for
decode batches, but every program reads all P ids twice: at prefill sizes (P = 65536 pairs at 8192 tokens x top-8)
it took 143 us per layer on the H200. From CHUNKED_MIN_PAIRS pairs the same outputs come from three launches
over chunks of the pairs (`_align_count_kernel` per-chunk histograms -> `_align_scan_kernel` one program: expert
offsets, per-(chunk, expert) destinations, the padding sentinels -> `_align_place_kernel` per chunk: a sort of
(expert, position) keys gives each pair its rank among the chunk's pairs of its expert, plus the expert_ids of a
share of the blocks): every id is read twice in all, the order is the same (ascending pairs per expert).

Pair blocks (`moe_pair_blocks`, decode batches of T <= BLOCK_M tokens with distinct experts per token, as
top-k gives): the same three outputs, but block b is pair b and token n sits in slot n: sorted_ids[b * BLOCK_M
+ n] = token n's pair with expert ids[b] (or the sentinel P), expert_ids[b] = ids[b] for the first pair of its
expert (no earlier token routes to it), else -1 (the block is skipped), num_padded = P * BLOCK_M. No histogram,
cumsum or ranks: a [P, T, k] comparison in registers, cheap enough for the fused router's serial tail. A GEMM
over expert blocks gives every token the same result in either form (its MMA column sees the same rows).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from linrnn_kernels.gemv.skinny import gdc_launch_dependents, gdc_wait


def max_padded_pairs(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the padded pair count (a multiple of block_m)."""
    bound = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return triton.cdiv(bound, block_m) * block_m


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, E, max_blocks,
                  BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr,
                  ONE_PASS: tl.constexpr = False):
    """ONE_PASS (P <= BLOCK_P): the ids are read once and kept in registers for both passes (one L2 round trip
    instead of two); else pass 1 and pass 2 each loop over BLOCK_P-pair chunks."""
    if PDL:  # launched with PDL: the ids' writer first, then the next kernel may launch (it waits for this one)
        gdc_wait()
        gdc_launch_dependents()
    e = tl.program_id(0)
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    # pass 1: per-expert pair counts (ids outside [0, E) are ignored)
    if ONE_PASS:
        ids_all = tl.load(ids_ptr + offs_p, mask=offs_p < P, other=-1).to(tl.int32)
        ok = (ids_all >= 0) & (ids_all < E)
        counts = tl.histogram(tl.where(ok, ids_all, 0), BLOCK_E, mask=ok)
    else:
        counts = tl.zeros((BLOCK_E,), tl.int32)
        for start in range(0, P, BLOCK_P):
            ids = tl.load(ids_ptr + start + offs_p, mask=start + offs_p < P, other=-1).to(tl.int32)
            ok = (ids >= 0) & (ids < E)
            counts += tl.histogram(tl.where(ok, ids, 0), BLOCK_E, mask=ok)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    start_e = tl.sum(tl.where(offs_e == e, ends - padded, 0), axis=0)
    count_e = tl.sum(tl.where(offs_e == e, counts, 0), axis=0)
    padded_e = tl.sum(tl.where(offs_e == e, padded, 0), axis=0)

    # pass 2: this expert's pairs, in ascending pair order
    if ONE_PASS:
        hit = ids_all == e
        rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
        tl.store(sorted_ptr + start_e + rank, offs_p, mask=hit)
    else:
        placed = 0
        for start in range(0, P, BLOCK_P):
            pair = start + offs_p
            ids = tl.load(ids_ptr + pair, mask=pair < P, other=-1).to(tl.int32)
            hit = ids == e
            rank = tl.cumsum(hit.to(tl.int32), axis=0) - 1
            tl.store(sorted_ptr + start_e + placed + rank, pair, mask=hit)
            placed += tl.sum(hit.to(tl.int32), axis=0)
    offs_m = tl.arange(0, BLOCK_M)
    pad = start_e + count_e + offs_m
    tl.store(sorted_ptr + pad, tl.zeros((BLOCK_M,), tl.int32) + P, mask=pad < start_e + padded_e)
    first_block = start_e // BLOCK_M
    for b in range(0, padded_e // BLOCK_M, BLOCK_M):
        blk = b + offs_m
        tl.store(expert_ids_ptr + first_block + blk, tl.zeros((BLOCK_M,), tl.int32) + e,
                 mask=blk < padded_e // BLOCK_M)
    if e == 0:
        tl.store(num_padded_ptr, total)
        for b in range(total // BLOCK_M, max_blocks, BLOCK_M):
            blk = b + offs_m
            tl.store(expert_ids_ptr + blk, tl.full((BLOCK_M,), -1, tl.int32), mask=blk < max_blocks)


# Up to this many pairs each program of the one-launch kernel keeps all the ids in registers (one read, not two;
# 2048 pairs = B = 256 at top-8: 8 per thread at 8 warps)
ONE_PASS_MAX_PAIRS = 2048

# From this many pairs the chunked alignment runs (three launches, each id read twice in all) instead of the
# one-launch kernel whose E programs each read all the ids twice
CHUNKED_MIN_PAIRS = 4096
_CHUNK_MIN, _CHUNK_MAX = 1024, 4096   # pairs per chunk (the place kernel sorts one chunk's keys)
_SCAN_MAX = 16384                     # the scan program's [chunks, experts] tile, elements


@triton.jit
def _align_count_kernel(ids_ptr, counts_ptr, P, E, CHUNK: tl.constexpr, BLOCK_E: tl.constexpr):
    """counts[c, e] = number of pairs of chunk c routed to expert e (ids outside [0, E) are ignored)."""
    c = tl.program_id(0)
    pair = c * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + pair, mask=pair < P, other=-1).to(tl.int32)
    ok = (ids >= 0) & (ids < E)
    counts = tl.histogram(tl.where(ok, ids, 0), BLOCK_E, mask=ok)
    tl.store(counts_ptr + c * BLOCK_E + tl.arange(0, BLOCK_E), counts)


@triton.jit
def _align_scan_kernel(counts_ptr, base_ptr, ends_ptr, sorted_ptr, num_padded_ptr, NC, P,
                       BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_E: tl.constexpr, PAD_M: tl.constexpr):
    """One program: expert e's run starts at start[e] (padded runs in expert order); chunk c's pairs of expert e
    go to start[e] + (their count in earlier chunks) + rank, stored as base[c, e] = start[e] + earlier[c, e]
    - below[c, e] (below: chunk c's pairs of smaller experts, i.e. the first sorted position of e in the chunk).
    Also: ends[e] (for expert_ids), the padding sentinels, num_padded."""
    offs_c = tl.arange(0, BLOCK_C)
    offs_e = tl.arange(0, BLOCK_E)
    tile = offs_c[:, None] * BLOCK_E + offs_e[None, :]
    cnt = tl.load(counts_ptr + tile, mask=(offs_c < NC)[:, None], other=0)
    count = tl.sum(cnt, axis=0)
    padded = (count + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, axis=0)
    start = ends - padded
    earlier = tl.cumsum(cnt, axis=0) - cnt
    below = tl.cumsum(cnt, axis=1) - cnt
    tl.store(base_ptr + tile, start[None, :] + earlier - below, mask=(offs_c < NC)[:, None])
    tl.store(ends_ptr + offs_e, ends)
    tl.store(num_padded_ptr, tl.sum(padded, axis=0))
    for m0 in tl.static_range(0, BLOCK_M, PAD_M):  # [E, PAD_M] at a time (block_m up to 256)
        pad = (start + count + m0)[:, None] + tl.arange(0, PAD_M)[None, :]
        tl.store(sorted_ptr + pad, tl.zeros((BLOCK_E, PAD_M), tl.int32) + P, mask=pad < ends[:, None])


@triton.jit
def _align_place_kernel(ids_ptr, base_ptr, ends_ptr, sorted_ptr, expert_ids_ptr, P, E, max_blocks, blocks_per_prog,
                        CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_B: tl.constexpr):
    """Chunk c's pairs to their places (keys expert * CHUNK + position sorted: a pair's sorted position minus its
    expert's first one is its rank), and expert_ids of blocks [c * blocks_per_prog, (c + 1) * blocks_per_prog)."""
    c = tl.program_id(0)
    offs = tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + c * CHUNK + offs, mask=c * CHUNK + offs < P, other=-1).to(tl.int32)
    ok = (ids >= 0) & (ids < E)
    key = tl.sort(tl.where(ok, ids, BLOCK_E) * CHUNK + offs)  # ignored ids (and the tail) sort last
    e = key // CHUNK
    valid = e < E
    dest = tl.load(base_ptr + c * BLOCK_E + e, mask=valid, other=0) + offs
    tl.store(sorted_ptr + dest, c * CHUNK + key % CHUNK, mask=valid)

    offs_e = tl.arange(0, BLOCK_E)
    ends = tl.load(ends_ptr + offs_e)
    total = tl.max(ends, axis=0)
    lo = c * blocks_per_prog
    hi = tl.minimum(lo + blocks_per_prog, max_blocks)
    for b0 in range(lo, hi, BLOCK_B):
        blk = b0 + tl.arange(0, BLOCK_B)
        # the block's expert: the number of experts whose padded run ends at or before its first row
        ex = tl.sum((ends[None, :] <= blk[:, None] * BLOCK_M).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.where(blk * BLOCK_M < total, ex, -1), mask=blk < hi)


def _chunk_size(num_pairs: int, num_experts: int) -> int | None:
    """Pairs per chunk of the chunked alignment, or None where it does not apply (small P, or a scan tile
    [chunks, experts] too large for one program)."""
    if num_pairs < CHUNKED_MIN_PAIRS:
        return None
    block_e = triton.next_power_of_2(num_experts)
    max_chunks = max(1, _SCAN_MAX // block_e)
    chunk = max(_CHUNK_MIN, triton.next_power_of_2(triton.cdiv(num_pairs, max_chunks)))
    return chunk if chunk <= _CHUNK_MAX else None


def moe_align_block_size(topk_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool | None = None):
    """(sorted_ids, expert_ids, num_padded) for topk_ids [T, k]; see the module docstring. pdl: the one-launch
    kernel launched with programmatic dependent launch (default: router.chain_pdl())."""
    from linrnn_kernels.moe.router import chain_pdl_kwargs

    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    if num_experts > 4096:
        raise ValueError(f"align kernel keeps per-expert counts in registers; num_experts={num_experts} > 4096")
    ids = topk_ids.contiguous().view(-1)
    P = ids.numel()
    max_padded = max_padded_pairs(P, num_experts, block_m)
    max_blocks = max_padded // block_m
    dev = topk_ids.device
    sorted_ids = torch.empty(max(max_padded, 1), dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    block_e = triton.next_power_of_2(num_experts)
    chunk = _chunk_size(P, num_experts)
    if chunk is None:
        one_pass = P <= ONE_PASS_MAX_PAIRS
        block_p = max(16, triton.next_power_of_2(P)) if one_pass else 1024
        _align_kernel[(num_experts,)](
            ids, sorted_ids, expert_ids, num_padded, P, num_experts, max_blocks,
            BLOCK_M=block_m, BLOCK_E=block_e, BLOCK_P=block_p, ONE_PASS=one_pass, num_warps=4 if block_p <= 1024 else 8,
            **chain_pdl_kwargs(topk_ids, pdl))
        return sorted_ids, expert_ids, num_padded
    nc = triton.cdiv(P, chunk)
    counts = torch.empty(nc, block_e, dtype=torch.int32, device=dev)
    base = torch.empty(nc, block_e, dtype=torch.int32, device=dev)
    ends = torch.empty(block_e, dtype=torch.int32, device=dev)
    _align_count_kernel[(nc,)](ids, counts, P, num_experts, CHUNK=chunk, BLOCK_E=block_e, num_warps=4)
    _align_scan_kernel[(1,)](counts, base, ends, sorted_ids, num_padded, nc, P, BLOCK_M=block_m,
                             BLOCK_C=triton.next_power_of_2(nc), BLOCK_E=block_e, PAD_M=min(block_m, 64), num_warps=8)
    _align_place_kernel[(nc,)](ids, base, ends, sorted_ids, expert_ids, P, num_experts, max_blocks,
                               triton.cdiv(max_blocks, nc), CHUNK=chunk, BLOCK_M=block_m, BLOCK_E=block_e,
                               BLOCK_B=32, num_warps=4)
    return sorted_ids, expert_ids, num_padded


@triton.jit
def pair_blocks_tile(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    """Pair blocks (module docstring) of ids [M <= BLOCK_M, TOP_K] in one program; shared with the fused router."""
    P = M * TOP_K
    b = tl.arange(0, BLOCK_P)
    b_ok = b < P
    e = tl.load(ids_ptr + b, mask=b_ok, other=-1)
    n = tl.arange(0, BLOCK_M)
    j = tl.arange(0, BLOCK_K)
    nj_ok = (n < M)[:, None] & (j < TOP_K)[None, :]
    pair_nj = n[:, None] * TOP_K + j[None, :]
    ids_nj = tl.load(ids_ptr + pair_nj, mask=nj_ok, other=-1)
    hit = (ids_nj[None, :, :] == e[:, None, None]) & nj_ok[None, :, :]  # [blocks, token slots, k]
    found = tl.max(hit.to(tl.int32), axis=2)
    pairs = tl.where(found > 0, tl.sum(tl.where(hit, pair_nj[None, :, :], 0), axis=2), P)
    earlier = tl.sum(tl.where(n[None, :] < (b // TOP_K)[:, None], found, 0), axis=1)
    tl.store(expert_ids_ptr + b, tl.where(earlier == 0, e, -1), mask=b_ok)
    tl.store(sorted_ptr + b[:, None] * BLOCK_M + n[None, :], pairs, mask=b_ok[:, None])
    tl.store(num_padded_ptr, P * BLOCK_M)


@triton.jit
def _pair_blocks_kernel(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
    pair_blocks_tile(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K, BLOCK_P, BLOCK_K, BLOCK_M)


MAX_PAIR_BLOCK_TOKENS = 16


def moe_pair_blocks(topk_ids: torch.Tensor, block_m: int):
    """(sorted_ids [P * block_m], expert_ids [P], num_padded [1]) as pair blocks (module docstring) for
    topk_ids [T <= block_m, k] with distinct ids per token (a top-k's output; not expert-parallel local ids)."""
    if topk_ids.dim() != 2:
        raise ValueError(f"topk_ids must be [T, k], got shape {tuple(topk_ids.shape)}")
    T, k = topk_ids.shape
    if not 1 <= T <= block_m <= MAX_PAIR_BLOCK_TOKENS or block_m & (block_m - 1):
        raise ValueError(f"pair blocks: {T} tokens in blocks of {block_m} (a power of two <= {MAX_PAIR_BLOCK_TOKENS})")
    ids = topk_ids.to(torch.int32).contiguous()
    P = T * k
    dev = topk_ids.device
    sorted_ids = torch.empty(P * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(P, dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    _pair_blocks_kernel[(1,)](ids, sorted_ids, expert_ids, num_padded, T, TOP_K=k,
                              BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_K=triton.next_power_of_2(k),
                              BLOCK_M=block_m, num_warps=4)
    return sorted_ids, expert_ids, num_padded
