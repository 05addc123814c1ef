"""Gated-DeltaNet decode: one token per sequence, the whole batch in one launch (SPEC §1.5 steps 4-7).

Per (sequence b, value head h, Dv tile): gates, L2-norm + scale of q/k (key head h // (Hv/Hk)),
then with the [Dk, BV] state tile in f32 registers
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
The state tile is read from the head's partition (f32 or bf16, runtime branch on head_is_bf16[h])
and written back in place in that dtype through state_indices; padded rows index the dummy slot 0.
Each partition has its layout (layout.py): f32 heads [Dk, Dv], bf16 heads [Dv / 64, Dk, 64] (blocked).

Bandwidth design: the state is read and written exactly once (B x Hv x Dk x Dv x 4 B each way for
f32 heads dominates everything else) with an evict-first L2 hint, each row of a tile is BV contiguous
elements (>= 64 B), and the grid is B x Hv x Dv/BV programs: [Dk, 16] tiles at B = 1 so that every
SM streams, up to [Dk, 64] at large batch (decode_config). Both partitions use 4 elements per thread
(16-byte f32, 8-byte bf16 accesses) so an f32 tile never changes register layout between its load and
its store, and the q/k norms are applied after the reductions, so all sums over Dk take two cross-warp
rounds (issue #4: 80 -> 85 % of copy bandwidth at B = 64, benchmarks/results/kernels/gdn-decode/).

Program order: with one partition (all f32 at tau = inf, or all bf16) the programs run (row, natural
head, Dv tile) and find the tile through the head map. With both partitions the grid is partition-major: all f32 tiles first,
then all bf16 tiles, each program finding its natural head (for q/k/v/gates) by inverting the head map;
the tile math is the same code in both orders, so every row's bits are too. Measured on an H200 at 50 %
f32 heads, B = 128: 114.4 instead of 118.1 us per layer call (84.2 vs 81.5 % of copy bandwidth). The Dv
tiles of a head stay adjacent in the order: reading the two halves of each state row far apart in time
costs 6-8 points of bandwidth (DRAM pages reopened). The same holds within a bf16 program: with [Dk, Dv]
heads its [Dk, 64] tile was 128 pieces of 128 B strided 256 B apart (72 / 79 / 80 % of copy all-bf16 at B = 64 /
128 / 256, all-f32 ~90 %); the blocked bf16 layout makes it one contiguous 16 KB run: 77 / 84 / 87 % (H200,
benchmarks/results/kernels/gdn-decode/bf16_round3/; the same addressing measured 1.5-2 points slower for f32
heads, which keep [Dk, Dv]). bf16_round/ records the other variants tried against the bf16 partition, bf16_round2/
the persistent bf16 programs with the next tiles in flight (a register double buffer, a TMA pipeline): both
slower on the H200 (TMA: 54.9-64.1 % of copy all-bf16 at B = 64-256), removed. bf16_round4/ the launch shapes tried
on the blocked layout (register caps for 5-6 programs per SM, 8 warps, whole-head [Dk, 128] tiles, 2-4 tiles per
program, one launch per partition, PDL): none faster than this kernel. With all heads bf16 the kernel holds only
the bf16 tile code (ALL_BF16: 920 instead of 1688 sm_90 instructions with triton 3.9, no loaded dtype flag):
1.4 % faster all-bf16 at B = 32-256, same bits; kernels with f32 heads compile as before (bf16_round5/, which also
records Nsight Compute's view of the bf16 programs and the tensor-core bf16 tile, measured no faster and removed).
bf16_round6/: an L2 prefetch of a later program's tile (holds no registers) slows bf16 and hybrid launches; it
speeds all-f32 launches at B >= 128 by 4-6 % and stays an opt-in DecodeConfig.prefetch (_prefetch_tile).
bf16_round7/: the bf16 tile held packed (32-bit words, widened per use: 96 registers -> 5 programs per SM, or a
[Dk, 128] tile at 3 per SM) measured no faster at B = 64 (more bf16 programs per SM are slower), removed.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from linrnn_kernels.gdn.common import (
    INTERPRET,
    check_pools,
    check_qkv,
    gates,
    head_state_offset,
    num_sms,
    rows_view,
    state_tile_base,
    state_tile_offsets,
)
from linrnn_kernels.gdn.layout import bf16_block


class DecodeConfig(NamedTuple):
    """Launch shape of the decode kernel. bv: Dv columns per state tile; load / store: cache hint of the
    state load / store, an L2 eviction policy ("evict_first") or a PTX cache operator (".cg", ".cs"),
    "" for none (ptxas takes one of the two kinds per access); maxnreg: register cap per thread;
    partition_major: program order (None: partition-major exactly when both partitions hold heads);
    prefetch: L2 prefetch distance in waves of resident programs (0: none; [Dk, 64] tiles only, _prefetch_tile)."""
    bv: int
    num_warps: int
    load: str = ""
    store: str = ""
    maxnreg: int | None = None
    partition_major: bool | None = None
    prefetch: float = 0


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _head_update(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_hk, i_v,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                 stride_a_tok, stride_b_tok, scale,
                 HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BLOCK: tl.constexpr,
                 LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr,
                 STORE_CACHE: tl.constexpr, pf_base=0, pf_iv=0, pf_on=False, PREFETCH: tl.constexpr = False):
    """One [DK, BV] state tile of head i_h (columns i_v * BV ..) of one partition pool, updated in place;
    BLOCK: the pool's layout (0: [DK, DV] per head, f32; else [DV / BLOCK, DK, BLOCK], bf16). PREFETCH: once
    its own state load is issued, the program prefetches tile pf_iv of the head at pf_base of the same pool
    into L2 if pf_on (_prefetch_tile)."""
    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    offs = state_tile_offsets(i_v, BV, DK, DV, BLOCK)
    if BLOCK != 0:
        base = base + state_tile_base(i_v, BV, DK, BLOCK)
    # 4 elements per thread: f32 tiles take 16 B in both directions (bf16 8 B), so an f32 tile never changes
    # register layout between its load and its store (Triton gives a load the widest vector of any
    # same-shaped access but caps stores at 16 B; a mismatch sent f32 tiles through shared memory). 16-byte bf16
    # accesses measured slower in both layouts (bf16_round/, bf16_round3/). The hint sits on the pointers: on the
    # blocked bf16 offsets (o_k * 64 + j, all constant) triton 3.6 dropped it and gave the bf16 load 16-byte
    # vectors, and with them the f32 load, whose store then converted layout (tests/test_gdn_kernels.py)
    ptrs = tl.max_contiguous(pool + base + offs, [1, 4])
    s = tl.load(ptrs, eviction_policy=LOAD_EVICT, cache_modifier=LOAD_CACHE).to(tl.float32)
    if PREFETCH:
        if pf_on:
            _prefetch_tile(pool + pf_base, pf_iv, DK, DV, BV, BLOCK)

    b_q = tl.load(q + i_b * stride_q_tok + i_hk * stride_q_head + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_tok + i_hk * stride_k_head + o_k).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v_tok + i_h * stride_v_head + o_v).to(tl.float32)
    g, beta = gates(tl.load(a + i_b * stride_a_tok + i_h), tl.load(b + i_b * stride_b_tok + i_h),
                    tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    # SPEC §1.5.7 with the L2 norms of §1.4 #3 / §1.5.5 folded in after the reductions (k = r_k k_raw,
    # q = r_q scale q_raw): S' = exp(g) S + k u^T, u = beta (v - exp(g) S^T k), o = S'^T q written as
    # o = exp(g) S^T q + (k.q) u. Every sum over Dk then comes from two cross-warp reductions (three
    # scalars; two columns of the tile) instead of five, and both tile reductions read the loaded tile.
    decay = tl.exp(g)
    qq, kk, kq = tl.reduce((b_q * b_q, b_k * b_k, b_q * b_k), 0, _add3)
    r_q = tl.rsqrt(qq + 1e-6) * scale
    r_k = tl.rsqrt(kk + 1e-6)
    sk, sq = tl.reduce((s * b_k[:, None], s * b_q[:, None]), 0, _add2)
    u = beta * (b_v - decay * r_k * sk)
    b_o = decay * r_q * sq + (kq * r_k * r_q) * u
    s = s * decay + (b_k * r_k)[:, None] * u[None, :]

    tl.store(o + (i_b * HV + i_h) * DV + o_v, b_o.to(o.dtype.element_ty))
    tl.store(ptrs, s.to(pool.dtype.element_ty), eviction_policy=STORE_EVICT,
             cache_modifier=STORE_CACHE)


_INTERPRET = tl.constexpr(INTERPRET)


@triton.jit
def _prefetch_lines(ptrs):
    """Bring the 128-byte line of each address into L2 (no registers held, nothing waits on it). The interpreter
    has no inline PTX: it reads the addresses instead (they must be valid either way)."""
    if _INTERPRET:
        tl.load(ptrs)
    else:
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_tile(head, i_v, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BLOCK: tl.constexpr):
    """L2 prefetch of the [DK, BV] state tile i_v of the head state at `head` (BV * element size a multiple of
    128 B), issued by a program for the program a fraction of a wave after it so that program's state load hits
    L2. Measured on an H200 (bf16_round6/): all-f32 at B = 128 / 256 4-6 % faster at half a wave (136.8 vs 142.5,
    264.1 vs 280.6 us), slower at B <= 64; bf16 and hybrid launches at B >= 64 2-10 % slower at any distance, also
    with bulk prefetches (cp.async.bulk.prefetch). Off by default (DecodeConfig.prefetch)."""
    if BLOCK != 0:  # bf16 [DV / BLOCK, DK, BLOCK]: a [DK, BLOCK] tile is one contiguous run of 64-element lines
        _prefetch_lines(head + state_tile_base(i_v, BV, DK, BLOCK) + tl.arange(0, DK * BV // 64) * 64)
    else:  # f32 [DK, DV]: DK rows of BV // 32 lines
        _prefetch_lines(head + tl.arange(0, DK)[:, None] * DV + i_v * BV + tl.arange(0, BV // 32)[None, :] * 32)


@triton.jit
def _natural_head(head_is_bf16, head_local, j, IS_BF16: tl.constexpr, HV: tl.constexpr):
    """The natural head stored at index j of the bf16 (IS_BF16) or f32 partition: the inverse of the head
    map, from two [HV] loads and one in-warp reduction."""
    hh = tl.arange(0, triton.next_power_of_2(HV))
    valid = hh < HV
    isb = tl.load(head_is_bf16 + hh, mask=valid, other=0)
    loc = tl.load(head_local + hh, mask=valid, other=-1)
    in_part = (isb != 0) if IS_BF16 else (isb == 0)
    return tl.sum(tl.where(valid & in_part & (loc == j), hh, 0), 0)


@triton.jit
def _future_tile(p, n_programs, n_heads, state_indices, head_local, stride_slot, DK: tl.constexpr, DV: tl.constexpr,
                 NV: tl.constexpr, NATURAL: tl.constexpr, PREFETCH: tl.constexpr):
    """(element offset of its head in the pool, Dv tile, exists) of program p of an order of n_programs over
    rows x n_heads x NV tiles (NATURAL: heads in natural order, found in their partition through head_local;
    else partition-local). The two index loads go out with the program's own, before its state load."""
    if PREFETCH:
        on = p < n_programs
        p = tl.where(on, p, 0)
        r = p // NV
        j = r % n_heads
        slot = tl.load(state_indices + r // n_heads).to(tl.int64)
        if NATURAL:
            j = tl.load(head_local + j)
        return slot * stride_slot + j.to(tl.int64) * (DK * DV), p % NV, on
    else:
        return 0, 0, False


@triton.jit
def _partition_program(p, n_heads, stride_slot, pool, IS_BF16: tl.constexpr, q, k, v, a, b, A_log, dt_bias, o,
                       head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                       stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale,
                       HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                       BF16_BLOCK: tl.constexpr, LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr,
                       STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr, n_programs, pf_dist,
                       PREFETCH: tl.constexpr):
    """Program p of n_programs of one partition (B x n_heads x Dv tiles, Dv tiles fastest): the tile's address
    needs only the slot; the natural head (for q/k/v/gates) comes from the head map in parallel. PREFETCH: L2
    prefetch of the tile of program p + pf_dist of the same partition."""
    NV: tl.constexpr = DV // BV
    i_v = p % NV
    r = p // NV
    j = r % n_heads
    i_b = (r // n_heads).to(tl.int64)
    base = tl.load(state_indices + i_b).to(tl.int64) * stride_slot + j.to(tl.int64) * (DK * DV)
    i_h = _natural_head(head_is_bf16, head_local, j, IS_BF16, HV)
    pf_base, pf_iv, pf_on = _future_tile(p + pf_dist, n_programs, n_heads, state_indices, head_local, stride_slot,
                                         DK, DV, NV, False, PREFETCH)
    _head_update(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_h // GROUP, i_v,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                 stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, BF16_BLOCK if IS_BF16 else 0, LOAD_EVICT,
                 LOAD_CACHE, STORE_EVICT, STORE_CACHE, pf_base, pf_iv, pf_on, PREFETCH)


@triton.jit
def _gdn_decode_kernel(
    q, k, v, a, b, A_log, dt_bias,
    ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_a_tok, stride_b_tok, stride_f32_slot, stride_bf16_slot,
    n_f32_heads, n_bf16_heads, n_f32_programs, n_programs, pf_dist, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    PARTITION_MAJOR: tl.constexpr, ALL_BF16: tl.constexpr, BF16_BLOCK: tl.constexpr, PREFETCH: tl.constexpr,
    LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
):
    NV: tl.constexpr = DV // BV
    pid = tl.program_id(0)
    if PARTITION_MAJOR:
        # B x n_f32_heads x NV f32 tiles, then B x n_bf16_heads x NV bf16 tiles (one branch per partition, so
        # each compiles for its state dtype)
        if pid < n_f32_programs:
            _partition_program(pid, n_f32_heads, stride_f32_slot, ssm_f32, False, q, k, v, a, b, A_log, dt_bias, o,
                               head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                               stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP,
                               DK, DV, BV, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE,
                               n_f32_programs, pf_dist, PREFETCH)
        else:
            _partition_program(pid - n_f32_programs, n_bf16_heads, stride_bf16_slot, ssm_bf16, True, q, k, v, a, b,
                               A_log, dt_bias, o, head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head,
                               stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok,
                               scale, HV, GROUP, DK, DV, BV, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT,
                               STORE_CACHE, n_programs - n_f32_programs, pf_dist, PREFETCH)
    else:
        i_v = pid % NV
        i_bh = pid // NV
        i_b = (i_bh // HV).to(tl.int64)
        i_h = i_bh % HV
        i_hk = i_h // GROUP  # consecutive value heads share a key head (SPEC §1.5.6)
        # the state tile's address first: two dependent tiny loads, and the tile is the bulk of the bytes
        slot = tl.load(state_indices + i_b)
        # PREFETCH in natural order only with one partition (the launcher's rule): the future tile is in the same pool
        pf_base, pf_iv, pf_on = _future_tile(pid + pf_dist, n_programs, HV, state_indices, head_local,
                                             stride_bf16_slot if ALL_BF16 else stride_f32_slot, DK, DV, NV, True,
                                             PREFETCH)
        if ALL_BF16:  # only the bf16 tile code is compiled (registers sized for it), no branch on a loaded flag
            is_bf16 = True
            base = slot.to(tl.int64) * stride_bf16_slot + tl.load(head_local + i_h).to(tl.int64) * (DK * DV)
        else:
            is_bf16, base = head_state_offset(head_is_bf16, head_local, i_h, slot, stride_f32_slot, stride_bf16_slot,
                                              DK, DV)
        if is_bf16 != 0:
            _head_update(q, k, v, a, b, A_log, dt_bias, ssm_bf16, base, o, i_b, i_h, i_hk, i_v,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                         stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE,
                         STORE_EVICT, STORE_CACHE, pf_base, pf_iv, pf_on, PREFETCH and ALL_BF16)
        else:
            _head_update(q, k, v, a, b, A_log, dt_bias, ssm_f32, base, o, i_b, i_h, i_hk, i_v,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                         stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, 0, LOAD_EVICT, LOAD_CACHE, STORE_EVICT,
                         STORE_CACHE, pf_base, pf_iv, pf_on, PREFETCH and not ALL_BF16)


def _resident_programs(cfg: DecodeConfig) -> int:
    """Programs of this launch shape resident per SM: the unit of the prefetch distance (a wave). The kernel takes
    up to 128 registers per thread at these shapes (sm_90, 64K registers per SM), maxnreg lowers it."""
    return max(1, 65536 // (32 * cfg.num_warps * (cfg.maxnreg or 128)))


def _hints(kind: str, hint: str) -> dict:
    evict = hint if hint.startswith("evict") else ""
    return {f"{kind}_EVICT": evict, f"{kind}_CACHE": "" if evict else hint}


def decode_config(B: int, Hv: int, Dk: int, Dv: int, device) -> DecodeConfig:
    """Tile shape by how many programs the batch makes; evict-first state hints always.

    Measured on H200 (benchmarks/results/kernels/gdn-decode/gdn_decode_sweep.md and layout_fix/, 35B-A3B
    heads): [Dk, 64] tiles on 4 warps reach 86-91 % of copy bandwidth at B >= 64 (where [Dk, 32] tiles reach
    80-84 %) once they fill every SM 8 times over; [Dk, 32] on 2 warps win at mid batch (B = 8: 11.8 vs
    12.3 us); [Dk, 16] when even those leave SMs idle (B = 1: 3.7 vs 4.2 us). The tile shape sets the
    order of the Dk reduction, so a row's low bits depend on B through this choice; the engine runs
    every decode step, graphed or eager, at its bucket size, so graphs on == off stays bit-exact. The
    state is read once and written once per step and next touched a whole forward pass later:
    evict_first keeps it from pushing weights and activations out of L2 (+4-6 points of bandwidth)."""
    sms = num_sms(device.index or 0) if device.type == "cuda" else 132
    if Dv >= 64 and B * Hv * (Dv // 64) >= 8 * sms:
        bv, warps = 64, 4
    elif Dv >= 32 and B * Hv * (Dv // 32) >= 2 * sms:
        bv, warps = 32, 2
    else:
        bv, warps = min(16, Dv), 2
    return DecodeConfig(bv, warps, "evict_first", "evict_first")


def gdn_decode(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices,
               config: DecodeConfig | tuple | None = None):
    """One token per sequence: q, k [B, Hk, Dk] (raw, post-conv), v [B, Hv, Dv], a, b [B, Hv].

    Updates the pools in place at state_indices [B] and returns o [B, Hv, Dv] in v.dtype. q/k/v/a/b
    may be strided views (e.g. splits of the conv output); only their last dim must be unit-stride
    (otherwise they are copied). `config` (a DecodeConfig or its tuple) overrides the tile choice (benchmarks).
    """
    B, Hk, Hv, Dk, Dv = check_qkv(q, k, v, a, b, A_log, dt_bias)
    check_pools(ssm_f32, ssm_bf16, head_is_bf16, head_local, Hv, Dk, Dv)
    if state_indices.shape != (B,):
        raise ValueError(f"state_indices must be [B={B}], got {tuple(state_indices.shape)}")
    q, k, v, a, b = (rows_view(t) for t in (q, k, v, a, b))
    o = torch.empty(B, Hv, Dv, dtype=v.dtype, device=v.device)
    if B == 0:
        return o
    cfg = DecodeConfig(*(config or decode_config(B, Hv, Dk, Dv, q.device)))
    nf, nb = ssm_f32.shape[1], ssm_bf16.shape[1]
    nv = Dv // cfg.bv
    partition_major = (nf > 0 and nb > 0) if cfg.partition_major is None else bool(cfg.partition_major)
    n_programs = B * Hv * nv
    # the prefetch runs pf_dist programs ahead within one partition's order; whole 128-byte lines of a tile row
    prefetch = cfg.prefetch > 0 and (partition_major or nf == 0 or nb == 0) and cfg.bv * 2 % 128 == 0 \
        and cfg.bv == bf16_block(Dv)
    pf_dist = max(1, round(cfg.prefetch * num_sms(q.device.index or 0) * _resident_programs(cfg))) if prefetch else 0
    _gdn_decode_kernel[(n_programs,)](
        q, k, v, a, b, A_log, dt_bias,
        ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        a.stride(0), b.stride(0), ssm_f32.stride(0), ssm_bf16.stride(0),
        nf, nb, B * nf * nv, n_programs, pf_dist, Dk ** -0.5,
        HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BV=cfg.bv, PARTITION_MAJOR=partition_major, BF16_BLOCK=bf16_block(Dv),
        PREFETCH=prefetch,
        ALL_BF16=nf == 0,
        **_hints("LOAD", cfg.load), **_hints("STORE", cfg.store), num_warps=cfg.num_warps, maxnreg=cfg.maxnreg,
    )
    return o
