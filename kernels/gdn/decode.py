"""Gated-DeltaNet decode: one token per sequence, the whole batch in one launch (SPEC §1.5 steps 4-7).

Per (sequence b, value head h, Dv tile): gates, L2-norm + scale of q/k (key head h // (Hv/Hk)),
then with the [Dk, BV] state tile in f32 registers
    S <- exp(g) S;  u = beta (v - S^T k);  S <- S + k u^T;  o = S^T q
The state tile is read from the head's partition (f32 or bf16, runtime branch on head_is_bf16[h])
and written back in place in that dtype through state_indices; padded rows index the dummy slot 0.

Bandwidth design: the state is read and written exactly once (B x Hv x Dk x Dv x 4 B each way for
f32 heads dominates everything else) with an evict-first L2 hint, each row of a tile is BV contiguous
elements (>= 64 B), and the grid is B x Hv x Dv/BV programs: [Dk, 16] tiles at B = 1 so that every
SM streams, up to [Dk, 64] at large batch (decode_config). Both partitions use 4 elements per thread
(16-byte f32, 8-byte bf16 accesses) so an f32 tile never changes register layout between its load and
its store, and the q/k norms are applied after the reductions, so all sums over Dk take two cross-warp
rounds (issue #4: 80 -> 85 % of copy bandwidth at B = 64, benchmarks/results/kernels/gdn-decode/).
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
    num_sms,
    rows_view,
)


class DecodeConfig(NamedTuple):
    """Launch shape of the decode kernel. bv: Dv columns per state slice; load / store: cache hint of the
    state load / store, an L2 eviction policy ("evict_first") or a PTX cache operator (".cg", ".cs"),
    "" for none (ptxas takes one of the two kinds per access); maxnreg: register cap per thread;
    bf16_nsub: [Dk, bv] slices per bf16-partition program (2: as many bytes per program as an f32 one);
    bf16_vec: bf16 elements per thread access (4: 8 B, 8: 16 B); split: with both partitions present, one
    launch per partition (each compiled for its own dtype: the bf16 programs' register count, hence how
    many fit on an SM, no longer set by the f32 ones), bf16_maxnreg: register cap of that bf16 launch."""
    bv: int
    num_warps: int
    load: str = ""
    store: str = ""
    maxnreg: int | None = None
    bf16_nsub: int = 1
    bf16_vec: int = 4
    split: bool = False
    bf16_maxnreg: int | None = None


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _bf16_to_f32_opaque(x):
    """x.to(float32) (exact: the bf16 bits shifted up) as inline PTX the compiler cannot merge with the
    tile's other conversion: the update re-widens the bf16 tile instead of keeping its f32 copy live
    through the reductions (64 registers per [Dk, 64] slice on 4 warps)."""
    # two bf16 per 32-bit register (element 0 in the low half); prmt moves each into the high half of an f32
    return tl.inline_asm_elementwise("prmt.b32 $0, $2, 0, 0x1044; prmt.b32 $1, $2, 0, 0x3244;", "=r,=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def _columns_update(s_raw, offs, o_v, pool, base, o, i_b, i_h, b_k, b_q, b_v, decay, beta, r_k, r_q, kq,
                    HV: tl.constexpr, DV: tl.constexpr, STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
                    REMAT_BF16: tl.constexpr):
    """Update one [DK, BV] slice of a state tile (columns o_v, loaded as s_raw) and write it and its o columns.

    SPEC §1.5.7 with the L2 norms of §1.4 #3 / §1.5.5 folded in after the reductions (k = r_k k_raw,
    q = r_q scale q_raw): S' = exp(g) S + k u^T, u = beta (v - exp(g) S^T k), o = S'^T q written as
    o = exp(g) S^T q + (k.q) u. Every sum over Dk then comes from two cross-warp reductions (three
    scalars; two columns of the tile) instead of five, and both tile reductions read the loaded tile."""
    s = s_raw.to(tl.float32)
    sk, sq = tl.reduce((s * b_k[:, None], s * b_q[:, None]), 0, _add2)
    u = beta * (b_v - decay * r_k * sk)
    b_o = decay * r_q * sq + (kq * r_k * r_q) * u
    if REMAT_BF16:
        s = _bf16_to_f32_opaque(s_raw)
    s = s * decay + (b_k * r_k)[:, None] * u[None, :]
    tl.store(o + (i_b * HV + i_h) * DV + o_v, b_o.to(o.dtype.element_ty))
    tl.store(pool + base + offs, s.to(pool.dtype.element_ty), eviction_policy=STORE_EVICT,
             cache_modifier=STORE_CACHE)


@triton.jit
def _tile_update(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_hk, v0,
                 stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                 stride_a_tok, stride_b_tok, scale,
                 HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, NSUB: tl.constexpr,
                 VEC: tl.constexpr, LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr,
                 STORE_CACHE: tl.constexpr, REMAT_BF16: tl.constexpr):
    """Columns v0 .. v0 + NSUB*BV of head i_h's state (one partition pool at `base`), updated in place, as
    NSUB [DK, BV] slices whose loads are all issued first (NSUB = 2: a bf16 program moves as many bytes as
    an f32 one while each slice keeps the f32 tile's register layout and reduction order)."""
    o_k = tl.arange(0, DK)
    o_v = v0 + tl.arange(0, BV)
    # VEC elements per thread: f32 tiles take 4 (16 B) in both directions, so an f32 tile never changes
    # register layout between its load and its store (Triton gives a load the widest vector of any
    # same-shaped access but caps stores at 16 B; a mismatch sent f32 tiles through shared memory)
    offs = tl.max_contiguous(o_k[:, None] * DV + o_v[None, :], [1, VEC])
    s0 = tl.load(pool + base + offs, eviction_policy=LOAD_EVICT, cache_modifier=LOAD_CACHE)
    if NSUB == 2:
        s1 = tl.load(pool + base + BV + offs, eviction_policy=LOAD_EVICT, cache_modifier=LOAD_CACHE)

    b_q = tl.load(q + i_b * stride_q_tok + i_hk * stride_q_head + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_tok + i_hk * stride_k_head + o_k).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v_tok + i_h * stride_v_head + o_v).to(tl.float32)
    if NSUB == 2:
        b_v1 = tl.load(v + i_b * stride_v_tok + i_h * stride_v_head + BV + o_v).to(tl.float32)
    g, beta = gates(tl.load(a + i_b * stride_a_tok + i_h), tl.load(b + i_b * stride_b_tok + i_h),
                    tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    decay = tl.exp(g)
    qq, kk, kq = tl.reduce((b_q * b_q, b_k * b_k, b_q * b_k), 0, _add3)
    r_q = tl.rsqrt(qq + 1e-6) * scale
    r_k = tl.rsqrt(kk + 1e-6)
    _columns_update(s0, offs, o_v, pool, base, o, i_b, i_h, b_k, b_q, b_v, decay, beta, r_k, r_q, kq,
                    HV, DV, STORE_EVICT, STORE_CACHE, REMAT_BF16)
    if NSUB == 2:
        _columns_update(s1, offs + BV, o_v + BV, pool, base, o, i_b, i_h, b_k, b_q, b_v1, decay, beta, r_k, r_q,
                        kq, HV, DV, STORE_EVICT, STORE_CACHE, REMAT_BF16)


@triton.jit
def _natural_head(head_is_bf16, head_local, j, IS_BF16: tl.constexpr, HV: tl.constexpr):
    """The natural head stored at index j of the f32 / bf16 partition (inverse of the head map)."""
    hh = tl.arange(0, triton.next_power_of_2(HV))
    valid = hh < HV
    isb = tl.load(head_is_bf16 + hh, mask=valid, other=0)
    loc = tl.load(head_local + hh, mask=valid, other=-1)
    in_part = (isb != 0) if IS_BF16 else (isb == 0)
    return tl.sum(tl.where(valid & in_part & (loc == j), hh, 0), 0)


@triton.jit
def _gdn_decode_kernel(
    q, k, v, a, b, A_log, dt_bias,
    ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
    stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
    stride_a_tok, stride_b_tok, stride_f32_slot, stride_bf16_slot,
    n_f32_heads, n_bf16_heads, n_f32_programs, scale,
    HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
    HAS_F32: tl.constexpr, HAS_BF16: tl.constexpr, BF16_NSUB: tl.constexpr, BF16_VEC: tl.constexpr,
    LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr,
    BF16_REMAT: tl.constexpr = not INTERPRET,
):
    pid = tl.program_id(0)
    # partition-major grid: n_f32_programs f32 programs (B x f32 heads x DV/BV), then the bf16 ones
    # (B x bf16 heads x DV/(BV*BF16_NSUB)); within a partition (row, head, column block), columns fastest
    if HAS_F32 and (not HAS_BF16 or pid < n_f32_programs):
        NV: tl.constexpr = DV // BV
        i_v = pid % NV
        r = pid // NV
        j = r % n_f32_heads
        i_b = (r // n_f32_heads).to(tl.int64)
        # the state tile's address needs only the slot: one tiny load before the bulk of the bytes
        base = tl.load(state_indices + i_b).to(tl.int64) * stride_f32_slot + j.to(tl.int64) * (DK * DV)
        i_h = _natural_head(head_is_bf16, head_local, j, False, HV)
        _tile_update(q, k, v, a, b, A_log, dt_bias, ssm_f32, base, o, i_b, i_h, i_h // GROUP, i_v * BV,
                     stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, 1, 4,
                     LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, False)
    else:
        NVB: tl.constexpr = DV // (BV * BF16_NSUB)
        p = pid - n_f32_programs if HAS_F32 else pid
        i_v = p % NVB
        r = p // NVB
        j = r % n_bf16_heads
        i_b = (r // n_bf16_heads).to(tl.int64)
        base = tl.load(state_indices + i_b).to(tl.int64) * stride_bf16_slot + j.to(tl.int64) * (DK * DV)
        i_h = _natural_head(head_is_bf16, head_local, j, True, HV)
        _tile_update(q, k, v, a, b, A_log, dt_bias, ssm_bf16, base, o, i_b, i_h, i_h // GROUP,
                     i_v * (BV * BF16_NSUB),
                     stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, BF16_NSUB, BF16_VEC,
                     LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, BF16_REMAT)


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
    # bf16 programs on two slices (as many bytes as an f32 program) while that still leaves every SM
    # several programs: PROVISIONAL threshold, set from the H200 sweep (bf16_round/)
    nsub = 2 if B * Hv * (Dv // bv) >= 8 * sms and Dv // bv >= 2 else 1
    return DecodeConfig(bv, warps, "evict_first", "evict_first", None, nsub)


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
    nsub = cfg.bf16_nsub if nv % cfg.bf16_nsub == 0 else 1
    n_f32_programs = B * nf * nv
    n_bf16_programs = B * nb * (nv // nsub)
    launches = [(nf, nb, n_f32_programs, n_bf16_programs, cfg.maxnreg)]
    if cfg.split and nf and nb:
        launches = [(nf, 0, n_f32_programs, 0, cfg.maxnreg), (0, nb, 0, n_bf16_programs, cfg.bf16_maxnreg)]
    for has_f32, has_bf16, n_f32, n_bf16, maxnreg in launches:
        _gdn_decode_kernel[(n_f32 + n_bf16,)](
            q, k, v, a, b, A_log, dt_bias,
            ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), ssm_f32.stride(0), ssm_bf16.stride(0),
            nf, nb, n_f32, Dk ** -0.5,
            HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BV=cfg.bv, HAS_F32=has_f32 > 0, HAS_BF16=has_bf16 > 0,
            BF16_NSUB=nsub, BF16_VEC=cfg.bf16_vec, **_hints("LOAD", cfg.load), **_hints("STORE", cfg.store),
            num_warps=cfg.num_warps, maxnreg=maxnreg,
        )
    return o
