"""NVFP4 grouped GEMM for prefill on Hopper: wide token blocks on async wgmma, weights decoded in registers.

    out[r, n] = sum_k A[row(r), k] * W[e(r), n, k]

The decode kernel (nvfp4_mma.py) re-decodes every weight tile once per 8 tokens; at prefill sizes (64-256
tokens per expert) that decode, not the tensor cores, is the limit. This kernel decodes each weight tile
once per BLOCK_N = 64..256 tokens of one expert and runs it on `wgmma.mma_async` (m64 nBLOCK_N k16):
  A (the weights, M side): one warpgroup holds 64 weight rows, 16 per warp. Per warp the wgmma A
    register fragment IS the mma.sync m16n8k16 A fragment, so the codes come in the same load-time
    layout as for the decode kernel (nvfp4_layout.py, one layout for both) and are decoded with its
    inline PTX (nvfp4_mma.DECODE_ASM); the regrouping into the operand layout is asserted trivial.
  B (the expert's gathered token activations, N side): in shared memory (NVMMA 128-byte swizzle),
    filled by cp.async from the gathered rows (TMA cannot gather rows on sm_90).
  The codes and scales of a K step travel in the same cp.async ring (STAGES deep) and are read back
  by the thread that copied them (LDS.128 of raw codes), so one pipeline hides the HBM latency of both
  operands. Schedules (`mode`, MODES): "rs" (default) feeds the decoded weights to wgmma as its register
  A operand (they never touch shared memory); a step's wgmmas run back to back and are waited on before
  the next decode (one in flight across steps makes ptxas serialize them all, C7515), so only the other
  CTAs of the SM overlap a CTA's decode with MMAs. "ss" stores the decoded tile to shared memory
  (stmatrix, double-buffered) and reads both operands there, so the next step's decode runs under the
  in-flight wgmmas (the sm_90 compile test checks it): measured 25-30 % slower on the H200 (shared-memory
  traffic of A + B reads, A writes; round 2 of benchmarks/results/kernels/moe/prefill_wgmma/).
K order: lane t's code words hold the k = 16 t + 4 j + 2 cb + h of each 64 (the packed layout, chosen for the
decode kernel's register B operand), but a wgmma register fragment means k = 2t, 2t + 1, 2t + 8, 2t + 9 of
each 16, and shared-memory B is read in natural k order. So the activations are stored k-permuted within
every 64 k (`permute_k`, one Triton copy on the GPU): the gate_up input is permuted once per call, and the gate_up
epilogue writes its output h already in that order for the down GEMM.
Adaptive width (`sub_log`, off by default: measured slower): expert blocks of 64 << sub_log slots, each run as one
tile of wgmma N = 64 x its valid sub-blocks (rounded up to a power of two); one compiled tile per width.
Epilogues: gate_up (gate and up rows interleaved per 16-row tile, so one thread holds both) writes
SiLU(gate) * up in bf16; down multiplies by the row scale and routing weight and writes per-pair partials
[pairs, H] (bf16 by default, experts.WGMMA_BF16_PARTIALS, or f32) that grouped_gemm.sum_reduce adds in f32 per
token in a fixed order: no atomics, bitwise reproducible, CUDA-graph capturable (no host reads of device values).
Gluon kernels do not run under TRITON_INTERPRET; `available()` says whether this path can run.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from linrnn_kernels.moe import nvfp4_layout as lay
from linrnn_kernels.moe import nvfp4_mma

if nvfp4_mma.HAVE_GLUON:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma,
                                                                  warpgroup_mma_wait)
    # triton 3.6 names the CTA barrier thread_barrier, 3.9 barrier
    _cta_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
    # and the cp.async copy async_copy_global_to_shared, 3.9 async_load
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

BLOCK_NS = (64, 128, 256)  # tokens per expert block (wgmma N). 16 / 32-token blocks at decode batches: measured
# slower than the MMA-fragment kernel's layer (benchmarks/results/kernels/moe/round7/)
# The default tile, measured on the H200 (benchmarks/results/kernels/moe/prefill_wgmma/): 64 tokens per expert
# block (128 / 256 waste more MMA work on padding and were slower at every size up to 8192 tokens), two
# warpgroups (128 weight rows) per CTA sharing each activation tile, 2 units (128 k) per K step, 4 stages
DEFAULT_BLOCK_N = 64
DEFAULT_STAGES = 4
DEFAULT_WARPS = 8
DEFAULT_UNITS = 2
# Adaptive width (sub_log): expert blocks of 64 << sub_log slots, each run as one tile whose wgmma N covers its valid
# 64-slot sub-blocks, so a decoded weight tile serves up to 128 / 256 tokens with 64-granular padding. Bit-identical
# to the 64 tile, but slower at every measured size (H200, benchmarks/results/kernels/moe-prefill/round3/: 2048 /
# 8192 tokens 473 / 1386 us default vs 542 / 1471 at sub_log 1 w8 u1 s4, 745-792 / 1629-1664 at sub_log 2): the
# kernel takes the widest branch's registers (126-255 vs 105), fewer CTAs per SM overlap decode with MMAs. Off.
DEFAULT_SUB_LOG = 0
# K loop schedules: "rs" decode -> wgmma on the register operand -> wait (only other CTAs on the SM overlap a CTA's
# decode with MMAs); "ss" the decoded tile stored to shared memory (double-buffered) and both wgmma operands read
# there, so the next step's decode runs under the in-flight wgmmas. Issuing the next decode between a register-operand
# wgmma and its wait (tried) does not overlap: ptxas sinks the pure decode below the wait (0 decode ops under the
# MMA in the sm_90 SASS), the shared-memory store ahead of the wait is what keeps it there.
MODES = ("rs", "ss")
DEFAULT_MODE = "rs"


def permute_k(x: torch.Tensor, kernel: bool | None = None) -> torch.Tensor:
    """Activations [T, K] -> the wgmma kernel's k order (a new contiguous tensor): within every 64 k,
    the value of k = 16 t + 8 p + 4 q + 2 cb + h goes to 32 cb + 16 p + 8 q + 2 t + h (K a multiple of 64).
    kernel (default: on CUDA tensors): one Triton copy at copy bandwidth (torch's copy of the 7-D permuted view
    is a strided elementwise kernel, several times slower at prefill sizes); else torch."""
    T, K = x.shape
    if K % 64:
        raise ValueError(f"permute_k needs K % 64 == 0, got K={K}")
    if not (x.is_cuda if kernel is None else kernel):
        return x.reshape(T, K // 64, 4, 2, 2, 2, 2).permute(0, 1, 5, 3, 4, 2, 6).reshape(T, K)
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty(T, K, dtype=x.dtype, device=x.device)
    block_k = 256 if K % 256 == 0 else 64
    _permute_k_kernel[(triton.cdiv(T, _PERMUTE_ROWS), K // block_k)](
        x, x.stride(0), out, T, BLOCK_T=_PERMUTE_ROWS, BLOCK_K=block_k, num_warps=4)
    return out


_PERMUTE_ROWS = 16


@triton.jit
def _permute_k_kernel(x_ptr, stride_x, out_ptr, T, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, d] = x[t, src(d)]: stores contiguous, loads gathered within each 64-k group (the same 128-byte lines)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    r = d % 64  # = 32 cb + 16 p + 8 q + 2 t + h
    src = (d - r) + ((r // 2) % 4) * 16 + ((r // 16) % 2) * 8 + ((r // 8) % 2) * 4 + (r // 32) * 2 + r % 2
    ok = (rows < T)[:, None]
    v = tl.load(x_ptr + rows.to(tl.int64)[:, None] * stride_x + src[None, :], mask=ok)
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * (tl.num_programs(1) * BLOCK_K) + d[None, :], v, mask=ok)


def unpermute_k(x: torch.Tensor) -> torch.Tensor:
    T, K = x.shape
    return x.reshape(T, K // 64, 2, 2, 2, 4, 2).permute(0, 1, 5, 3, 4, 2, 6).reshape(T, K)


if nvfp4_mma.HAVE_GLUON:
    @gluon.jit
    def _stage_decode(j, n_steps, x_smem, c_smem, s_smem, x_ptrs, x_mask, c_ptrs, s_ptrs, sel, a_op: gl.constexpr,
                      raw: gl.constexpr, sraw: gl.constexpr, STAGES: gl.constexpr, UNITS: gl.constexpr,
                      WARPS: gl.constexpr, ROWS: gl.constexpr, BK: gl.constexpr, DECODE: gl.constexpr,
                      CONSTRAINTS: gl.constexpr, PROXY_FENCE: gl.constexpr):
        """K step j's operands: wait for its ring stage, refill the ring STAGES - 2 steps ahead, decode its codes in
        registers into the wgmma A operand, one [ROWS, 64] per unit (returned as a pair; a1 = a0 at 1 unit)."""
        # step j landed (this thread's copies), then every thread's; every warp is past the wgmma wait that
        # retires step j - 2 (and j - 1 in mode "rs"), so stage (j - 2) % STAGES is free to refill
        async_copy.wait_group(STAGES - 3)
        if PROXY_FENCE:  # cp.async writes are generic-proxy, wgmma reads B through the async proxy
            fence_async_shared()
        _cta_barrier()
        nxt = gl.minimum(j + STAGES - 2, n_steps - 1)  # past the end: reload the last step (unused)
        st = (j + STAGES - 2) % STAGES
        for u in gl.static_range(UNITS):
            _cp_async(x_smem.index(st * UNITS + u), x_ptrs + (nxt * UNITS + u) * BK, mask=x_mask)
        _cp_async(c_smem.index(st), c_ptrs + nxt * UNITS * 128)
        _cp_async(s_smem.index(st), s_ptrs + nxt * UNITS * 16)
        async_copy.commit_group()

        cur = j % STAGES
        q = c_smem.index(cur).load(raw)
        sw = s_smem.index(cur).load(sraw)
        # the wgmma fragment's k order within 64 k is (cb, p, q, t, h) (see permute_k)
        wts = nvfp4_mma.decode_codes(q, sw, sel, DECODE, CONSTRAINTS, WARPS, UNITS)
        wts = gl.permute(wts, [0, 5, 2, 1, 4, 7, 8, 3, 6])  # row = (w, r8, g); k = (u, cb, p, q, t, h)
        if UNITS == 1:
            a0 = gl.convert_layout(gl.reshape(wts, [ROWS, BK]), a_op, assert_trivial=True)
            a1 = a0
        else:  # UNITS == 2: one [ROWS, 64] operand per unit (a register split, no data movement)
            wu = gl.permute(gl.reshape(wts, [ROWS, 2, BK]), [0, 2, 1])
            w0, w1 = gl.split(wu)
            a0 = gl.convert_layout(w0, a_op, assert_trivial=True)
            a1 = gl.convert_layout(w1, a_op, assert_trivial=True)
        return a0, a1

    @gluon.jit
    def _store_a(j, a0, a1, a_smem, UNITS: gl.constexpr):
        """K step j's decoded weights into A buffer j % 2 (one [ROWS, 64] tile per unit)."""
        buf = (j % 2) * UNITS
        a_smem.index(buf).store(a0)
        if UNITS == 2:
            a_smem.index(buf + 1).store(a1)

    @gluon.jit
    def _issue_smem(j, acc, a_smem, x_smem, STAGES: gl.constexpr, UNITS: gl.constexpr):
        """K step j's wgmmas on A buffer j % 2 and the step's activation tiles (async; the caller waits)."""
        buf = (j % 2) * UNITS
        cur = j % STAGES
        acc = warpgroup_mma(a_smem.index(buf), x_smem.index(cur * UNITS).permute((1, 0)), acc, is_async=True)
        if UNITS == 2:
            acc = warpgroup_mma(a_smem.index(buf + 1), x_smem.index(cur * 2 + 1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _issue(j, a0, a1, acc, x_smem, STAGES: gl.constexpr, UNITS: gl.constexpr):
        """K step j's wgmmas (async; the caller waits) on the decoded operands and the step's activation tiles."""
        cur = j % STAGES
        if UNITS == 1:
            acc = warpgroup_mma(a0, x_smem.index(cur).permute((1, 0)), acc, is_async=True)
        else:
            acc = warpgroup_mma(a0, x_smem.index(cur * 2).permute((1, 0)), acc, is_async=True)
            acc = warpgroup_mma(a1, x_smem.index(cur * 2 + 1).permute((1, 0)), acc, is_async=True)
        return acc

    @gluon.jit
    def _nvfp4_wgmma_kernel(
            x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_om,
            sorted_ids_ptr, expert_ids_ptr, route_w_ptr,
            num_rows, N, k_units, num_row_tiles, stride_ce, stride_se, stride_rse,
            A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, ROUTE_WEIGHTED: gl.constexpr,
            BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr,
            GAIN: gl.constexpr, WARPS: gl.constexpr, UNITS: gl.constexpr, PROXY_FENCE: gl.constexpr,
            A_SMEM: gl.constexpr, SUB_LOG: gl.constexpr):
        """One CTA: ROWS weight rows x one expert block of BLOCK_N << SUB_LOG token slots. SUB_LOG > 0 (adaptive
        width): the block's valid BLOCK_N-slot sub-blocks form a prefix (an expert's pairs come before its padding),
        and the tile runs with wgmma N = BLOCK_N x their count rounded up to a power of two, so a weight tile is
        decoded once per up to BLOCK_N << SUB_LOG tokens while all-padding sub-blocks cost nothing."""
        pid = gl.program_id(0)
        pid_n = pid % num_row_tiles     # the row tiles of one token block run together (activations in L2)
        pid_m = pid // num_row_tiles
        expert = gl.load(expert_ids_ptr + pid_m)
        if expert < 0:
            return
        expert = expert.to(gl.int64)
        slot0 = pid_m * (BLOCK_N << SUB_LOG)
        nsub = 1  # valid sub-blocks
        for s in gl.static_range(1, 1 << SUB_LOG):
            nsub += (gl.load(sorted_ids_ptr + slot0 + s * BLOCK_N) < num_rows).to(gl.int32)
        wlog = (nsub > 1).to(gl.int32) + (nsub > 2).to(gl.int32)  # log2 of the width in sub-blocks (3 -> 4)
        for lg in gl.static_range(SUB_LOG + 1):
            if wlog == lg:
                _tile(x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_om, sorted_ids_ptr, route_w_ptr,
                      num_rows, N, k_units, stride_ce, stride_se, stride_rse, pid_n, expert, slot0,
                      A_ROW_DIV, GATED, ROUTE_WEIGHTED, BLOCK_N << lg, STAGES, DECODE, CONSTRAINTS, GAIN, WARPS,
                      UNITS, PROXY_FENCE, A_SMEM)

    @gluon.jit
    def _tile(x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_om, sorted_ids_ptr, route_w_ptr,
              num_rows, N, k_units, stride_ce, stride_se, stride_rse, pid_n, expert, slot0,
              A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, ROUTE_WEIGHTED: gl.constexpr,
              BLOCK_N: gl.constexpr, STAGES: gl.constexpr, DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr,
              GAIN: gl.constexpr, WARPS: gl.constexpr, UNITS: gl.constexpr, PROXY_FENCE: gl.constexpr,
              A_SMEM: gl.constexpr):
        """ROWS weight rows x the BLOCK_N token slots from slot0 of the expert's block (the whole K loop and epilogue)."""
        ROWS: gl.constexpr = 16 * WARPS  # 64 weight rows per warpgroup; the warpgroups share the B tile
        BK: gl.constexpr = 64            # k per shared-memory activation tile (one unit of the packed layout)
        acc_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                        instr_shape=[16, BLOCK_N, 16])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_l, k_width=2)
        # raw code words as copied and read back: [warp, unit, lane, 4 int32], 16 bytes per lane
        raw: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                             warps_per_cta=[WARPS, 1, 1, 1], order=[3, 2, 1, 0])
        sraw: gl.constexpr = gl.SliceLayout(3, raw)
        # activation tile [BLOCK_N, BK] as copied: 16 bytes per lane, a row's 128 bytes over 8 lanes
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 8], threads_per_warp=[4, 8],
                                            warps_per_cta=[WARPS, 1], order=[1, 0])
        x_sl: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
        c_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=1, order=[3, 2, 1, 0])
        s_sl: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[2, 1, 0])

        # gathered activation rows of this block; padding slots copy nothing (zero-filled, their columns are
        # never stored): with few tokens per expert most slots are padding, and reading one row for all of
        # them makes every CTA hammer the same L2 lines
        offs_xn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, xl))
        ids_x = gl.load(sorted_ids_ptr + slot0 + offs_xn)
        x_ok = ids_x < num_rows
        x_rows = gl.where(x_ok, ids_x // A_ROW_DIV, 0).to(gl.int64)
        offs_xk = gl.arange(0, BK, layout=gl.SliceLayout(0, xl))
        x_ptrs = x_ptr + x_rows[:, None] * stride_x + offs_xk[None, :]
        x_mask = gl.broadcast(x_ok[:, None], x_ptrs)[0]

        tile0 = pid_n * WARPS
        unit0 = tile0.to(gl.int64) * k_units
        offs_w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, raw))))
        offs_u = gl.arange(0, UNITS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, raw))))
        offs_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, raw))))
        offs_e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, raw))))
        c_ptrs = (codes_ptr + expert * stride_ce + unit0 * 128
                  + ((offs_w[:, None, None, None] * k_units + offs_u[None, :, None, None]) * 128
                     + offs_l[None, None, :, None] * 4 + offs_e[None, None, None, :]))
        so_w = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, sraw)))
        so_u = gl.arange(0, UNITS, layout=gl.SliceLayout(0, gl.SliceLayout(2, sraw)))
        so_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, sraw)))
        s_ptrs = (scales_ptr + expert * stride_se + unit0 * 16
                  + ((so_w[:, None, None] * k_units + so_u[None, :, None]) * 16 + (so_l // 2)[None, None, :]))
        sel = nvfp4_mma.scale_selector(so_l)[None, None, :]

        # a K step is UNITS units of 64 k: activation tiles [BLOCK_N, 64] (one per unit), codes, scales
        x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES * UNITS, BLOCK_N, BK], x_sl)
        c_smem = gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, UNITS, 32, 4], c_sl)
        s_smem = gl.allocate_shared_memory(gl.int32, [STAGES, WARPS, UNITS, 32], s_sl)
        n_steps = k_units // UNITS

        # prologue: K steps 0 .. STAGES - 3 in flight; a K shorter than that reloads its last step (unused),
        # as the loop does past the end: reading ahead would leave the activation rows / code tiles
        # (an illegal address at K = 128 with 2 units per step, the default model's down GEMM)
        for s in gl.static_range(STAGES - 2):
            ks = gl.minimum(n_steps - 1, s)
            for u in gl.static_range(UNITS):
                _cp_async(x_smem.index(s * UNITS + u), x_ptrs + (ks * UNITS + u) * BK, mask=x_mask)
            _cp_async(c_smem.index(s), c_ptrs + ks * UNITS * 128)
            _cp_async(s_smem.index(s), s_ptrs + ks * UNITS * 16)
            async_copy.commit_group()

        acc = gl.zeros([ROWS, BLOCK_N], gl.float32, layout=acc_l)
        if A_SMEM:
            # the decoded weights go through shared memory (wgmma reads A and B there), double-buffered: step i is
            # decoded and stored while step i - 1's wgmmas run. (With register A operands ptxas sinks the next decode
            # below the wgmma wait; a shared-memory store ahead of the wait keeps it there.)
            a_smem = gl.allocate_shared_memory(gl.bfloat16, [2 * UNITS, ROWS, BK], x_sl)
            a0, a1 = _stage_decode(0, n_steps, x_smem, c_smem, s_smem, x_ptrs, x_mask, c_ptrs, s_ptrs, sel, a_op,
                                   raw, sraw, STAGES, UNITS, WARPS, ROWS, BK, DECODE, CONSTRAINTS, PROXY_FENCE)
            _store_a(0, a0, a1, a_smem, UNITS)
            fence_async_shared()
            _cta_barrier()
            tok = _issue_smem(0, acc, a_smem, x_smem, STAGES, UNITS)
            for i in range(1, n_steps):
                a0, a1 = _stage_decode(i, n_steps, x_smem, c_smem, s_smem, x_ptrs, x_mask, c_ptrs, s_ptrs, sel,
                                       a_op, raw, sraw, STAGES, UNITS, WARPS, ROWS, BK, DECODE, CONSTRAINTS,
                                       PROXY_FENCE)
                _store_a(i, a0, a1, a_smem, UNITS)  # the other buffer than step i - 1's in-flight wgmmas read
                acc = warpgroup_mma_wait(0, deps=[tok])
                fence_async_shared()
                _cta_barrier()
                tok = _issue_smem(i, acc, a_smem, x_smem, STAGES, UNITS)
            acc = warpgroup_mma_wait(0, deps=[tok])
        else:
            for i in range(n_steps):
                a0, a1 = _stage_decode(i, n_steps, x_smem, c_smem, s_smem, x_ptrs, x_mask, c_ptrs, s_ptrs, sel,
                                       a_op, raw, sraw, STAGES, UNITS, WARPS, ROWS, BK, DECODE, CONSTRAINTS,
                                       PROXY_FENCE)
                acc = _issue(i, a0, a1, acc, x_smem, STAGES, UNITS)
                # wait for this step's wgmma before the next decode: the decode of one CTA overlaps the MMAs of
                # the other CTAs on the SM
                acc = warpgroup_mma_wait(0, deps=[acc])
        async_copy.wait_group(0)

        # epilogue: rows of this CTA in the accumulator layout
        offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, acc_l))
        offs_t = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_l))
        tile = tile0 + offs_r // 16
        r8 = (offs_r // 8) % 2
        g = offs_r % 8
        if GATED:
            half = N // 2
            w_row = r8 * half + tile * 8 + g
            row_ok = tile * 8 + g < half
        else:
            w_row = tile * 16 + r8 * 8 + g
            row_ok = w_row < N
        rs = gl.load(rs_ptr + expert * stride_rse + w_row, mask=row_ok, other=0.0)
        acc = acc * (rs * GAIN)[:, None]
        if GATED:
            # [w, r8, g, n] -> gate (r8 = 0) and up (r8 = 1) of the same (g, n) in one thread
            acc4 = gl.permute(gl.reshape(acc, [WARPS, 2, 8, BLOCK_N]), [0, 2, 3, 1])
            gate, up = gl.split(acc4)
            h = gate / (1.0 + gl.exp(-gate)) * up
            hl: gl.constexpr = gate.type.layout
            hw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
            hg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
            hn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
            col = (tile0 + hw)[:, None] * 8 + hg[None, :]
            # stored in the down GEMM's k order (permute_k): col = 64 c + 16 t + 8 p + 4 q + 2 cb + h
            pos = ((col // 64) * 64 + ((col // 2) % 2) * 32 + ((col // 8) % 2) * 16 + ((col // 4) % 2) * 8
                   + ((col // 16) % 4) * 2 + col % 2)
            hids = gl.load(sorted_ids_ptr + slot0 + hn)
            hok = (col < half)[:, :, None] & (hids < num_rows)[None, None, :]
            gl.store(out_ptr + hids.to(gl.int64)[None, None, :] * stride_om + pos[:, :, None],
                     h.to(out_ptr.dtype.element_ty), mask=hok)
        else:
            ids = gl.load(sorted_ids_ptr + slot0 + offs_t)
            tok_ok = ids < num_rows
            if ROUTE_WEIGHTED:
                acc = acc * gl.load(route_w_ptr + ids, mask=tok_ok, other=0.0).to(gl.float32)[None, :]
            gl.store(out_ptr + ids.to(gl.int64)[None, :] * stride_om + w_row[:, None],
                     acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])


def available(device=None) -> bool:
    """Whether the wgmma prefill path can run: the MMA path's conditions (Gluon, sm_90, not the
    interpreter, LINRNN_NVFP4_GEMM auto / mma) and not switched off by LINRNN_NVFP4_WGMMA=0."""
    return nvfp4_mma.available(device) and os.environ.get("LINRNN_NVFP4_WGMMA", "1") != "0"


def supports(w: lay.PackedNvfp4, warps: int = DEFAULT_WARPS) -> bool:
    """Shapes this kernel takes: K a multiple of 64 (no k padding: the activations are read unmasked)
    and whole CTA row tiles (`warps` packed tiles of 16 rows)."""
    E, T, U, _ = w.codes.shape
    return w.k == U * 64 and T % warps == 0 and lay.has_slack(w.codes) and lay.has_slack(w.scales)


def launch(x: torch.Tensor, w: lay.PackedNvfp4, out: torch.Tensor, *, num_rows: int, num_m_blocks: int,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block_n: int, route_weights=None,
           a_row_div: int = 1, stages: int = DEFAULT_STAGES, warps: int = DEFAULT_WARPS, units: int = DEFAULT_UNITS,
           proxy_fence: bool = True, mode: str = DEFAULT_MODE, sub_log: int = DEFAULT_SUB_LOG):
    """One grouped GEMM over expert blocks of `block_n << sub_log` tokens (align.py with that block_m); sub_log > 0:
    each block runs as one tile of wgmma N = block_n x its valid sub-blocks (rounded up to a power of two).
    x: activations in permute_k order. out: gated: [rows, N/2] bf16 SiLU(gate) * up in permute_k order;
    else f32 [rows, N] (times the routing weight if given), natural column order."""
    E, T, U, _ = w.codes.shape
    if not supports(w, warps):
        raise ValueError(f"nvfp4_wgmma needs K % 64 == 0 and rows in {16 * warps}-row tiles (k={w.k}, tiles={T})")
    if (block_n not in BLOCK_NS or stages < 3 or warps not in (4, 8, 16) or 4 * warps > block_n
            or units not in (1, 2) or U % units or mode not in MODES or sub_log not in (0, 1, 2)
            or block_n << sub_log > 256):
        raise ValueError(f"block_n {block_n} not in {BLOCK_NS}, stages {stages} < 3, warps {warps} not 4 / 8 / 16 "
                         f"(at most block_n / 4), units {units} not 1 / 2 dividing the k units {U} "
                         f"or mode {mode!r} not in {MODES}, or sub_log {sub_log} not 0-2 with block_n << sub_log "
                         f"<= 256 (the wgmma N limit)")
    tiles = T // warps
    grid = (num_m_blocks * tiles,)
    _nvfp4_wgmma_kernel[grid](
        x, x.stride(0), w.codes, w.scales.view(torch.int32), w.row_scale, out, out.stride(0),
        sorted_ids, expert_ids, route_weights if route_weights is not None else out,
        num_rows, w.n, U, tiles, w.codes.stride(0), w.scales.view(torch.int32).stride(0),
        w.row_scale.stride(0),
        A_ROW_DIV=a_row_div, GATED=w.gated, ROUTE_WEIGHTED=route_weights is not None, BLOCK_N=block_n,
        STAGES=stages, DECODE=nvfp4_mma.DECODE_ASM, CONSTRAINTS=nvfp4_mma.DECODE_CONSTRAINTS,
        GAIN=lay.DECODE_GAIN, WARPS=warps, UNITS=units, PROXY_FENCE=proxy_fence,
        A_SMEM=mode == "ss", SUB_LOG=sub_log, num_warps=warps)


# ---------------------------------------------------------------------------------------------
# Offline compilation (tests, benchmark tables): SASS of the kernel for sm_90 without a GPU

def compile_offline(gated: bool = True, block_n: int = 128, stages: int = DEFAULT_STAGES, warps: int = 4,
                    units: int = 1, arch: int = 90, mode: str = DEFAULT_MODE, sub_log: int = 0):
    """triton.compile the kernel for sm_<arch> (no GPU needed); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    sig = {"x_ptr": "*bf16", "stride_x": "i32", "codes_ptr": "*i32", "scales_ptr": "*i32", "rs_ptr": "*fp32",
           "out_ptr": "*bf16" if gated else "*fp32", "stride_om": "i32",
           "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "route_w_ptr": "*bf16",
           "num_rows": "i32", "N": "i32", "k_units": "i32", "num_row_tiles": "i32",
           "stride_ce": "i64", "stride_se": "i64", "stride_rse": "i64"}
    consts = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, ROUTE_WEIGHTED=not gated, BLOCK_N=block_n,
                  STAGES=stages, DECODE=nvfp4_mma.DECODE_ASM, CONSTRAINTS=nvfp4_mma.DECODE_CONSTRAINTS,
                  GAIN=lay.DECODE_GAIN, WARPS=warps, UNITS=units, PROXY_FENCE=True,
                  A_SMEM=mode == "ss", SUB_LOG=sub_log)
    for k in consts:
        sig[k] = "constexpr"
    div16 = {"x_ptr", "stride_x", "codes_ptr", "scales_ptr", "rs_ptr", "out_ptr", "stride_om", "sorted_ids_ptr",
             "expert_ids_ptr", "route_w_ptr", "N", "stride_ce", "stride_se", "stride_rse"}
    names = list(_nvfp4_wgmma_kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = gluon._runtime.GluonASTSource(fn=_nvfp4_wgmma_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})


@functools.lru_cache(maxsize=None)
def k_loop_stats(gated: bool = True, block_n: int = 128, stages: int = DEFAULT_STAGES, warps: int = 4,
                 units: int = 1, arch: int = 90, mode: str = DEFAULT_MODE, sub_log: int = 0) -> dict:
    """SASS statistics of the K loop compiled for sm_<arch> (no GPU needed): instructions per
    iteration and per weight (a thread decodes 64 rows x 64 k / 128 threads = 32 weights a step),
    opcode counts, shared-memory stores in the loop (decoded weights would need STS / STSM), shared
    loads, spills, registers and shared memory. Compiles in a clean process under TRITON_INTERPRET."""
    args = dict(gated=gated, block_n=block_n, stages=stages, warps=warps, units=units, arch=arch, mode=mode,
                sub_log=sub_log)
    if os.environ.get("TRITON_INTERPRET") == "1":
        return nvfp4_mma.in_clean_process(__name__, "k_loop_stats", **args)
    k = compile_offline(**args)
    return _loop_stats(k, weights_per_iter=32 * units)


def _loop_stats(k, weights_per_iter: int) -> dict:
    st = nvfp4_mma.sass_loop_stats(k, "HGMMA", weights_per_iter)
    st["smem_stores_in_loop"] = sum(v for o, v in st["ops"].items() if o in ("STS", "STSM"))
    # convert_layout ops left in the kernel (the weight path's is asserted trivial and folds away)
    st["convert_layouts"] = k.asm["ttgir"].count("ttg.convert_layout")
    # wgmma shapes anywhere in the kernel (the adaptive width compiles one tile per width)
    import re
    st["hgmma_shapes"] = sorted(set(re.findall(r"HGMMA\.(64x\d+)x16", nvfp4_mma._sass(k.asm["cubin"]))))
    return st


if __name__ == "__main__":  # nvfp4_mma.in_clean_process: python -m linrnn_kernels.moe.nvfp4_wgmma k_loop_stats '{}'
    import json
    import sys

    print(json.dumps(globals()[sys.argv[1]](**json.loads(sys.argv[2]))))
