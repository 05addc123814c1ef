"""Skinny GEMM / split-K GEMV for decode-sized batches (M <= 32 rows): y = prologue(x) W^T -> epilogue,
one launch (kernels/gemv/naive.py defines every option as the chain of separate ops it replaces).

Grid (N tiles, splits): each program streams BLOCK_N weight rows (2 x BLOCK_N with the silu_mul
epilogue: gate row n and up row N + n) over its K slice with 16-byte loads, evicted first (weights
are read once per step). Two inner loops (_gemm_tile):
  FMA (rows <= 8): the [M, BLOCK_N, BLOCK_K] products accumulate elementwise in the weight tile's own
      layout, reduced over K once after the loop, with the next weight tile already loading. (The first
      version reduced a 3-D product every step: Triton moved every weight tile through shared memory
      into a one-element-per-thread layout, 20 us per call on the H200.)
  dot (rows padded to 16): tl.dot on the tensor cores, software-pipelined loads (num_stages).
  ONE_SHOT (either path; config one_shot): a program's K slice is a single tile: its whole weight slice (8-64 KB)
      is loaded before the PDL wait, then one product, no K loop (the whole matrix in flight at once).
split_prologue (config): the gated-norm / sigmoid-gate prologue as its own launch (_prologue_kernel, PDL) and the
GEMM without it: at 4-8 rows the prologue recomputed by every N tile cost more than the launch (H200, round 5).
With splits > 1 the f32 partials go to a workspace and the last program of each N tile (an atomic
ticket, reset to 0 by that program so a captured graph can replay) sums them in split order 0, 1, ...
(unrolled: all partial loads in flight together): the result does not depend on which program finishes
last, so it is bit-reproducible. The row-norm epilogue (the next RMSNorm needs a whole row): each tile
stores its share of the rows' sums of squares, a second ticket elects the last tile, which adds the
shares in a fixed order (tree sums of 2048 / rows tiles at a time) and normalises the live rows in one
pass over h. The conv epilogue reads the whole conv state of its columns before any thread shifts it (a
CTA barrier between).

Weights: bf16/f16/f32 ("dense") or FP8 E4M3 with a per-row f32 scale (per-tensor scales are stored
broadcast per row, layers/quant.py). Activations bf16/f16/f32; accumulation f32; every intermediate
the unfused chain rounds to the activation dtype is rounded here too.

Memory ordering of the tickets: all threads' stores, a CTA barrier, then one acq_rel atomic at GPU
scope (release); the winner reads the partials through L2 (`.cg`) after its acquire.

Programmatic dependent launch (PDL constexpr, config.pdl_launch_kwargs: on by default on sm_90+): each launch
first lets the next kernel launch (griddepcontrol.launch_dependents); its own programs issue their first
weight tiles (FMA path) and then wait for the previous kernel (griddepcontrol.wait) before reading anything a
kernel writes (activations, gates, residual, partials, conv state, tickets). Weights are never written by a
kernel, so loading them early is safe, and it overlaps this kernel's DRAM ramp with the previous one's tail
(split / row-norm tickets). Nothing of a later kernel runs before the earlier one has completed: each waiting
program has passed its wait only after the previous grid finished, so the ordering is transitive.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

try:  # grid dependency control (programmatic dependent launch): triton >= 3.4
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - PDL is then reported unavailable (config.pdl_available)
    gdc_launch_dependents = gdc_wait = None

from linrnn_kernels.gemv.config import pdl_launch_kwargs

PROLOGUES = {"none": 0, "rmsnorm": 1, "gated_norm": 2, "sigmoid_gate": 3}
EPILOGUES = {"none": 0, "silu_mul": 1, "gate_add": 2, "conv": 3}
TICKETS = 1 << 16  # counters per device; a split-K or row-norm launch uses (N tiles + 1) of them


@triton.jit
def _round(v, ACT: tl.constexpr):
    return v.to(ACT).to(tl.float32)


@triton.jit
def _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, cols, m_ok, k_ok, rstd, pro_eps,
            PRO: tl.constexpr, HEAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
            ACT: tl.constexpr):
    """The activation tile [BLOCK_M, BLOCK_K] after the prologue, as f32 values of the activation dtype."""
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rows[:, None] * sx + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    gcols = (cols // HEAD) * sgh + cols % HEAD  # the gate may be a per-head strided view ([T, H, HEAD])
    if PRO == 1:  # zero-centred RMSNorm over the whole row (rstd computed before the K loop)
        w = tl.load(pw_ptr + cols, mask=k_ok, other=0.0).to(tl.float32)
        x = _round(x * rstd[:, None] * (1.0 + w[None, :]), ACT)
    elif PRO == 2:  # gated RMSNorm per head of HEAD columns (BLOCK_K is a multiple of HEAD)
        z = tl.load(g_ptr + rows[:, None] * sg + gcols[None, :], mask=mask, other=0.0).to(tl.float32)
        xh = tl.reshape(x, (BLOCK_M, BLOCK_K // HEAD, HEAD))
        ms = tl.sum(xh * xh, axis=2) / HEAD
        n = _round(xh / tl.sqrt(ms + pro_eps)[:, :, None], ACT)
        w = tl.load(pw_ptr + (cols % HEAD), mask=k_ok, other=0.0).to(tl.float32)
        wn = _round(tl.reshape(w, (1, BLOCK_K // HEAD, HEAD)) * n, ACT)
        x = _round(tl.reshape(wn, (BLOCK_M, BLOCK_K)) * (z / (1.0 + tl.exp(-z))), ACT)
    elif PRO == 3:  # x * sigmoid(gate), both products rounded as two bf16 torch ops
        g = tl.load(g_ptr + rows[:, None] * sg + gcols[None, :], mask=mask, other=0.0).to(tl.float32)
        x = _round(x * _round(1.0 / (1.0 + tl.exp(-g)), ACT), ACT)
    return x


@triton.jit
def _mac(acc, a, w, COMPUTE: tl.constexpr):
    """acc += a w^T on the tensor cores (a [BLOCK_M >= 16, BLOCK_K], w [BLOCK_N, BLOCK_K])."""
    if COMPUTE == tl.float32:  # f32 models must not drop to TF32 (the interpreter computes in f32 too)
        return tl.dot(a, tl.trans(w.to(tl.float32)), acc, input_precision="ieee", out_dtype=tl.float32)
    return tl.dot(a.to(COMPUTE), tl.trans(w.to(COMPUTE)), acc, out_dtype=tl.float32)


@triton.jit
def _gemm_tile(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, w_ptr, sw, rows, m_ok, offs_n, n_ok, k_lo, k_hi, N, rstd,
               pro_eps, PRO: tl.constexpr, GATED: tl.constexpr, HEAD: tl.constexpr, USE_DOT: tl.constexpr,
               COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, PDL: tl.constexpr, ONE_SHOT: tl.constexpr = False):
    """(acc, acc_u) [BLOCK_M, BLOCK_N] f32: prologue(x)[:, k_lo:k_hi] W[offs_n]^T, and with GATED the same for
    the up rows W[N + offs_n] (acc_u; zeros otherwise). PDL: waits for the previous kernel (gdc_wait) before
    the first read of anything it may write; the FMA path issues its first weight tiles before that wait.
    ONE_SHOT (the K slice is one tile, k_hi - k_lo <= BLOCK_K): no K loop; the program's whole weight slice is
    loaded before the wait, then one product (FMA: reduced over K once; dot: one tl.dot)."""
    ACT: tl.constexpr = x_ptr.dtype.element_ty
    offs_k = tl.arange(0, BLOCK_K)
    if ONE_SHOT:
        cols = k_lo + offs_k
        if EVEN_K:  # uniform mask along K: keeps the 16-byte vector loads
            k_ok = offs_k < BLOCK_K
        else:
            k_ok = cols < k_hi
        if USE_DOT:
            w_rows = offs_n.to(tl.int64) * sw
            wmask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=wmask, other=0.0, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(w_ptr + (w_rows + N * sw)[:, None] + cols[None, :], mask=wmask, other=0.0,
                             eviction_policy="evict_first")
            if PDL:
                gdc_wait()
            a = _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, cols, m_ok, k_ok, rstd, pro_eps,
                        PRO, HEAD, BLOCK_M, BLOCK_K, ACT)
            acc = _mac(tl.zeros((BLOCK_M, BLOCK_N), tl.float32), a, w, COMPUTE)
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            if GATED:
                acc_u = _mac(acc_u, a, wu, COMPUTE)
        else:
            w3 = w_ptr + (offs_n.to(tl.int64) * sw)[None, :, None] + cols[None, None, :]
            wmask = n_ok[None, :, None] & k_ok[None, None, :]
            w = tl.load(w3, mask=wmask, other=0.0, eviction_policy="evict_first")
            if GATED:
                wu = tl.load(w3 + N * sw, mask=wmask, other=0.0, eviction_policy="evict_first")
            if PDL:
                gdc_wait()
            a = _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, cols, m_ok, k_ok, rstd, pro_eps,
                        PRO, HEAD, BLOCK_M, BLOCK_K, ACT)[:, None, :]
            acc = tl.sum(a * w.to(tl.float32), axis=2)
            if GATED:
                acc_u = tl.sum(a * wu.to(tl.float32), axis=2)
            else:
                acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    elif USE_DOT:
        if PDL:
            gdc_wait()
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        w_rows = offs_n.to(tl.int64) * sw
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + offs_k
            if EVEN_K:  # every tile full: masks constant along K keep the 16-byte vector loads
                k_ok = offs_k < BLOCK_K
            else:
                k_ok = cols < k_hi
            a = _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, cols, m_ok, k_ok, rstd, pro_eps,
                        PRO, HEAD, BLOCK_M, BLOCK_K, ACT)
            wmask = n_ok[:, None] & k_ok[None, :]
            w = tl.load(w_ptr + w_rows[:, None] + cols[None, :], mask=wmask, other=0.0,
                        eviction_policy="evict_first")
            acc = _mac(acc, a, w, COMPUTE)
            if GATED:
                wu = tl.load(w_ptr + (w_rows + N * sw)[:, None] + cols[None, :], mask=wmask, other=0.0,
                             eviction_policy="evict_first")
                acc_u = _mac(acc_u, a, wu, COMPUTE)
    else:
        # FMA: the [BLOCK_M, BLOCK_N, BLOCK_K] products accumulate elementwise in the weight tile's own layout
        # (loaded as [1, BLOCK_N, BLOCK_K]: 16-byte vectors along K, broadcast over the rows, no layout
        # conversion of the weights), reduced over K once after the loop; the next weight tile is loaded
        # before this one is used (two tiles in flight per program).
        w3 = w_ptr + (offs_n.to(tl.int64) * sw)[None, :, None] + offs_k[None, None, :]
        n3 = n_ok[None, :, None]
        acc3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        accu3 = tl.zeros((BLOCK_M, BLOCK_N, BLOCK_K), tl.float32)
        if EVEN_K:
            wmask = n3 & (tl.full((1, 1, BLOCK_K), k_lo, tl.int32) < k_hi)  # uniform along K: keeps the vectors
        else:
            wmask = n3 & ((k_lo + offs_k) < k_hi)[None, None, :]
        w_next = tl.load(w3 + k_lo, mask=wmask, other=0.0, eviction_policy="evict_first")
        if GATED:
            wu_next = tl.load(w3 + N * sw + k_lo, mask=wmask, other=0.0, eviction_policy="evict_first")
        if PDL:  # the weights are never written by a kernel: their first tiles load while the previous kernel ends
            gdc_wait()
        for k0 in range(k_lo, k_hi, BLOCK_K):
            w = w_next
            kn = k0 + BLOCK_K
            if EVEN_K:
                k_ok = offs_k < BLOCK_K
                wmask = n3 & (tl.full((1, 1, BLOCK_K), kn, tl.int32) < k_hi)
            else:
                k_ok = (k0 + offs_k) < k_hi
                wmask = n3 & ((kn + offs_k) < k_hi)[None, None, :]
            w_next = tl.load(w3 + kn, mask=wmask, other=0.0, eviction_policy="evict_first")
            a = _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, k0 + offs_k, m_ok, k_ok, rstd, pro_eps,
                        PRO, HEAD, BLOCK_M, BLOCK_K, ACT)[:, None, :]
            acc3 += a * w.to(tl.float32)
            if GATED:
                wu = wu_next
                wu_next = tl.load(w3 + N * sw + kn, mask=wmask, other=0.0, eviction_policy="evict_first")
                accu3 += a * wu.to(tl.float32)
        acc = tl.sum(acc3, axis=2)
        if GATED:
            acc_u = tl.sum(accu3, axis=2)
        else:
            acc_u = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    return acc, acc_u


@triton.jit
def _epilogue_inputs(rows, m_ok, offs_n, n_ok, add_ptr, sadd, sadd_s, gl_ptr, sgl, res_ptr, sres,
                     EPI: tl.constexpr, HAS_RES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     ACT: tl.constexpr, ADD_GROUP: tl.constexpr, ADD_SPLITS: tl.constexpr):
    """(residual, addend, sigmoid gate) of this tile as f32 (0.0 where unused): what earlier kernels wrote, loaded
    by every split before its ticket (after the GEMM tile's gdc_wait), so the last split's serial tail skips them."""
    mask = m_ok[:, None] & n_ok[None, :]
    res = 0.0
    add = 0.0
    gate = 0.0
    if HAS_RES:
        res = tl.load(res_ptr + rows[:, None] * sres + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    if EPI == 2:
        gl = tl.load(gl_ptr + rows * sgl, mask=m_ok, other=0.0).to(tl.float32)
        gate = _round(1.0 / (1.0 + tl.exp(-gl)), ACT)
        if ADD_SPLITS:  # the routed experts' f32 partials [splits, rows x group, N], combined as sum_reduce does
            add = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
            for j in tl.static_range(ADD_GROUP):
                for s_ in tl.static_range(ADD_SPLITS):
                    add += tl.load(add_ptr + s_ * sadd_s + (rows * ADD_GROUP + j)[:, None] * sadd + offs_n[None, :],
                                   mask=mask, other=0.0)
            add = _round(add, ACT)
        else:
            add = tl.load(add_ptr + rows[:, None] * sadd + offs_n[None, :], mask=mask, other=0.0).to(tl.float32)
    return res, add, gate


@triton.jit
def _finish(acc, acc_u, rows, m_ok, offs_n, n_ok, out_ptr, so, res, add, gate, nw_ptr, y_ptr, sy, tick_ptr, sumsq_ptr, pid_n, n_tiles, M, N, norm_eps, cw_ptr, cs_ptr, s_slot, idx_ptr, CC,
            EPI: tl.constexpr, HAS_RES: tl.constexpr, ROW_NORM: tl.constexpr, KC: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, ACT: tl.constexpr, RM: tl.constexpr, KCP: tl.constexpr,
            ADD_GROUP: tl.constexpr, ADD_SPLITS: tl.constexpr):
    mask = m_ok[:, None] & n_ok[None, :]
    y = _round(acc, ACT)
    if EPI == 3:  # causal conv1d + SiLU (GDN decode) on the first CC columns; conv state shifted in place
        c_ok = n_ok & (offs_n < CC)
        slot = tl.load(idx_ptr + rows, mask=m_ok, other=0).to(tl.int64)
        jj = tl.arange(0, KCP)  # state rows 0 .. KC - 2 (padded to a power of two)
        j_ok = jj < KC - 1
        p3 = cs_ptr + slot[:, None, None] * s_slot + jj[None, :, None] * CC + offs_n[None, None, :]
        m3 = m_ok[:, None, None] & j_ok[None, :, None] & c_ok[None, None, :]
        xs = tl.load(p3, mask=m3, other=0.0)
        wj = tl.load(cw_ptr + offs_n[None, :] * KC + jj[:, None], mask=j_ok[:, None] & c_ok[None, :], other=0.0)
        conv = tl.sum(xs.to(ACT).to(tl.float32) * wj.to(tl.float32)[None, :, :], axis=1)
        conv += y * tl.load(cw_ptr + offs_n * KC + (KC - 1), mask=c_ok, other=0.0).to(tl.float32)[None, :]
        # every thread has read the state before any thread shifts it (layouts may replicate elements
        # over threads: a shift racing a replica's read was seen on the H200)
        tl.debug_barrier()
        tl.store(p3 - CC, xs, mask=m3 & (jj >= 1)[None, :, None])  # row j moves to row j - 1
        tl.store(cs_ptr + slot[:, None] * s_slot + (KC - 2) * CC + offs_n[None, :], y.to(cs_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & c_ok[None, :])
        y = tl.where(c_ok[None, :], _round(conv / (1.0 + tl.exp(-conv)), ACT), y)
    if EPI == 1:
        u = _round(acc_u, ACT)
        y = _round(y / (1.0 + tl.exp(-y)) * u, ACT)
    elif EPI == 2:  # gate and addend loaded before the split-K ticket (_epilogue_inputs)
        y = _round(add + _round(gate[:, None] * y, ACT), ACT)
    if HAS_RES:  # res: the residual tile, loaded before the split-K ticket (off the serial tail)
        y = _round(y + res, ACT)
    tl.store(out_ptr + rows[:, None] * so + offs_n[None, :], y.to(ACT), mask=mask)
    if ROW_NORM:
        # this tile's share of each row's sum of squares (of the stored h values); the last tile adds the
        # shares in a fixed order (bit-reproducible) and normalises the rows in one pass over h
        tl.store(sumsq_ptr + pid_n * BLOCK_M + rows, tl.sum(tl.where(mask, y * y, 0.0), axis=1))
        tl.debug_barrier()
        done = tl.atomic_add(tick_ptr + n_tiles, 1, sem="acq_rel", scope="gpu")
        if done == n_tiles - 1:
            tl.debug_barrier()
            # all tiles' shares in one load when they fit (2048 values): narrow tiles (1-4 weight rows, up to
            # 1024 tiles) would otherwise pay one dependent L2 round trip per 64 tiles here
            T_CHUNK: tl.constexpr = 2048 // BLOCK_M
            offs_t = tl.arange(0, T_CHUNK)
            # the first chunk of the norm pass loads now, in flight with the shares
            rr0 = tl.arange(0, RM)
            cols0 = tl.arange(0, BLOCK_R)
            cm0 = (rr0 < M)[:, None] & (cols0 < N)[None, :]
            h0 = tl.load(out_ptr + rr0[:, None] * so + cols0[None, :], mask=cm0, other=0.0,
                         cache_modifier=".cg").to(tl.float32)
            w0 = tl.load(nw_ptr + cols0, mask=cols0 < N, other=0.0).to(tl.float32)
            ss = tl.zeros((BLOCK_M,), tl.float32)
            for t0 in range(0, n_tiles, T_CHUNK):
                part = tl.load(sumsq_ptr + (t0 + offs_t)[:, None] * BLOCK_M + rows[None, :],
                               mask=(t0 + offs_t < n_tiles)[:, None], other=0.0, cache_modifier=".cg")
                ss += tl.sum(part, axis=0)
            # the pass runs on the live rows only (RM <= BLOCK_M: dots pad the tile rows to 16) in wide chunks:
            # each chunk is a dependent round trip to L2
            rstd = 1.0 / tl.sqrt(ss / N + norm_eps)
            rr = tl.arange(0, RM)
            rstd_r = tl.sum(tl.where(rows[None, :] == rr[:, None], rstd[None, :], 0.0), axis=1)
            r_ok = rr < M
            cols = tl.arange(0, BLOCK_R)
            for c0 in range(0, N, BLOCK_R):
                c_ok = c0 + cols < N
                cm = r_ok[:, None] & c_ok[None, :]
                if c0 == 0:  # the first chunk was loaded with the shares (one round trip for both)
                    h = h0
                    w = w0
                else:
                    h = tl.load(out_ptr + rr[:, None] * so + (c0 + cols)[None, :], mask=cm, other=0.0,
                                cache_modifier=".cg").to(tl.float32)
                    w = tl.load(nw_ptr + c0 + cols, mask=c_ok, other=0.0).to(tl.float32)
                tl.store(y_ptr + rr[:, None] * sy + (c0 + cols)[None, :],
                         (h * rstd_r[:, None] * (1.0 + w[None, :])).to(ACT), mask=cm)
            tl.store(tick_ptr + n_tiles, 0)


@triton.jit
def _split_reduce(acc, acc_u, rows, m_ok, offs_n, n_ok, ws_ptr, tick_ptr, pid_n, pid_k, n_split, N,
                  GATED: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT_MAX: tl.constexpr):
    """Split-K: store this program's partials [n_split, (2,) BLOCK_M, N] f32, take the tile's ticket; the last
    program of the tile gets (True, the sum over splits in split order 0, 1, ...: bit-reproducible)."""
    W2: tl.constexpr = 2 if GATED else 1
    part = ws_ptr + rows[:, None] * N + offs_n[None, :]
    pmask = m_ok[:, None] & n_ok[None, :]
    split_stride = W2 * BLOCK_M * N
    tl.store(part + pid_k * split_stride, acc, mask=pmask)
    if GATED:
        tl.store(part + pid_k * split_stride + BLOCK_M * N, acc_u, mask=pmask)
    tl.debug_barrier()
    done = tl.atomic_add(tick_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    last = done == n_split - 1
    if last:
        tl.debug_barrier()
        acc = tl.zeros((BLOCK_M, acc.shape[1]), tl.float32)
        acc_u = tl.zeros((BLOCK_M, acc.shape[1]), tl.float32)
        for s in tl.static_range(SPLIT_MAX):  # fixed order; unrolled so every partial's load is in flight at once
            s_ok = pmask & (tl.full((BLOCK_M, 1), s, tl.int32) < n_split)
            acc += tl.load(part + s * split_stride, mask=s_ok, other=0.0, cache_modifier=".cg")
            if GATED:
                acc_u += tl.load(part + s * split_stride + BLOCK_M * N, mask=s_ok, other=0.0, cache_modifier=".cg")
        tl.store(tick_ptr + pid_n, 0)
    return last, acc, acc_u


@triton.jit
def _skinny_program(
        pid_n, pid_k, n_tiles, n_split,
        x_ptr, sx, g_ptr, sg, sgh, pw_ptr,
        w_ptr, sw, rs_ptr, ws_ptr, tick_ptr, sumsq_ptr,
        out_ptr, so, add_ptr, sadd, sadd_s, gl_ptr, sgl, res_ptr, sres, nw_ptr, y_ptr, sy,
        M, N, K, K_PER, pro_eps, norm_eps, cw_ptr, cs_ptr, s_slot, idx_ptr, CC,
        PRO: tl.constexpr, EPI: tl.constexpr, HAS_RES: tl.constexpr, ROW_NORM: tl.constexpr, KC: tl.constexpr,
        HAS_SCALE: tl.constexpr, HEAD: tl.constexpr, SPLIT_MAX: tl.constexpr, USE_DOT: tl.constexpr,
        COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, RM: tl.constexpr, KCP: tl.constexpr,
        ADD_GROUP: tl.constexpr, ADD_SPLITS: tl.constexpr, PDL: tl.constexpr, ONE_SHOT: tl.constexpr = False):
    """Program (pid_n, pid_k) of an n_tiles x n_split grid (the fused router runs the shared expert's gate_up
    tiles through it too, with its own tickets)."""
    ACT: tl.constexpr = x_ptr.dtype.element_ty
    rows = tl.arange(0, BLOCK_M)
    m_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N

    rstd = tl.zeros((BLOCK_M,), tl.float32)
    if PRO == 1:  # the whole row's sum of squares before the K loop (each program recomputes it)
        if PDL:
            gdc_wait()
        offs_k = tl.arange(0, BLOCK_K)
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            xk = tl.load(x_ptr + rows[:, None] * sx + (k0 + offs_k)[None, :],
                         mask=m_ok[:, None] & (k0 + offs_k < K)[None, :], other=0.0).to(tl.float32)
            ss += tl.sum(xk * xk, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + pro_eps)

    k_lo = pid_k * K_PER
    k_hi = tl.minimum(k_lo + K_PER, K)
    acc, acc_u = _gemm_tile(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, w_ptr, sw, rows, m_ok, offs_n, n_ok, k_lo, k_hi, N,
                            rstd, pro_eps, PRO, EPI == 1, HEAD, USE_DOT, COMPUTE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                            PDL, ONE_SHOT)
    if HAS_SCALE:
        acc = acc * tl.load(rs_ptr + offs_n, mask=n_ok, other=0.0)[None, :]
        if EPI == 1:
            acc_u = acc_u * tl.load(rs_ptr + N + offs_n, mask=n_ok, other=0.0)[None, :]
    res, add, gate = _epilogue_inputs(rows, m_ok, offs_n, n_ok, add_ptr, sadd, sadd_s, gl_ptr, sgl, res_ptr, sres,
                                      EPI, HAS_RES, BLOCK_M, BLOCK_N, ACT, ADD_GROUP, ADD_SPLITS)
    last = True
    if SPLIT_MAX > 1:
        last, acc, acc_u = _split_reduce(acc, acc_u, rows, m_ok, offs_n, n_ok, ws_ptr, tick_ptr, pid_n, pid_k,
                                         n_split, N, EPI == 1, BLOCK_M, SPLIT_MAX)
    if last:
        _finish(acc, acc_u, rows, m_ok, offs_n, n_ok, out_ptr, so, res, add, gate, nw_ptr, y_ptr, sy, tick_ptr,
                sumsq_ptr, pid_n, n_tiles, M, N, norm_eps, cw_ptr, cs_ptr, s_slot, idx_ptr, CC, EPI, HAS_RES, ROW_NORM, KC, BLOCK_M, BLOCK_R, ACT, RM, KCP, ADD_GROUP, ADD_SPLITS)


@triton.jit
def _skinny_gemm_kernel(
        x_ptr, sx, g_ptr, sg, sgh, pw_ptr,
        w_ptr, sw, rs_ptr, ws_ptr, tick_ptr, sumsq_ptr,
        out_ptr, so, add_ptr, sadd, sadd_s, gl_ptr, sgl, res_ptr, sres, nw_ptr, y_ptr, sy,
        M, N, K, K_PER, pro_eps, norm_eps, cw_ptr, cs_ptr, s_slot, idx_ptr, CC,
        PRO: tl.constexpr, EPI: tl.constexpr, HAS_RES: tl.constexpr, ROW_NORM: tl.constexpr, KC: tl.constexpr,
        HAS_SCALE: tl.constexpr, HEAD: tl.constexpr, SPLIT_MAX: tl.constexpr, USE_DOT: tl.constexpr,
        COMPUTE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_R: tl.constexpr, EVEN_K: tl.constexpr, RM: tl.constexpr, KCP: tl.constexpr, ADD_GROUP: tl.constexpr,
        ADD_SPLITS: tl.constexpr, PDL: tl.constexpr, ONE_SHOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    if PDL:  # the next kernel may launch now (it waits for this one before reading what this one writes)
        gdc_launch_dependents()
    _skinny_program(pid_n, pid_k, tl.num_programs(0), tl.num_programs(1),
                    x_ptr, sx, g_ptr, sg, sgh, pw_ptr, w_ptr, sw, rs_ptr, ws_ptr, tick_ptr, sumsq_ptr,
                    out_ptr, so, add_ptr, sadd, sadd_s, gl_ptr, sgl, res_ptr, sres, nw_ptr, y_ptr, sy,
                    M, N, K, K_PER, pro_eps, norm_eps, cw_ptr, cs_ptr, s_slot, idx_ptr, CC,
                    PRO, EPI, HAS_RES, ROW_NORM, KC, HAS_SCALE, HEAD, SPLIT_MAX, USE_DOT, COMPUTE,
                    BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_R, EVEN_K, RM, KCP, ADD_GROUP, ADD_SPLITS, PDL, ONE_SHOT)


@triton.jit
def _prologue_kernel(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, a_ptr, sa, K, pro_eps, PRO: tl.constexpr, HEAD: tl.constexpr,
                     BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    """a[m, cols] = prologue(x)[m, cols] (gated norm / sigmoid gate: per-head or elementwise, no whole-row state),
    program (row m, column block): the split-prologue configs' own launch before the GEMM (config.py)."""
    if PDL:  # the GEMM after this launches now: its weight loads overlap this kernel
        gdc_launch_dependents()
        gdc_wait()
    rows = tl.program_id(0) + tl.arange(0, 1)
    cols = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    k_ok = cols < K
    a = _load_a(x_ptr, sx, g_ptr, sg, sgh, pw_ptr, rows, cols, rows >= 0, k_ok, tl.zeros((1,), tl.float32), pro_eps,
                PRO, HEAD, 1, BLOCK_K, x_ptr.dtype.element_ty)
    tl.store(a_ptr + rows[:, None] * sa + cols[None, :], a.to(x_ptr.dtype.element_ty), mask=k_ok[None, :])


_tickets: dict[torch.device, torch.Tensor] = {}


def tickets(device: torch.device) -> torch.Tensor:
    """Zeroed int32 counters, one buffer per device, reused by every launch: each launch's winners reset
    theirs to 0, and launches on one stream do not overlap (programmatic dependent launch waits for
    the previous grid before touching them). Allocated on first use (a warm-up, before graph capture)."""
    t = _tickets.get(device)
    if t is None:
        t = _tickets[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _compute_dtype(x: torch.Tensor):
    if _interpreting() or x.dtype == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[x.dtype]


def row_block(rows: int, n: int) -> int:
    """Columns per step of the row-norm pass: up to 8192 elements of [rows, BLOCK_R] (64 per thread)."""
    return max(16, min(triton.next_power_of_2(n), 8192 // rows))


def skinny_linear(x: torch.Tensor, w, cfg, *, prologue_kind: str = "none", gate=None, pro_w=None, head: int = 0,
                  pro_eps: float = 1e-6, epilogue: str = "none", addend=None, gate_logit=None, residual=None,
                  norm_w=None, norm_eps: float = 1e-6, conv=None, out=None, addend_parts=None):
    """The fused launch (see naive.skinny_linear for the semantics). x [M, K]; w a WeightTensor (dense or
    fp8) [N or 2N, K]; cfg a SkinnyConfig; conv = (weight [C, KC], state [slots, KC-1, C], state_indices [M])
    for the conv epilogue. Returns y [M, N] (written into `out` if given), or (normed, h) with norm_w."""
    M, K = x.shape
    if w.fmt not in ("dense", "fp8"):
        raise ValueError(f"skinny GEMM takes dense or fp8 weights, not {w.fmt}")
    if w.in_features != K:
        raise ValueError(f"x has {K} features, weight expects {w.in_features}")
    if x.stride(1) != 1 or w.data.stride(1) != 1:
        raise ValueError("x and the weight rows must be contiguous along K")
    rows_w = w.out_features
    N = rows_w // 2 if epilogue == "silu_mul" else rows_w
    if epilogue == "silu_mul" and rows_w % 2:
        raise ValueError(f"silu_mul needs [gate; up] weight rows, got {rows_w}")
    block_m = max(cfg.min_block_m if cfg.use_dot else 1, triton.next_power_of_2(max(M, 1)))
    if block_m > 32:
        raise ValueError(f"skinny GEMM handles up to 32 rows, got {M}")
    if prologue_kind == "gated_norm" and (head <= 0 or cfg.block_k % head or K % head):
        raise ValueError(f"gated_norm prologue needs block_k ({cfg.block_k}) and K ({K}) multiples of head={head}")
    if prologue_kind in ("gated_norm", "sigmoid_gate") and gate is None:
        raise ValueError(f"the {prologue_kind} prologue needs a gate")
    if cfg.split_prologue and prologue_kind in ("gated_norm", "sigmoid_gate") and M > 0:
        # the prologue once, in its own launch, instead of in every N tile (the out projections at 3-8 rows: the
        # per-tile recomputation cost more than a launch); the GEMM then runs without it
        x = split_prologue(x, prologue_kind, gate, pro_w, head, pro_eps)
        prologue_kind, gate, pro_w = "none", None, None
    dev = x.device
    out = torch.empty(M, N, dtype=x.dtype, device=dev) if out is None else out
    y = torch.empty(M, N, dtype=x.dtype, device=dev) if norm_w is not None else out
    if M == 0:
        return (y, out) if norm_w is not None else out
    if cfg.one_shot:  # each program's K slice is one block_k tile (the split follows from it)
        k_per = cfg.block_k
    else:
        k_per = triton.cdiv(triton.cdiv(K, cfg.split_k), cfg.block_k) * cfg.block_k
    split = triton.cdiv(K, k_per)  # no empty splits
    n_tiles = triton.cdiv(N, cfg.block_n)
    if (split > 1 or norm_w is not None) and n_tiles + 1 > TICKETS:
        raise ValueError(f"{n_tiles} N tiles exceed the {TICKETS} tickets")
    wide = 2 if epilogue == "silu_mul" else 1
    ws = torch.empty(split * wide * block_m * N if split > 1 else 1, dtype=torch.float32, device=dev)
    ss = torch.empty(n_tiles * block_m if norm_w is not None else 1, dtype=torch.float32, device=dev)
    rm = triton.next_power_of_2(M)  # rows of the row-norm pass
    dummy = x
    g = gate if gate is not None else dummy
    # gate: [M, K], or a per-head strided view [M, K // head, head] (attention's [q | gate] interleave)
    if g.dim() == 3:
        if g.shape[1] * g.shape[2] != K or g.shape[2] != head:
            raise ValueError(f"gate of shape {tuple(g.shape)} must be [M, K / head, head={head}]")
        sgh = g.stride(1)
    else:
        sgh = max(head, 1)
    gl = gate_logit if gate_logit is not None else dummy
    add = addend if addend is not None else dummy
    add_group, add_splits, sadd, sadd_s = 1, 0, add.stride(0), 0
    if addend_parts is not None:  # (part [splits, M * group, N] f32, group): the addend is their sum_reduce
        if epilogue != "gate_add" or addend is not None:
            raise ValueError("addend_parts replace the addend of the gate_add epilogue")
        add, add_group = addend_parts
        if add.dim() != 3 or add.shape[1] != M * add_group or add.shape[2] != N or add.stride(2) != 1:
            raise ValueError(f"addend_parts {tuple(add.shape)} must be [splits, {M} x group {add_group}, {N}]")
        add_splits, sadd, sadd_s = add.shape[0], add.stride(1), add.stride(0)
    res = residual if residual is not None else dummy
    if epilogue == "conv":
        cw, cs, idx = conv
        CC, KC = cw.shape
        if CC > N or cs.shape[1:] != (KC - 1, CC) or cs.stride(1) != CC or cs.stride(2) != 1 or idx.shape != (M,):
            raise ValueError(f"conv epilogue: weight {tuple(cw.shape)}, state {tuple(cs.shape)}, indices "
                             f"{tuple(idx.shape)} do not fit {M} rows x {N} columns")
        if not cw.is_contiguous():
            raise ValueError("conv weight must be contiguous [C, K]")
    else:
        cw, cs, idx, CC, KC = dummy, dummy, dummy, 0, 2
    for t, name in ((g, "gate"), (add, "addend"), (res, "residual")):
        if t is not dummy and t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous along its last dim")
    _skinny_gemm_kernel[(n_tiles, split)](
        x, x.stride(0), g, g.stride(0), sgh, pro_w if pro_w is not None else dummy,
        w.data, w.data.stride(0), w.row_scale if w.row_scale is not None else dummy, ws, tickets(dev), ss,
        out, out.stride(0), add, sadd, sadd_s, gl, gl.stride(0), res, res.stride(0),
        norm_w if norm_w is not None else dummy, y, y.stride(0),
        M, N, K, k_per, pro_eps, norm_eps, cw, cs, cs.stride(0) if epilogue == "conv" else 0, idx, CC,
        PRO=PROLOGUES[prologue_kind], EPI=EPILOGUES[epilogue], HAS_RES=residual is not None, KC=KC,
        ROW_NORM=norm_w is not None, HAS_SCALE=w.row_scale is not None, HEAD=max(head, 1), SPLIT_MAX=triton.next_power_of_2(split),
        USE_DOT=cfg.use_dot, COMPUTE=_compute_dtype(x), BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        BLOCK_R=row_block(rm, N), EVEN_K=K % cfg.block_k == 0, RM=rm, KCP=triton.next_power_of_2(max(KC - 1, 1)),
        ADD_GROUP=add_group, ADD_SPLITS=add_splits, ONE_SHOT=cfg.one_shot,
        num_warps=cfg.num_warps, num_stages=pipeline_stages(cfg, x), **pdl_launch_kwargs(x))
    return (y, out) if norm_w is not None else out


def split_prologue(x: torch.Tensor, prologue_kind: str, gate, pro_w, head: int, pro_eps: float) -> torch.Tensor:
    """prologue(x) [M, K] in the activation dtype (naive.prologue), one launch: the gated norm per head of `head`
    columns or x * sigmoid(gate); gate [M, K] or a per-head strided view [M, K / head, head]."""
    M, K = x.shape
    if gate.dim() == 3:
        if gate.shape[1] * gate.shape[2] != K or gate.shape[2] != head or gate.stride(2) != 1:
            raise ValueError(f"gate of shape {tuple(gate.shape)} must be [M, K / head, head={head}]")
        sgh = gate.stride(1)
    else:
        if gate.stride(-1) != 1:
            raise ValueError("gate must be contiguous along its last dim")
        sgh = max(head, 1)
    block = min(triton.next_power_of_2(K), max(1024, head))
    a = torch.empty(M, K, dtype=x.dtype, device=x.device)
    _prologue_kernel[(M, triton.cdiv(K, block))](
        x, x.stride(0), gate, gate.stride(0), sgh, pro_w if pro_w is not None else x, a, a.stride(0), K, pro_eps,
        PRO=PROLOGUES[prologue_kind], HEAD=max(head, 1), BLOCK_K=block, num_warps=4, **pdl_launch_kwargs(x))
    return a


def pipeline_stages(cfg, x: torch.Tensor) -> int:
    """The configs are tuned for 2-byte activations; f32 tiles at the same depth overflow sm_90's 227 KiB of
    shared memory (H200: 245,760 bytes at 32 rows, block 64 x 128, the silu_mul epilogue's two weight tiles,
    4 stages; the f32 test model's 32-token prefill graph failed to capture): at most 2 stages for 4-byte tiles."""
    return cfg.num_stages if x.element_size() <= 2 or not cfg.use_dot else min(cfg.num_stages, 2)
