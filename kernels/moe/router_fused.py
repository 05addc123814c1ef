"""The whole router of a decode-sized batch in one launch: gate GEMM (router rows, plus the shared
expert's gate row when the model has one) -> f32 softmax over the experts -> top-k -> optional
renormalisation -> expert alignment in align.py's output contract; optionally, in the same launch,
the shared expert's gate_up projection with SiLU*mul (it reads the same x).

Its naive composition (`naive_route_align`): logits = x W^T rounded to the activation dtype;
naive.route on logits[:, :E]; the top-k weights cast to the activation dtype (as the layer does
before the experts); naive.moe_align_block_size on the ids.

Grid (N tiles, K splits) as the skinny GEMM (kernels/gemv/skinny.py: same tiles, fixed-order split-K
reduction through tickets); the last N tile to finish (a second ticket) routes every row and aligns
the pairs in one program, with no atomics on data, so the output is deterministic:
  counts per expert (histogram) -> padded run starts (cumsum) -> sorted_ids filled with the sentinel
  P = M * k -> each pair p placed at start[e_p] + #{q < p : e_q = e_p} -> expert_ids of every block.
The per-expert starts go through a small scratch buffer (a gather by expert id).
pair_blocks (M <= block_m; what the MMA expert kernel takes at decode batches of <= 8 tokens): align.py's
pair blocks instead, one [P, M, k] comparison in registers after the top-k (no histogram, cumsum, ranks or
fills, one global round trip): a shorter serial tail. H200, 35B layer in the engine at 7d0ac74, the router's
tail with the expert-sorted alignment: 8.1 / 13 us per call at 1 / 8 rows (the GEMM part ~2 us).
A single token's pair blocks need no comparison at all (block b = pair b, expert_ids = the ids).

RouterTail (per M from tuned.json's router "tail", kernels/gemv/config.router_tail; the outputs are the same
bytes either way): replicate: the logits tile gets one row per warp (rows copied), so its reductions stay in a
warp (a single [1, 256] row otherwise spreads over all 4 warps: ~10 reductions through shared memory);
reg_align: pair blocks from the ids in registers (no store + barrier + reload); logit_keys: the top-k on 32-bit
keys of the 16-bit logits (router.logit_topk) instead of 64-bit keys of the probabilities. H200, the router
alone at 35B shapes, PDL off (benchmarks/results/small_round6/): 6.1 -> 4.4 us at 1 row (replicate + keys + the single-token pair blocks),
6.9 -> 5.9 at 2 rows and 8.5 -> 7.5 at 4 (reg_align + keys); 10.2 at 8 rows either way (the tail is not the
long pole there).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import triton
import triton.language as tl

from linrnn_kernels.gemv.config import SkinnyConfig, pdl_launch_kwargs
from linrnn_kernels.gemv.skinny import (
    TICKETS,
    _gemm_tile,
    _round,
    _skinny_program,
    _split_reduce,
    gdc_launch_dependents,
    gdc_wait,
    pipeline_stages,
    tickets,
)
from linrnn_kernels.moe.align import MAX_PAIR_BLOCK_TOKENS, max_padded_pairs, pair_blocks_tile
from linrnn_kernels.moe.router import logit_topk, softmax_topk

MAX_PAIRS = 512  # rows x top_k routed in the single finishing program


@triton.jit
def _route_rows(lg_ptr, slg, w_ptr, ids_ptr, ids2_ptr, M, E, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                ROUTE_M: tl.constexpr, REPLICAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                LOGIT_KEYS: tl.constexpr, IDS_TWICE: tl.constexpr):
    """Route rows [0, M) of the logits; returns (top_i [REPLICAS * ROUTE_M, BLOCK_K], row_ok). REPLICAS > 1:
    every row is loaded and routed REPLICAS times (rows r and r + ROUTE_M are copies), so the tile has at least
    one row per warp and its reductions stay inside a warp (a [1, 256] row spreads over every warp: each of its
    ~10 reductions then goes through shared memory with two CTA barriers); only the first copy stores.
    IDS_TWICE: the ids are also stored to ids2_ptr."""
    r = tl.arange(0, REPLICAS * ROUTE_M)
    rows = r % ROUTE_M
    m_ok = rows < M
    col = tl.arange(0, BLOCK_E)
    logits = tl.load(lg_ptr + rows[:, None] * slg + col[None, :], mask=m_ok[:, None] & (col < E)[None, :],
                     other=float("-inf"), cache_modifier=".cg").to(tl.float32)
    ACT: tl.constexpr = lg_ptr.dtype.element_ty
    if LOGIT_KEYS and ACT.primitive_bitwidth == 16:
        top_w, top_i, slot = logit_topk(logits, m_ok, col, ACT, TOP_K, RENORMALIZE, BLOCK_K)
    else:
        top_w, top_i, slot = softmax_topk(logits, m_ok, col, TOP_K, RENORMALIZE, BLOCK_K)
    out = r[:, None] * TOP_K + slot[None, :]
    omask = (r < M)[:, None] & (slot < TOP_K)[None, :]
    tl.store(w_ptr + out, top_w.to(w_ptr.dtype.element_ty), mask=omask)
    tl.store(ids_ptr + out, top_i, mask=omask)
    if IDS_TWICE:  # the ids also to ids2_ptr (a single token's pair blocks: its expert_ids)
        tl.store(ids2_ptr + out, top_i, mask=omask)
    return top_i, m_ok


@triton.jit
def _pair_blocks_regs(top_i, m_ok, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K: tl.constexpr,
                      ROUTE_M: tl.constexpr, REPLICAS: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_M_ALIGN: tl.constexpr):
    """align.pair_blocks_tile's output from the routed ids still in registers (no store / reload of the ids):
    blocks b = n * BLOCK_K + j (token n's j-th pair, pair index n * TOP_K + j), tokens n < ROUTE_M."""
    P = M * TOP_K
    j = tl.arange(0, BLOCK_K)
    ids = tl.where(m_ok[:, None] & (j < TOP_K)[None, :], top_i, -1)
    if REPLICAS > 1:  # the copies are equal: any one of them
        ids = tl.max(tl.reshape(ids, [REPLICAS, ROUTE_M, BLOCK_K]), axis=0)
    n = tl.arange(0, ROUTE_M)
    nj_ok = ids >= 0
    pair_nj = n[:, None] * TOP_K + j[None, :]
    e = tl.reshape(ids, [ROUTE_M * BLOCK_K])
    b_pair = tl.reshape(pair_nj, [ROUTE_M * BLOCK_K])
    b_tok = tl.arange(0, ROUTE_M * BLOCK_K) // BLOCK_K
    b_ok = e >= 0
    hit = (ids[None, :, :] == e[:, None, None]) & nj_ok[None, :, :]  # [blocks, token slots, k]
    found = tl.max(hit.to(tl.int32), axis=2)
    pairs = tl.where(found > 0, tl.sum(tl.where(hit, pair_nj[None, :, :], 0), axis=2), P)
    earlier = tl.sum(tl.where(n[None, :] < b_tok[:, None], found, 0), axis=1)
    tl.store(expert_ids_ptr + b_pair, tl.where(earlier == 0, e, -1), mask=b_ok)
    tl.store(sorted_ptr + b_pair[:, None] * BLOCK_M_ALIGN + n[None, :], pairs, mask=b_ok[:, None])
    if ROUTE_M < BLOCK_M_ALIGN:  # token slots past the tile: the sentinel
        s = tl.arange(0, BLOCK_M_ALIGN)
        tl.store(sorted_ptr + b_pair[:, None] * BLOCK_M_ALIGN + s[None, :], tl.zeros_like(s)[None, :] + P,
                 mask=b_ok[:, None] & (s >= ROUTE_M)[None, :])
    tl.store(num_padded_ptr, P * BLOCK_M_ALIGN)


@triton.jit
def _align_pairs(ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, P, E, max_blocks,
                 BLOCK_M_ALIGN: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr):
    offs_e = tl.arange(0, BLOCK_E)
    offs_p = tl.arange(0, BLOCK_P)
    p_ok = offs_p < P
    ids = tl.load(ids_ptr + offs_p, mask=p_ok, other=-1)
    counts = tl.histogram(tl.where(p_ok, ids, 0), BLOCK_E, mask=p_ok)
    padded = (counts + BLOCK_M_ALIGN - 1) // BLOCK_M_ALIGN * BLOCK_M_ALIGN
    ends = tl.cumsum(padded, axis=0)
    total = tl.sum(padded, axis=0)
    tl.store(starts_ptr + offs_e, ends - padded, mask=offs_e < E)
    tl.debug_barrier()
    # sentinel everywhere in the used range, then the pairs on top (CTA barrier between)
    for s0 in range(0, total, BLOCK_P):
        s = s0 + offs_p
        tl.store(sorted_ptr + s, tl.zeros((BLOCK_P,), tl.int32) + P, mask=s < total)
    tl.debug_barrier()
    # rank of each pair among the earlier pairs of its expert, BLOCK_B pairs at a time
    offs_c = tl.arange(0, BLOCK_B)
    for c0 in range(0, P, BLOCK_B):
        pc = c0 + offs_c
        c_ok = pc < P
        ids_c = tl.load(ids_ptr + pc, mask=c_ok, other=-1)
        earlier = (ids[None, :] == ids_c[:, None]) & (offs_p[None, :] < pc[:, None])
        rank = tl.sum(earlier.to(tl.int32), axis=1)
        start = tl.load(starts_ptr + tl.where(c_ok, ids_c, 0), mask=c_ok, other=0)
        tl.store(sorted_ptr + start + rank, pc, mask=c_ok)
    offs_b = tl.arange(0, BLOCK_B)
    for b0 in range(0, max_blocks, BLOCK_B):
        blk = b0 + offs_b
        pos = blk * BLOCK_M_ALIGN
        e = tl.sum(((ends[None, :] <= pos[:, None]) & (offs_e < E)[None, :]).to(tl.int32), axis=1)
        tl.store(expert_ids_ptr + blk, tl.where(pos < total, e, -1), mask=blk < max_blocks)
    tl.store(num_padded_ptr, total)


@triton.jit
def _route_align_tail(lg_ptr, slg, tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, E,
                      max_blocks, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, ROUTE_M: tl.constexpr,
                      REPLICAS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr,
                      BLOCK_M_ALIGN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr,
                      PAIR_BLOCKS: tl.constexpr, REG_ALIGN: tl.constexpr, LOGIT_KEYS: tl.constexpr):
    """Routing of the logits, then the routed pairs' alignment: align.py's pair blocks (from the ids in
    registers with REG_ALIGN, else reloaded) or its expert-sorted blocks."""
    if PAIR_BLOCKS and ROUTE_M == 1:
        # one token: block b is pair b, its only slot token 0 (the rest the sentinel), every expert its first
        # pair: sorted_ids needs no ids at all and expert_ids are the ids (stored with them by _route_rows)
        b = tl.arange(0, BLOCK_TOPK)
        s = tl.arange(0, BLOCK_M_ALIGN)
        tl.store(sorted_ptr + b[:, None] * BLOCK_M_ALIGN + s[None, :], tl.where(s[None, :] == 0, b[:, None], TOP_K),
                 mask=(b < TOP_K)[:, None])
        tl.store(num_padded_ptr, TOP_K * BLOCK_M_ALIGN)
        _route_rows(lg_ptr, slg, tw_ptr, ids_ptr, expert_ids_ptr, M, E, TOP_K, RENORMALIZE, ROUTE_M, REPLICAS,
                    BLOCK_E, BLOCK_TOPK, LOGIT_KEYS, True)
    else:
        top_i, m_ok = _route_rows(lg_ptr, slg, tw_ptr, ids_ptr, ids_ptr, M, E, TOP_K, RENORMALIZE, ROUTE_M, REPLICAS,
                                  BLOCK_E, BLOCK_TOPK, LOGIT_KEYS, False)
        if PAIR_BLOCKS and REG_ALIGN:
            _pair_blocks_regs(top_i, m_ok, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K, ROUTE_M, REPLICAS,
                              BLOCK_TOPK, BLOCK_M_ALIGN)
        else:
            tl.debug_barrier()  # the ids' stores are visible to the whole program
            if PAIR_BLOCKS:
                pair_blocks_tile(ids_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, TOP_K, BLOCK_P, BLOCK_TOPK,
                                 BLOCK_M_ALIGN)
            else:
                _align_pairs(ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M * TOP_K, E, max_blocks,
                             BLOCK_M_ALIGN, BLOCK_E, BLOCK_P, BLOCK_B)


@triton.jit
def _router_program(pid_n, pid_k, n_tiles, n_split, x_ptr, sx, w_ptr, sw, ws_ptr, tick_ptr, lg_ptr, slg,
                    tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                    M, NL, K, K_PER, E, max_blocks,
                    TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SPLIT_MAX: tl.constexpr, USE_DOT: tl.constexpr,
                    COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_M_ALIGN: tl.constexpr,
                    BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_K: tl.constexpr, PDL: tl.constexpr,
                    PAIR_BLOCKS: tl.constexpr, ROUTE_M: tl.constexpr, REPLICAS: tl.constexpr,
                    REG_ALIGN: tl.constexpr, LOGIT_KEYS: tl.constexpr):
    ACT: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    m_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < NL
    k_lo = pid_k * K_PER
    acc, acc_u = _gemm_tile(x_ptr, sx, x_ptr, 0, 1, x_ptr, w_ptr, sw, rows, m_ok, offs_n, n_ok, k_lo,
                            tl.minimum(k_lo + K_PER, K), NL, tl.zeros((BLOCK_M,), tl.float32), 0.0, 0, False, 1,
                            USE_DOT, COMPUTE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PDL)
    tile_done = True
    if SPLIT_MAX > 1:
        tile_done, acc, acc_u = _split_reduce(acc, acc_u, rows, m_ok, offs_n, n_ok, ws_ptr, tick_ptr, pid_n, pid_k,
                                              n_split, NL, False, BLOCK_M, SPLIT_MAX)
    if tile_done:
        tl.store(lg_ptr + rows[:, None] * slg + offs_n[None, :], _round(acc, ACT).to(ACT),
                 mask=m_ok[:, None] & n_ok[None, :])
        tl.debug_barrier()
        finished = tl.atomic_add(tick_ptr + n_tiles, 1, sem="acq_rel", scope="gpu")
        if finished == n_tiles - 1:
            tl.debug_barrier()
            _route_align_tail(lg_ptr, slg, tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                              M, E, max_blocks, TOP_K, RENORMALIZE, ROUTE_M, REPLICAS, BLOCK_E, BLOCK_TOPK,
                              BLOCK_M_ALIGN, BLOCK_P, BLOCK_B, PAIR_BLOCKS, REG_ALIGN, LOGIT_KEYS)
            tl.store(tick_ptr + n_tiles, 0)


@triton.jit
def _router_kernel(x_ptr, sx, w_ptr, sw, ws_ptr, tick_ptr, lg_ptr, slg,
                   tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                   w13_ptr, sw13, h_ptr, sh, ws13_ptr,
                   M, NL, K, K_PER, E, max_blocks, NI, n_tiles_r,
                   TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr, SPLIT_MAX: tl.constexpr, USE_DOT: tl.constexpr,
                   COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_M_ALIGN: tl.constexpr,
                   BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, EVEN_K: tl.constexpr, HAS_SHARED: tl.constexpr,
                   PDL: tl.constexpr, PAIR_BLOCKS: tl.constexpr, ROUTE_M: tl.constexpr, REPLICAS: tl.constexpr,
                   REG_ALIGN: tl.constexpr, LOGIT_KEYS: tl.constexpr):
    if PDL:  # the next kernel may launch now; the GEMM tiles wait for the previous one (gdc_wait) after
        gdc_launch_dependents()  # issuing their first weight loads
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_split = tl.num_programs(1)
    if HAS_SHARED and pid_n >= n_tiles_r:
        # the shared expert's gate_up tiles (same input x): SiLU(gate) * up into h, with own tickets
        _skinny_program(pid_n - n_tiles_r, pid_k, tl.num_programs(0) - n_tiles_r, n_split,
                        x_ptr, sx, x_ptr, 0, 1, x_ptr, w13_ptr, sw13, ws13_ptr, ws13_ptr,
                        tick_ptr + n_tiles_r + 1, ws13_ptr, h_ptr, sh, x_ptr, 0, 0, x_ptr, 0, x_ptr, 0, x_ptr, x_ptr, 0,
                        M, NI, K, K_PER, 0.0, 0.0, x_ptr, x_ptr, 0, x_ptr, 0,
                        0, 1, False, False, 2, False, 1, SPLIT_MAX, USE_DOT, COMPUTE,
                        BLOCK_M, BLOCK_N, BLOCK_K, 16, EVEN_K, 1, 1, 1, 0, PDL)
    else:
        _router_program(pid_n, pid_k, n_tiles_r, n_split, x_ptr, sx, w_ptr, sw, ws_ptr, tick_ptr, lg_ptr, slg,
                        tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                        M, NL, K, K_PER, E, max_blocks, TOP_K, RENORMALIZE, SPLIT_MAX, USE_DOT, COMPUTE,
                        BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_E, BLOCK_TOPK, BLOCK_M_ALIGN, BLOCK_P, BLOCK_B,
                        EVEN_K, PDL, PAIR_BLOCKS, ROUTE_M, REPLICAS, REG_ALIGN, LOGIT_KEYS)


@dataclass(frozen=True)
class RouterTail:
    """How the finishing program routes and aligns (the same outputs either way): replicate: every row routed
    in one warp (the rows copied until there is one per warp); reg_align: pair blocks from the ids in registers;
    logit_keys: top-k on 32-bit keys of the 16-bit logits (router.logit_topk)."""
    replicate: bool = False
    reg_align: bool = False
    logit_keys: bool = False

    @classmethod
    def for_rows(cls, M: int) -> "RouterTail":
        """The measured choice for M rows (kernels/gemv/config.router_tail: tuned.json's router "tail")."""
        from linrnn_kernels.gemv.config import router_tail

        names = router_tail(M)
        unknown = set(names) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"router tail {names}: unknown {sorted(unknown)}")
        return cls(**{n: True for n in names})

    def constexprs(self, M: int, num_warps: int) -> dict:
        route_m = triton.next_power_of_2(max(M, 1))
        return dict(ROUTE_M=route_m, REPLICAS=max(1, num_warps // route_m) if self.replicate else 1,
                    REG_ALIGN=self.reg_align, LOGIT_KEYS=self.logit_keys)


def route_align(x: torch.Tensor, gate_w, num_experts: int, top_k: int, renormalize: bool, block_m: int,
                cfg: SkinnyConfig, shared_w13=None, pair_blocks: bool = False, tail: RouterTail | None = None):
    """x [M, K], gate_w a dense WeightTensor [E (+ extra gate rows), K] ->
    (logits [M, NL] in x.dtype, topk_weights [M, k] in x.dtype, topk_ids [M, k] int32,
     (sorted_ids, expert_ids, num_padded) as align.moe_align_block_size(topk_ids, E, block_m), h);
    pair_blocks (M <= block_m): as align.moe_pair_blocks(topk_ids, block_m) instead.
    With shared_w13 (the shared expert's dense [gate; up] rows [2I, K]) the same launch also computes
    h = SiLU(x gate^T) * (x up^T) [M, I] (else h is None)."""
    M, K = x.shape
    E = num_experts
    if gate_w.fmt != "dense":
        raise ValueError("the router gate is never quantized (SPEC §2.2); got " + gate_w.fmt)
    NL = gate_w.out_features
    if NL < E or gate_w.in_features != K:
        raise ValueError(f"gate weight {tuple(gate_w.data.shape)} does not fit x {tuple(x.shape)} and E={E}")
    if not 1 <= top_k <= E or E > 1024:
        raise ValueError(f"top_k={top_k} must be in [1, E={E}] and E <= 1024")
    P = M * top_k
    if P > MAX_PAIRS or M > 32:
        raise ValueError(f"fused router handles up to 32 rows and {MAX_PAIRS} pairs, got {M} x {top_k}")
    _check_pair_blocks(pair_blocks, M, block_m)
    dev = x.device
    block_mm = max(16 if cfg.use_dot else 1, triton.next_power_of_2(max(M, 1)))
    k_per = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per)
    n_tiles = triton.cdiv(NL, cfg.block_n)
    if n_tiles + 1 > TICKETS:
        raise ValueError(f"{n_tiles} N tiles exceed the {TICKETS} tickets")
    max_padded = P * block_m if pair_blocks else max_padded_pairs(P, E, block_m)
    max_blocks = max_padded // block_m
    logits = torch.empty(M, NL, dtype=x.dtype, device=dev)
    topk_w = torch.empty(M, top_k, dtype=x.dtype, device=dev)
    topk_ids = torch.empty(M, top_k, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max(max_padded, 1), dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    starts = torch.empty(E, dtype=torch.int32, device=dev)
    ws = torch.empty(split * block_mm * NL if split > 1 else 1, dtype=torch.float32, device=dev)
    if shared_w13 is not None:
        if shared_w13.fmt != "dense" or shared_w13.in_features != K or shared_w13.out_features % 2:
            raise ValueError(f"shared_w13 must be dense [2I, {K}], got {shared_w13.fmt} {tuple(shared_w13.data.shape)}")
        NI = shared_w13.out_features // 2
        n_tiles_s = triton.cdiv(NI, cfg.block_n)
        h = torch.empty(M, NI, dtype=x.dtype, device=dev)
        ws13 = torch.empty(split * 2 * block_mm * NI if split > 1 else 1, dtype=torch.float32, device=dev)
        w13, sw13 = shared_w13.data, shared_w13.data.stride(0)
    else:
        NI, n_tiles_s, h, ws13, w13, sw13 = 0, 0, None, ws, x, 0
    if n_tiles + 1 + n_tiles_s + 1 > TICKETS:
        raise ValueError(f"{n_tiles} + {n_tiles_s} N tiles exceed the {TICKETS} tickets")
    if M:
        from linrnn_kernels.gemv.skinny import _compute_dtype

        _router_kernel[(n_tiles + n_tiles_s, split)](
            x, x.stride(0), gate_w.data, gate_w.data.stride(0), ws, tickets(dev), logits, logits.stride(0),
            topk_w, topk_ids, starts, sorted_ids, expert_ids, num_padded,
            w13, sw13, h if h is not None else x, h.stride(0) if h is not None else 0, ws13,
            M, NL, K, k_per, E, max_blocks, NI, n_tiles,
            TOP_K=top_k, RENORMALIZE=bool(renormalize), SPLIT_MAX=triton.next_power_of_2(split), USE_DOT=cfg.use_dot,
            COMPUTE=_compute_dtype(x), BLOCK_M=block_mm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            BLOCK_E=triton.next_power_of_2(E), BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_M_ALIGN=block_m,
            BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_B=32, EVEN_K=K % cfg.block_k == 0,
            HAS_SHARED=shared_w13 is not None, PAIR_BLOCKS=pair_blocks,
            **(tail or RouterTail.for_rows(M)).constexprs(M, cfg.num_warps),
            num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, x), **pdl_launch_kwargs(x))
    else:
        num_padded.zero_()
        expert_ids.fill_(-1)
    return logits, topk_w, topk_ids, (sorted_ids, expert_ids, num_padded), h


def _check_pair_blocks(pair_blocks: bool, M: int, block_m: int) -> None:
    if pair_blocks and not (M <= block_m <= MAX_PAIR_BLOCK_TOKENS and block_m & (block_m - 1) == 0):
        raise ValueError(f"pair blocks: {M} rows in blocks of {block_m} (a power of two <= {MAX_PAIR_BLOCK_TOKENS})")


@triton.jit
def _route_align_kernel(lg_ptr, slg, tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr,
                        M, E, max_blocks, TOP_K: tl.constexpr, RENORMALIZE: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_M_ALIGN: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_B: tl.constexpr, PAIR_BLOCKS: tl.constexpr,
                        ROUTE_M: tl.constexpr, REPLICAS: tl.constexpr, REG_ALIGN: tl.constexpr,
                        LOGIT_KEYS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the logits' writer first; the expert kernels may then launch (they wait for this)
        gdc_wait()
        gdc_launch_dependents()
    _route_align_tail(lg_ptr, slg, tw_ptr, ids_ptr, starts_ptr, sorted_ptr, expert_ids_ptr, num_padded_ptr, M, E,
                      max_blocks, TOP_K, RENORMALIZE, ROUTE_M, REPLICAS, BLOCK_E, BLOCK_TOPK, BLOCK_M_ALIGN, BLOCK_P,
                      BLOCK_B, PAIR_BLOCKS, REG_ALIGN, LOGIT_KEYS)


# route_align_logits: one warp routes and aligns; on the H200 the 4-8-warp program took 10 / 26 / 79 us at
# 64 / 256 / 512 pairs (d444877), the one-warp one 4.5 / 22.5 us at 8 / 64 pairs (d2c705d; route + align
# launches: 4.6 / 4.8 us): single tokens only (pair blocks: up to MAX_PAIR_BLOCK_TOKENS rows, 4 warps past 8 pairs:
# one warp took ~40 us at 8 rows, H200 d935e44)
LOGITS_MAX_PAIRS = 8


def route_align_logits(logits: torch.Tensor, num_experts: int, top_k: int, renormalize: bool, block_m: int,
                       weight_dtype: torch.dtype, pair_blocks: bool = False, tail: RouterTail | None = None,
                       num_warps: int | None = None, pdl: bool | None = None):
    """Routing and alignment from router logits [M, >= E] in one launch (single-warp up to M * top_k <=
    LOGITS_MAX_PAIRS, or pair_blocks): (topk_weights [M, k] in weight_dtype, topk_ids [M, k] int32, (sorted_ids,
    expert_ids, num_padded) as align.moe_align_block_size(topk_ids, E, block_m), or with pair_blocks (M <=
    block_m) as align.moe_pair_blocks(topk_ids, block_m)). The MoE benchmark's decode layer starts from logits;
    it routes through this as the engine's layer routes through the fused router. pdl (default: where available,
    gemv.config.pdl_launch_kwargs): launched with programmatic dependent launch, letting the next kernel (the MoE
    gate_up, which waits for this one) launch once the logits are there."""
    M = logits.shape[0]
    E = num_experts
    P = M * top_k
    if (logits.dim() != 2 or logits.shape[1] < E or not 1 <= top_k <= E or E > 1024
            or (P > LOGITS_MAX_PAIRS and not pair_blocks)):
        raise ValueError(f"route_align_logits: logits {tuple(logits.shape)}, E={E}, top_k={top_k}: needs "
                         f"E <= 1024 and M * top_k <= {LOGITS_MAX_PAIRS} (or pair blocks)")
    _check_pair_blocks(pair_blocks, M, block_m)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    dev = logits.device
    max_padded = P * block_m if pair_blocks else max_padded_pairs(P, E, block_m)
    max_blocks = max_padded // block_m
    topk_w = torch.empty(M, top_k, dtype=weight_dtype, device=dev)
    topk_ids = torch.empty(M, top_k, dtype=torch.int32, device=dev)
    sorted_ids = torch.empty(max(max_padded, 1), dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max(max_blocks, 1), dtype=torch.int32, device=dev)
    num_padded = torch.empty(1, dtype=torch.int32, device=dev)
    starts = torch.empty(E, dtype=torch.int32, device=dev)
    if M:
        warps = num_warps or (1 if P <= LOGITS_MAX_PAIRS else 4)
        launch = pdl_launch_kwargs(logits) if pdl is not False else {"PDL": False}
        _route_align_kernel[(1,)](
            logits, logits.stride(0), topk_w, topk_ids, starts, sorted_ids, expert_ids, num_padded,
            M, E, max_blocks, TOP_K=top_k, RENORMALIZE=bool(renormalize),
            BLOCK_E=triton.next_power_of_2(E), BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_M_ALIGN=block_m,
            BLOCK_P=max(16, triton.next_power_of_2(P)), BLOCK_B=32, PAIR_BLOCKS=pair_blocks,
            **(tail or RouterTail.for_rows(M)).constexprs(M, warps), num_warps=warps, **launch)
    else:
        num_padded.zero_()
        expert_ids.fill_(-1)
    return topk_w, topk_ids, (sorted_ids, expert_ids, num_padded)


def naive_route_align(x, gate_w, num_experts: int, top_k: int, renormalize: bool, block_m: int):
    """The unfused composition: (logits, topk_weights in x.dtype, topk_ids, naive alignment)."""
    from linrnn_kernels.moe import naive

    logits = (x.float() @ gate_w.dequantize(torch.float32).t()).to(x.dtype)
    w, ids = naive.route(logits[:, :num_experts], top_k, renormalize)
    return logits, w.to(x.dtype), ids, naive.moe_align_block_size(ids, num_experts, block_m)


def naive_shared_gate_up(x, shared_w13):
    """The unfused composition of the shared expert's first half: silu_mul(x W13^T rounded)."""
    from linrnn_kernels.gemv import naive as gemv_naive

    return gemv_naive.skinny_linear(x, shared_w13, epilogue="silu_mul")
