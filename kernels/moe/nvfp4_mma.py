"""NVFP4 grouped GEMM for decode batches on sm_80+ (Hopper target): weights as MMA fragments.

Gluon (`triton.experimental.gluon`) kernel over the repacked layout of nvfp4_layout.py:
    out[r, n] = sum_k A[row(r), k] * W[e(r), n, k]
Each warp owns 16 weight rows (the M side of mma.sync m16n8k16, bf16, k_width 8) and a CTA of
WARPS warps 16 * WARPS rows; the N side is one 8- (or 16-) token block of one expert (align.py with
block_m = 8 / 16). A K step is UNITS units of 64 k: per unit a lane issues one 16-byte load of its own
A-fragment code words (a warp reads 512 contiguous bytes) and one 4-byte load holding its two block
scales, decodes them in registers with inline PTX (11 integer ops per 8 codes + 4 bf16x2 FMAs, one
PRMT + IMAD per row scale, see nvfp4_layout.py) and feeds the MMA straight from registers: the regrouping
of the decoded tile into the operand layout is asserted trivial at compile time (no shared memory).
Activations stay in natural order: a lane loads 16 consecutive k of one token (two 16-byte loads), and
because the packed codes stand for the matching k (nvfp4_layout: k = 16 t + 4 j + 2 cb + h), each load is
two MMAs' ready B register pairs (no register moves). Code words stay int32 through the loop-carried
prefetch; the evict-first weight loads are inline PTX through one L2 policy register made before the
loop (triton 3.6 makes the policy next to every load, inside the loop). sm_90 SASS: 2.41 instructions
per weight in the K loop of the default tile (tests/test_nvfp4_mma.py, `ptx_operand_wiring` checks the
operand registers against the layout).

Split-K: grid axis 1 cuts K into SPLIT_K ranges; each writes f32 partials. For gate_up the last split
of each tile to finish (an integer ticket per tile) adds them in split order and stores SiLU * up
(FUSED_REDUCE; else grouped_gemm.silu_mul_reduce), for down grouped_gemm.sum_reduce (or the engine's
shared-expert down projection) adds them with the top-k combine. No float atomics: bitwise
reproducible, CUDA graphs on or off. Gated (w13) tiles hold 8 gate + 8 up rows so SiLU * up needs no
exchange. Weight loads carry an evict-first L2 hint (WEIGHT_HINTS).

Two tile options, both off by default (experts.MMA_ADAPTIVE_16, experts.MMA_TILES; bitwise the same results, GPU-tested):
- adaptive (ADAPT, 16-token blocks): a block whose slots 8..15 are all padding runs the 8-token K loop on its first 8
  slots, in the same launch (one kernel, two K loops; measured no faster at B = 256, round6/).
- mrep (MREP): 16-row tiles per warp; the MMA layout repeats along M in registers (row tile i of a CTA is warp
  i % WARPS's (i // WARPS)-th), so one activation load feeds mrep tiles' MMAs and a warp has mrep code loads in flight
  per K step; the regrouping of the decoded tile into the operand layout stays trivial (asserted).

`launch_persistent` runs both GEMMs in one persistent launch (work items from an integer counter, down
tiles waiting on their block's gate_up tiles); measured slower than the two launches on the H200 at
most batch sizes (results/kernels/moe/MMA.md), so not the default. Round 8 (results/kernels/moe/round8/) measured and
removed three more: a persistent grid per GEMM (CTAs striding over the tiles, the next tile's first codes loaded under
the current tile's tail; +3 to +18 us per layer at B = 32-128); the activations one K step ahead, in registers (equal
at best) or prefetched into L1 (+20 to +50 us), although Nsight charges 60 % of the down GEMM's long-scoreboard stalls
at B = 128 to its activation loads; the epilogue's loads hoisted before the K loop (-2.5 us at B = 256 only, not kept).
What did help, kept: XSU (the down tile's, experts.MMA_DOWN_SMEM_X), a CTA's split activations staged in shared memory
once (8 KB at 8 tokens, copied before the K loop) and each K step's B operand read from there with the same register
layout as the global loads (two LDS.128 per lane and unit), its K steps unrolled (static slices of the staged tile; a
run-time indexed loop over the slots was 3.6-4.4 us slower): 2.9-3.6 us per layer at B = 32-128.

Register budget (maxnreg, per batch in experts.MMA_TILES): left to itself, ptxas compiles the default 1-unit loop to
44 registers (round 2's: 52) by issuing each activation load next to its MMAs and the next step's code loads behind the
first MMAs, so a loop iteration waits on 4 L1/L2 round trips in a row; with a budget of 80 it takes 78 registers and
issues all 8 loads (activations of both steps, the next steps' codes and scales) before the first MMA (sm_90 SASS,
k_loop_stats "loads_before_mma"). Occupancy hides the serial loads at large batches; at B = 1 (about 4 CTAs per SM)
it does not: round 3's B = 1 regression (benchmarks/results/kernels/moe/round4/). The down GEMM (K = 512, CTAs 4x
shorter) has its own tile from B = 32 (experts.MMA_DOWN_TILES: 1 unit at 40 registers, 12 CTAs per SM).

Programmatic dependent launch (pdl_trigger / pdl_wait of `launch`, chained by experts.moe_experts_mma): gate_up,
launched plainly after the router, lets the down kernel launch at once (TRIGGER_NEXT); the down CTAs that find a
free slot load their expert id, token ids and first K step's codes and scales (none written by gate_up) and only
then wait for gate_up's grid (WAIT_PREV, before the first load of h), so the launch gap and the first weight round
trip overlap gate_up's tail. The down kernel lets the combine (sum_reduce, or the engine's shared-expert down
projection, both waiting before they read the partials) launch the same way. An earlier variant that waited
before its first load (no weight prefetch, both kernels launched with PDL) measured slower in the engine
(benchmarks/results/small_round4/). pdl_wait_first (WAIT_FIRST): gate_up itself launched with PDL right behind the
router, waiting for it before anything else and only then letting the down kernel launch (its launch overlaps the
router; the down kernel's pre-wait loads still see the alignment; benchmarks/results/kernels/moe/round6_small/).

Gluon kernels do not run under TRITON_INTERPRET; `available()` says whether this path can run.
"""
from __future__ import annotations

import functools
import os

import torch
import triton

try:  # Gluon ships with triton >= 3.5; the layout / mma_v2 API used here is the same in 3.6 .. 3.9
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2
    HAVE_GLUON = True
    # CTA barrier: gl.thread_barrier in triton 3.6, gl.barrier from 3.7 on
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
except ImportError:  # pragma: no cover
    HAVE_GLUON = False

from linrnn_kernels.gemv.config import pdl_available
from linrnn_kernels.gemv.skinny import gdc_launch_dependents, gdc_wait

from linrnn_kernels.moe import nvfp4_layout as lay

# default tile (measured on the H200, results/kernels/moe/moe_mma_*: the (tokens, warps, units, groups,
# prefetch) sweep): 1 unit (64 k) per K step, two steps per loop iteration with the next step's codes
# in flight, 48 registers. moe_experts_mma picks units and a register budget per batch (experts.MMA_TILES)
DEFAULT_UNITS = 1
DEFAULT_PREFETCH = True
DEFAULT_PER_SM = 2  # split-K until about this many programs per SM (small batches)
# weight codes and scales are read once per expert block: "evict_first" hints L2 to evict them first
# (an L2 cache policy; triton 3.6 creates it in the loop: +0.09 instructions per weight), "cg" caches
# them in L2 only (not L1), "none" loads them plainly. H200 sweep at d444877: evict_first 2-4 % faster
# than none at B = 8-256
DEFAULT_WEIGHT_HINT = "evict_first"
WEIGHT_HINTS = {"none": ("", ""), "evict_first": ("", "evict_first"), "cg": (".cg", "")}


def _hint_consts(hint: str) -> dict:
    cache, evict = WEIGHT_HINTS[hint]
    return {"WCACHE": cache, "EVICT": evict}
TOKENS = (8, 16)  # MMA N: tokens per expert block (16: two n8 MMAs share each decoded A fragment)

# Operands: $16..$19 the lane's four code words w = 2 cb + r8; $20 its scale word (4 bytes: its own two
# scales and its neighbour lane's, nvfp4_layout) and $24 / $28 the PRMT selectors of its row-g / row-g+8 byte
# ($21..$23, $25..$27, $29..$31 repeat them: pack 4). Per row r8 (both its words share the scale):
#   s_r8 = prmt(scale word, its byte -> both halves) ; s_r8 = s_r8 * 16 + bias   -> bf16 pair [v, v] x 2^119
# per word: out_j = decode_j(q) * s_r8 (bf16x2 FMA with -0 so signed zeros survive): codes 2j, 2j + 1.
# out_j of word w goes to $(2 (2 j + r8) + cb): output 2 j + r8 (pack 4: two registers, each a pair of its
# elements), register cb. Triton reads that register as elements (2 cb, 2 cb + 1) of the output, so
# decode_codes relabels: element 2 cb + h of output 2 j + r8 is code 2 j + h of word 2 cb + r8.
def _decode_asm() -> str:
    lines = ["{", ".reg .b32 s0, s1, a, b, nz;", "mov.b32 nz, 0x80008000;"]
    for r8 in range(2):
        lines += [f"prmt.b32 s{r8}, $20, 0, ${24 + 4 * r8};", f"mad.lo.u32 s{r8}, s{r8}, 16, {lay.SCALE_BIAS:#x};"]
    for w in range(4):
        q = f"${16 + w}"
        cb, r8 = divmod(w, 2)
        o = [f"${2 * (2 * j + r8) + cb}" for j in range(4)]
        lines += [
            f"and.b32 {o[2]}, {q}, 0x81C081C0;",
            f"shl.b32 a, {q}, 3;",
            f"and.b32 {o[1]}, a, 0x81C081C0;",
            f"shl.b32 a, {q}, 2;",
            f"shl.b32 b, {q}, 6;",
            f"and.b32 a, a, 0x80008000;",
            f"and.b32 b, b, 0x01C001C0;",
            f"or.b32 {o[0]}, a, b;",
            f"shl.b32 a, {q}, 1;",
            f"shr.b32 b, {q}, 3;",
            f"and.b32 a, a, 0x80008000;",
            f"and.b32 b, b, 0x01C001C0;",
            f"or.b32 {o[3]}, a, b;",
        ] + [f"fma.rn.bf16x2 {o[j]}, {o[j]}, s{r8}, nz;" for j in range(4)]
    lines.append("}")
    return "\n".join(lines)


DECODE_ASM = _decode_asm()
DECODE_CONSTRAINTS = ",".join(["=r"] * 16 + ["r"] * 16)


if HAVE_GLUON:
    @gluon.jit
    def scale_selector(lane):
        """PRMT selector of lane `lane`'s row-g scale byte in its scale word (byte 2 (lane % 2); row g + 8:
        + 0x101) replicated into both bf16 halves: 0x4040 | b << 8 | b."""
        return 0x4040 + (lane % 2) * 0x202

    @gluon.jit
    def decode_codes(q, sw, sel, DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, WARPS: gl.constexpr,
                     UNITS: gl.constexpr):
        """In-register decode of a K step's code words q [w, u, lane, 4 (cb, r8)] (int32) with their scale words
        sw [w, u, lane] and the lanes' scale-byte selectors sel (scale_selector, any shape broadcasting to sw):
        bf16 weights as [w, u, g, t, cb, r8, h, p, q] (row r8 * 8 + g, k = 16 t + 4 (2 p + q) + 2 cb + h);
        each kernel permutes them into its MMA's A-fragment order. Shared by the mma_v2 (decode) and wgmma
        (prefill) kernels. The code words stay int32 end to end: no 16-bit repacking of loop-carried words."""
        s4 = gl.broadcast(gl.expand_dims(sw, 3), q)[0]
        sel0 = gl.broadcast(gl.expand_dims(gl.broadcast(sel, sw)[0], 3), q)[0]
        o0, o1, o2, o3, o4, o5, o6, o7 = gl.inline_asm_elementwise(
            DECODE, CONSTRAINTS, [q, s4, sel0, sel0 + 0x101], dtype=(gl.bfloat16, ) * 8, is_pure=True, pack=4)
        # output 2 j + r8, element 2 cb + h: join appends its new dim last
        j0 = gl.join(o0, o1)  # [.., (cb, h), r8]
        j1 = gl.join(o2, o3)
        j2 = gl.join(o4, o5)
        j3 = gl.join(o6, o7)
        wts = gl.join(gl.join(j0, j2), gl.join(j1, j3))  # [.., (cb, h), r8, p, q], j = 2 p + q
        wts = gl.reshape(wts, [WARPS, UNITS, 8, 4, 2, 2, 2, 2, 2])  # [w, u, g, t, cb, h, r8, p, q]
        return gl.permute(wts, [0, 1, 2, 3, 4, 6, 5, 7, 8])

    @gluon.jit
    def l2_evict_first_policy(like):
        """An L2 evict-first cache policy (createpolicy) in a register, one per element of `like` (int32): made
        once before the K loop. triton 3.6 creates one next to every evict-first load, inside the loop."""
        return gl.inline_asm_elementwise("createpolicy.fractional.L2::evict_first.b64 $0, 1.0;", "=l,r", [like],
                                         dtype=gl.int64, is_pure=True, pack=1)

    @gluon.jit
    def load_weights(ptrs, policy, VEC: gl.constexpr, EVICT: gl.constexpr, WCACHE: gl.constexpr):
        """Weight words (int32) at ptrs, a lane's VEC consecutive words (4 or 1) in one vector load. EVICT
        "evict_first": through the L2 policy register `policy` (broadcast like ptrs; inline PTX, the
        instruction triton emits, with the policy made outside the loop); else gl.load with WCACHE."""
        if EVICT == "evict_first":
            if VEC == 4:
                return gl.inline_asm_elementwise(
                    "ld.global.L1::evict_first.L2::cache_hint.v4.b32 {$0, $1, $2, $3}, [$4], $8;",
                    "=r,=r,=r,=r,l,l,l,l,l,l,l,l", [ptrs, policy], dtype=gl.int32, is_pure=False, pack=4)
            else:
                return gl.inline_asm_elementwise("ld.global.L1::evict_first.L2::cache_hint.b32 $0, [$1], $2;",
                                                 "=r,l,l", [ptrs, policy], dtype=gl.int32, is_pure=False, pack=1)
        else:
            return gl.load(ptrs, cache_modifier=WCACHE)

    @gluon.jit
    def _decode_mma(q, sw, sel, x_base, x_off, x_k, k0, K, acc, a_op: gl.constexpr, b_op: gl.constexpr,
                    EVEN_K: gl.constexpr, DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, WARPS: gl.constexpr,
                    UNITS: gl.constexpr, TOK: gl.constexpr):
        """One K step: activations (B fragment), in-register decode of the codes q with scales sw,
        regrouping of both into the MMA operand layouts (asserted trivial: no data movement), MMA.
        Activations: x_off [1, u, t, 16, n] (x_k: their k in the step), a lane's 16 consecutive k of one token
        (two 16-byte loads), each load two MMAs' ready B register pairs (the packed codes' k order, nvfp4_layout)."""
        if EVEN_K:
            xb = gl.load(x_base + x_off)
        else:
            xb = gl.load(x_base + x_off, mask=k0 + x_k < K, other=0.0)
        return _decode_mma_x(xb, q, sw, sel, acc, a_op, b_op, DECODE, CONSTRAINTS, WARPS, UNITS, TOK)

    @gluon.jit
    def _decode_mma_x(xb, q, sw, sel, acc, a_op: gl.constexpr, b_op: gl.constexpr, DECODE: gl.constexpr,
                      CONSTRAINTS: gl.constexpr, WARPS: gl.constexpr, UNITS: gl.constexpr, TOK: gl.constexpr):
        """_decode_mma on activations already in registers (xb [1, u, t, 16, n], as loaded)."""
        # k = 16 t + 4 j + 2 cb + e -> the operand's k order (cb, t, j, e), the same as the weights' below
        xb = gl.reshape(xb, [UNITS, 4, 4, 2, 2, TOK])  # [u, t, j, cb, e, n]
        xb = gl.reshape(gl.permute(xb, [0, 3, 1, 2, 4, 5]), [64 * UNITS, TOK])
        xb = gl.convert_layout(xb, b_op, assert_trivial=True)
        wts = decode_codes(q, sw, sel, DECODE, CONSTRAINTS, WARPS, UNITS)
        wts = gl.permute(wts, [0, 5, 2, 1, 4, 3, 7, 8, 6])  # row = (w, r8, g); k = (u, cb, t, p, q, h)
        wts = gl.reshape(wts, [16 * WARPS, 64 * UNITS])
        a = gl.convert_layout(wts, a_op, assert_trivial=True)
        return mma_v2(a, xb, acc)

    @gluon.jit
    def _nvfp4_mma_kernel(
            x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_os, stride_om,
            sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr,
            num_rows, N, K, n_tiles, k_units, num_m_blocks,
            stride_ce, stride_se, stride_rse,
            A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, ROUTE_WEIGHTED: gl.constexpr,
            SPLIT_K: gl.constexpr, UNITS: gl.constexpr, WARPS: gl.constexpr, EVEN_K: gl.constexpr,
            DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, GAIN: gl.constexpr, TOK: gl.constexpr,
            GROUPS: gl.constexpr, PREFETCH: gl.constexpr, FUSED_REDUCE: gl.constexpr, EVICT: gl.constexpr,
            WCACHE: gl.constexpr, N_FASTEST: gl.constexpr, TRIGGER_NEXT: gl.constexpr, WAIT_PREV: gl.constexpr,
            ADAPT: gl.constexpr, UNITS8: gl.constexpr, PREFETCH8: gl.constexpr, MREP: gl.constexpr,
            WAIT_FIRST: gl.constexpr = False, XSU: gl.constexpr = 0):
        if WAIT_FIRST:  # PDL, launched right behind the kernel that wrote the alignment: nothing to load before it
            gdc_wait()
        if TRIGGER_NEXT:  # PDL: the next kernel may launch now (it waits for this grid before reading its output;
            gdc_launch_dependents()  # with WAIT_FIRST only now, so its pre-wait loads see the alignment)
        pid = gl.program_id(0)
        pid_k = gl.program_id(1)
        if N_FASTEST:  # the row tiles of one expert block run next to each other
            n_progs = n_tiles // (WARPS * MREP * GROUPS)
            pid_n = pid % n_progs
            pid_m = pid // n_progs
        else:  # one row tile of every expert block, then the next
            pid_m = pid % num_m_blocks
            pid_n = pid // num_m_blocks
        _gemm_tile(pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_os, stride_om,
                   sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, tick_ptr,
                   num_rows, N, K, n_tiles, k_units, stride_ce, stride_se, stride_rse,
                   A_ROW_DIV, GATED, ROUTE_WEIGHTED, SPLIT_K, UNITS, WARPS, EVEN_K, DECODE, CONSTRAINTS, GAIN,
                   TOK, GROUPS, PREFETCH, FUSED_REDUCE, EVICT, WCACHE, False, WAIT_PREV, ADAPT, UNITS8, PREFETCH8, MREP,
                   XSU)
        if WAIT_PREV:  # every CTA waits before it exits (an empty expert block too), so this grid ends after the
            gdc_wait()  # previous one: a kernel that waits for this one may rely on both

    @gluon.jit
    def _gemm_tile(pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr, out_ptr, stride_os, stride_om,
                   sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, done_ptr,
                   num_rows, N, K, n_tiles, k_units, stride_ce, stride_se, stride_rse,
                   A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, ROUTE_WEIGHTED: gl.constexpr,
                   SPLIT_K: gl.constexpr, UNITS: gl.constexpr, WARPS: gl.constexpr, EVEN_K: gl.constexpr,
                   DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, GAIN: gl.constexpr, TOK: gl.constexpr,
                   GROUPS: gl.constexpr, PREFETCH: gl.constexpr, FUSED_REDUCE: gl.constexpr, EVICT: gl.constexpr,
                   WCACHE: gl.constexpr, SIGNAL: gl.constexpr, WAIT_PREV: gl.constexpr = False,
                   ADAPT: gl.constexpr = False, UNITS8: gl.constexpr = 1, PREFETCH8: gl.constexpr = False,
                   MREP: gl.constexpr = 1, XSU: gl.constexpr = 0):
        """Row tile pid_n (GROUPS groups of 16 * WARPS * MREP rows) x K split pid_k of expert block pid_m (TOK slots of
        sorted_ids); SIGNAL: count the tile's finished SiLU(gate) * up rows in done_ptr[pid_m] (the persistent
        kernel's down tiles wait on it). ADAPT (TOK = 16): a block whose slots 8..15 are all padding (an expert
        with <= 8 tokens: align.py fills a block's slots in order; pair blocks may hold any slot) runs the 8-token
        tile on its first 8 slots: half the MMAs and activation loads, the same bits per token as the 16-token tile.
        UNITS8 / PREFETCH8: that 8-token loop's units per K step and prefetch (it fits more units in the registers)."""
        expert = gl.load(expert_ids_ptr + pid_m)
        if expert >= 0:
            ids_ptr = sorted_ids_ptr + pid_m * TOK
            if ADAPT:
                hl: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
                if gl.min(gl.load(ids_ptr + 8 + gl.arange(0, 8, layout=hl)), axis=0) < num_rows:
                    _gemm_tile_body(expert.to(gl.int64), pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr,
                                    rs_ptr, out_ptr, stride_os, stride_om, ids_ptr, route_w_ptr, h_ptr, stride_h,
                                    tick_ptr, done_ptr, num_rows, N, K, n_tiles, k_units, stride_ce, stride_se,
                                    stride_rse, A_ROW_DIV, GATED, ROUTE_WEIGHTED, SPLIT_K, UNITS, WARPS, EVEN_K, DECODE,
                                    CONSTRAINTS, GAIN, 16, GROUPS, PREFETCH, FUSED_REDUCE, EVICT, WCACHE, SIGNAL,
                                    WAIT_PREV, MREP, XSU)
                else:
                    _gemm_tile_body(expert.to(gl.int64), pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr,
                                    rs_ptr, out_ptr, stride_os, stride_om, ids_ptr, route_w_ptr, h_ptr, stride_h,
                                    tick_ptr, done_ptr, num_rows, N, K, n_tiles, k_units, stride_ce, stride_se,
                                    stride_rse, A_ROW_DIV, GATED, ROUTE_WEIGHTED, SPLIT_K, UNITS8, WARPS, EVEN_K,
                                    DECODE, CONSTRAINTS, GAIN, 8, GROUPS, PREFETCH8, FUSED_REDUCE, EVICT, WCACHE, SIGNAL,
                                    WAIT_PREV, MREP, XSU)
            else:
                _gemm_tile_body(expert.to(gl.int64), pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr,
                                rs_ptr, out_ptr, stride_os, stride_om, ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr,
                                done_ptr, num_rows, N, K, n_tiles, k_units, stride_ce, stride_se, stride_rse,
                                A_ROW_DIV, GATED, ROUTE_WEIGHTED, SPLIT_K, UNITS, WARPS, EVEN_K, DECODE, CONSTRAINTS,
                                GAIN, TOK, GROUPS, PREFETCH, FUSED_REDUCE, EVICT, WCACHE, SIGNAL, WAIT_PREV, MREP, XSU)

    @gluon.jit
    def _gemm_tile_body(expert, pid_m, pid_n, pid_k, x_ptr, stride_x, codes_ptr, scales_ptr, rs_ptr,
                        out_ptr, stride_os, stride_om, ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, done_ptr,
                        num_rows, N, K, n_tiles, k_units, stride_ce, stride_se, stride_rse,
                        A_ROW_DIV: gl.constexpr, GATED: gl.constexpr, ROUTE_WEIGHTED: gl.constexpr,
                        SPLIT_K: gl.constexpr, UNITS: gl.constexpr, WARPS: gl.constexpr, EVEN_K: gl.constexpr,
                        DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, GAIN: gl.constexpr, TOK: gl.constexpr,
                        GROUPS: gl.constexpr, PREFETCH: gl.constexpr, FUSED_REDUCE: gl.constexpr, EVICT: gl.constexpr,
                        WCACHE: gl.constexpr, SIGNAL: gl.constexpr, WAIT_PREV: gl.constexpr, MREP: gl.constexpr,
                        XSU: gl.constexpr = 0):
        """ids_ptr: the block's TOK token slots in sorted_ids. MREP: 16-row tiles per warp (the MMA layout repeats
        along M in registers: row tile MREP * WARPS of the CTA is warp w's second); every activation load feeds MREP
        tiles' MMAs. WAIT_PREV (launched with PDL): the expert id, the token ids and the first K step's weights load before the
        grid dependency wait (written by kernels that ended before the previous one began, or never), the
        activations (the previous kernel's output) after it."""
        MT: gl.constexpr = WARPS * MREP  # 16-row tiles per CTA
        ROWS: gl.constexpr = 16 * MT
        BK: gl.constexpr = 64 * UNITS
        mma: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[WARPS, 1],
                                                      instr_shape=[16, 8])
        a_op: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=8)
        b_op: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=mma, k_width=8)
        # raw code words as loaded: [warp, unit, lane, 4 int32], one 16-byte vector per (warp, unit)
        raw: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 4], threads_per_warp=[1, 1, 32, 1],
                                             warps_per_cta=[WARPS, 1, 1, 1], order=[3, 2, 1, 0])
        sraw: gl.constexpr = gl.SliceLayout(3, raw)


        # activations (B operand [BK, 8]): rows of this 8-token block. Padding slots read row 0:
        # their accumulator columns are never stored, so no load mask (and no zero-fill) is needed
        # [1, unit, t, 16 k, n]: lane (n, t) holds k 16 t .. 16 t + 15 of each unit of token n (every warp all)
        xl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 16, 1], threads_per_warp=[1, 1, 4, 1, 8],
                                            warps_per_cta=[WARPS, 1, 1, 1, 1], order=[3, 2, 4, 1, 0])
        xn = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, xl)))))
        xu = gl.arange(0, UNITS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, xl)))))
        xt = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, xl)))))
        xp = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, xl)))))
        ids_b = gl.load(ids_ptr + xn)
        a_rows = gl.where(ids_b < num_rows, ids_b // A_ROW_DIV, 0).to(gl.int64)
        x_k = xu[None, :, None, None, None] * 64 + xt[None, None, :, None, None] * 16 + xp[None, None, None, :, None]
        x_off = a_rows[None, None, None, None, :] * stride_x + x_k

        units_per_split = k_units // SPLIT_K
        u_lo = pid_k * units_per_split

        # code words (4 per lane per unit) at ((tile * k_units + unit) * 32 + lane) * 4 + e;
        # loop-invariant offsets from scalar bases that advance by one K step
        offs_w = gl.arange(0, MT, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, raw))))
        offs_u = gl.arange(0, UNITS, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, raw))))
        offs_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, raw))))
        offs_e = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, raw))))
        c_off = ((offs_w[:, None, None, None] * k_units + offs_u[None, :, None, None]) * 128
                 + offs_l[None, None, :, None] * 4 + offs_e[None, None, None, :])
        # scale words (int32 view): lane l reads word l // 2 of its unit's 16 (its two bytes and its neighbour's)
        so_w = gl.arange(0, MT, layout=gl.SliceLayout(1, gl.SliceLayout(2, sraw)))
        so_u = gl.arange(0, UNITS, layout=gl.SliceLayout(0, gl.SliceLayout(2, sraw)))
        so_l = gl.arange(0, 32, layout=gl.SliceLayout(0, gl.SliceLayout(1, sraw)))
        s_off = (so_w[:, None, None] * k_units + so_u[None, :, None]) * 16 + (so_l // 2)[None, None, :]
        sel = scale_selector(so_l)[None, None, :]
        spol = l2_evict_first_policy(s_off)  # the weight loads' L2 policy (EVICT evict_first), made once
        cpol = gl.broadcast(gl.expand_dims(spol, 3), c_off)[0]
        # GROUPS row groups of 16 * WARPS rows per CTA, one after the other: longer CTAs amortize the
        # prologue (expert id, token ids) where K is short (down_proj: K = 512 is two K steps)
        for grp in range(GROUPS):
            tile0 = (pid_n * GROUPS + grp) * MT
            unit0 = tile0.to(gl.int64) * k_units + u_lo
            c_base = codes_ptr + expert * stride_ce + unit0 * 128
            s_base = scales_ptr + expert * stride_se + unit0 * 16
            x_base = x_ptr + u_lo * 64

            acc = gl.zeros([ROWS, TOK], gl.float32, layout=mma)
            k_end = (u_lo + units_per_split) * 64
            if PREFETCH and XSU > 0:
                # the split's activations staged in shared memory once per CTA (all warps read the same ones), then
                # the K loop reads each step's from there: an L2 round trip per CTA instead of one per step
                qa = load_weights(c_base + c_off, cpol, 4, EVICT, WCACHE)
                sa = load_weights(s_base + s_off, spol, 1, EVICT, WCACHE)
                if WAIT_PREV:
                    gdc_wait()
                xsl: gl.constexpr = gl.SwizzledSharedLayout(vec=8, per_phase=1, max_phase=1, order=[3, 2, 4, 1, 0])
                xs = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [1, XSU, 4, 16, TOK], xsl)
                cl: gl.constexpr = gl.BlockedLayout(size_per_thread=[1, 1, 1, 16, 1], threads_per_warp=[1, 1, 4, 1, 8],
                                                    warps_per_cta=[1, WARPS, 1, 1, 1], order=[3, 2, 4, 1, 0])
                cl4: gl.constexpr = gl.SliceLayout(4, cl)
                cu = gl.arange(0, XSU, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, cl4))))
                ct = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, cl4))))
                cp = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, cl4))))
                cn = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, cl)))))
                c_ids = gl.load(ids_ptr + cn)
                c_rows = gl.where(c_ids < num_rows, c_ids // A_ROW_DIV, 0).to(gl.int64)
                c_k = (cu[None, :, None, None, None] * 64 + ct[None, None, :, None, None] * 16
                       + cp[None, None, None, :, None])
                xs.store(gl.load(x_base + c_rows[None, None, None, None, :] * stride_x + c_k))
                _cta_barrier()
                # the split's K steps unrolled (static slices of the staged tile; a loop indexing the slots at run time
                # measured 3.6-4.4 us slower per layer at B = 64-128, round8/)
                for i in gl.static_range(0, XSU // UNITS, 2):
                    qb = load_weights(c_base + UNITS * 128 + c_off, cpol, 4, EVICT, WCACHE)
                    sb = load_weights(s_base + UNITS * 16 + s_off, spol, 1, EVICT, WCACHE)
                    acc = _decode_mma_x(xs.slice(i * UNITS, UNITS, dim=1).load(xl), qa, sa, sel, acc, a_op, b_op,
                                        DECODE, CONSTRAINTS, MT, UNITS, TOK)
                    qa = load_weights(c_base + 2 * UNITS * 128 + c_off, cpol, 4, EVICT, WCACHE)
                    sa = load_weights(s_base + 2 * UNITS * 16 + s_off, spol, 1, EVICT, WCACHE)
                    acc = _decode_mma_x(xs.slice((i + 1) * UNITS, UNITS, dim=1).load(xl), qb, sb, sel, acc, a_op,
                                        b_op, DECODE, CONSTRAINTS, MT, UNITS, TOK)
                    c_base += 2 * UNITS * 128
                    s_base += 2 * UNITS * 16
            elif PREFETCH:
                # two K steps per iteration, ping-pong: the codes and scales of the next step are in
                # flight while this one is decoded (the last loads read pack()'s slack, unused)
                qa = load_weights(c_base + c_off, cpol, 4, EVICT, WCACHE)
                sa = load_weights(s_base + s_off, spol, 1, EVICT, WCACHE)
                if WAIT_PREV:
                    gdc_wait()
                for k0 in range(u_lo * 64, k_end, 2 * BK):
                    qb = load_weights(c_base + UNITS * 128 + c_off, cpol, 4, EVICT, WCACHE)
                    sb = load_weights(s_base + UNITS * 16 + s_off, spol, 1, EVICT, WCACHE)
                    acc = _decode_mma(qa, sa, sel, x_base, x_off, x_k, k0, K, acc, a_op, b_op, EVEN_K, DECODE,
                                      CONSTRAINTS, MT, UNITS, TOK)
                    qa = load_weights(c_base + 2 * UNITS * 128 + c_off, cpol, 4, EVICT, WCACHE)
                    sa = load_weights(s_base + 2 * UNITS * 16 + s_off, spol, 1, EVICT, WCACHE)
                    acc = _decode_mma(qb, sb, sel, x_base + BK, x_off, x_k, k0 + BK, K, acc, a_op, b_op, EVEN_K,
                                      DECODE, CONSTRAINTS, MT, UNITS, TOK)
                    c_base += 2 * UNITS * 128
                    s_base += 2 * UNITS * 16
                    x_base += 2 * BK
            else:
                if WAIT_PREV:
                    gdc_wait()
                for k0 in range(u_lo * 64, k_end, BK):
                    q = load_weights(c_base + c_off, cpol, 4, EVICT, WCACHE)
                    sw = load_weights(s_base + s_off, spol, 1, EVICT, WCACHE)
                    acc = _decode_mma(q, sw, sel, x_base, x_off, x_k, k0, K, acc, a_op, b_op, EVEN_K, DECODE,
                                      CONSTRAINTS, MT, UNITS, TOK)
                    c_base += UNITS * 128
                    s_base += UNITS * 16
                    x_base += BK

            # epilogue: rows of this CTA in the accumulator layout
            offs_r = gl.arange(0, ROWS, layout=gl.SliceLayout(1, mma))
            offs_t = gl.arange(0, TOK, layout=gl.SliceLayout(0, mma))
            tile = tile0 + offs_r // 16
            r8 = (offs_r // 8) % 2
            g = offs_r % 8
            if GATED:
                half = N // 2
                col = tile * 8 + g
                w_row = r8 * half + col
                row_ok = col < half
            else:
                w_row = tile * 16 + r8 * 8 + g
                row_ok = w_row < N
            rs = gl.load(rs_ptr + expert * stride_rse + w_row, mask=row_ok, other=0.0)
            acc = acc * (rs * GAIN)[:, None]
            ids = gl.load(ids_ptr + offs_t)
            tok_ok = ids < num_rows
            if ROUTE_WEIGHTED:
                acc = acc * gl.load(route_w_ptr + ids, mask=tok_ok, other=0.0).to(gl.float32)[None, :]
            rows_out = ids.to(gl.int64)[None, :] * stride_om
            if GATED and SPLIT_K == 1:
                _silu_store(acc, out_ptr, stride_om, ids_ptr, tile0, N, num_rows, MT, TOK)
                if SIGNAL:
                    _signal(done_ptr + pid_m)
            else:
                gl.store(out_ptr + pid_k * stride_os + rows_out + w_row[:, None],
                         acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & tok_ok[None, :])
                if FUSED_REDUCE:
                    # split-K reduction through a ticket per output tile: the last split to finish sums
                    # every split's partials in split order 0, 1, .. (bit-reproducible whoever is last),
                    # applies SiLU(gate) * up and resets the ticket for the next launch
                    _cta_barrier()
                    tick = tick_ptr + (pid_m * (n_tiles // (MT * GROUPS)) + pid_n) * GROUPS + grp
                    done = gl.atomic_add(tick, 1, sem="acq_rel", scope="gpu")
                    if done == SPLIT_K - 1:
                        _cta_barrier()
                        acc = gl.zeros([ROWS, TOK], gl.float32, layout=mma)
                        for s in gl.static_range(SPLIT_K):
                            acc += gl.load(out_ptr + s * stride_os + rows_out + w_row[:, None],
                                           mask=row_ok[:, None] & tok_ok[None, :], other=0.0, cache_modifier=".cg")
                        gl.store(tick, 0)
                        _silu_store(acc, h_ptr, stride_h, ids_ptr, tile0, N, num_rows, MT, TOK)
                        if SIGNAL:
                            _signal(done_ptr + pid_m)


    @gluon.jit
    def _moe_persistent_kernel(
            x_ptr, stride_x, c13_ptr, s13_ptr, rs13_ptr, ws_ptr, stride_ws, stride_wsm, h_ptr, stride_h,
            c2_ptr, s2_ptr, rs2_ptr, part_ptr, stride_ps, stride_pm, route_w_ptr,
            sorted_ids_ptr, expert_ids_ptr, tick_ptr, sync_ptr, num_rows, num_m_blocks,
            N13, K13, n_tiles13, k_units13, stride_ce13, stride_se13, stride_rse13,
            N2, K2, n_tiles2, k_units2, stride_ce2, stride_se2, stride_rse2,
            A_ROW_DIV: gl.constexpr, SPLIT13: gl.constexpr, SPLIT2: gl.constexpr, UNITS13: gl.constexpr,
            UNITS2: gl.constexpr, WARPS: gl.constexpr, EVEN_K13: gl.constexpr, EVEN_K2: gl.constexpr,
            DECODE: gl.constexpr, CONSTRAINTS: gl.constexpr, GAIN: gl.constexpr, TOK: gl.constexpr,
            PREFETCH13: gl.constexpr, PREFETCH2: gl.constexpr, EVICT: gl.constexpr, WCACHE: gl.constexpr):
        """Both GEMMs of the routed experts in one persistent launch. Work items, handed out in order by an
        atomic counter (sync_ptr[0]): every gate_up (expert block, row tile, K split), then every down one.
        A gate_up tile counts its finished h rows in sync_ptr[2 + block]; a down item of that block waits
        for all of them. Deadlock-free on any grid: a down item is only taken once every gate_up item has
        been taken by a running CTA, and gate_up items never wait. Which CTA computes an item does not
        change its result: bitwise reproducible. The last CTA to leave resets the counters."""
        n_progs13 = n_tiles13 // WARPS
        n_progs2 = n_tiles2 // WARPS
        items13 = num_m_blocks * n_progs13 * SPLIT13
        items = items13 + num_m_blocks * n_progs2 * SPLIT2
        done_ptr = sync_ptr + 2
        item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        while item < items:
            if item < items13:  # (block, row tile, split), the splits of a tile next to each other
                pid_m = item // (n_progs13 * SPLIT13)
                r = item % (n_progs13 * SPLIT13)
                if SPLIT13 == 1:
                    _gemm_tile(pid_m, r, 0, x_ptr, stride_x, c13_ptr, s13_ptr, rs13_ptr, h_ptr, 0, stride_h,
                               sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, done_ptr,
                               num_rows, N13, K13, n_tiles13, k_units13, stride_ce13, stride_se13, stride_rse13,
                               A_ROW_DIV, True, False, 1, UNITS13, WARPS, EVEN_K13, DECODE, CONSTRAINTS, GAIN,
                               TOK, 1, PREFETCH13, False, EVICT, WCACHE, True)
                else:
                    _gemm_tile(pid_m, r // SPLIT13, r % SPLIT13, x_ptr, stride_x, c13_ptr, s13_ptr, rs13_ptr,
                               ws_ptr, stride_ws, stride_wsm,
                               sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, done_ptr,
                               num_rows, N13, K13, n_tiles13, k_units13, stride_ce13, stride_se13, stride_rse13,
                               A_ROW_DIV, True, False, SPLIT13, UNITS13, WARPS, EVEN_K13, DECODE, CONSTRAINTS, GAIN,
                               TOK, 1, PREFETCH13, True, EVICT, WCACHE, True)
            else:
                i2 = item - items13
                pid_m = i2 // (n_progs2 * SPLIT2)
                r = i2 % (n_progs2 * SPLIT2)
                target = gl.where(gl.load(expert_ids_ptr + pid_m) >= 0, n_progs13, 0)
                ready = gl.atomic_add(done_ptr + pid_m, 0, sem="acquire", scope="gpu")
                while ready < target:
                    ready = gl.atomic_add(done_ptr + pid_m, 0, sem="acquire", scope="gpu")
                _gemm_tile(pid_m, r // SPLIT2, r % SPLIT2, h_ptr, stride_h, c2_ptr, s2_ptr, rs2_ptr,
                           part_ptr, stride_ps, stride_pm,
                           sorted_ids_ptr, expert_ids_ptr, route_w_ptr, h_ptr, stride_h, tick_ptr, done_ptr,
                           num_rows, N2, K2, n_tiles2, k_units2, stride_ce2, stride_se2, stride_rse2,
                           1, False, True, SPLIT2, UNITS2, WARPS, EVEN_K2, DECODE, CONSTRAINTS, GAIN,
                           TOK, 1, PREFETCH2, False, EVICT, WCACHE, False)
            item = gl.atomic_add(sync_ptr, 1, sem="relaxed", scope="gpu")
        # the last CTA out resets the counters for the next launch (nobody reads them any more)
        left = gl.atomic_add(sync_ptr + 1, 1, sem="acq_rel", scope="gpu")
        if left == gl.num_programs(0) - 1:
            zl: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
            offs = gl.arange(0, 32 * WARPS, layout=zl)
            for b0 in range(0, num_m_blocks, 32 * WARPS):
                gl.store(done_ptr + b0 + offs, gl.zeros([32 * WARPS], gl.int32, layout=zl),
                         mask=b0 + offs < num_m_blocks)
            gl.store(sync_ptr + offs, gl.zeros([32 * WARPS], gl.int32, layout=zl), mask=offs < 2)

    @gluon.jit
    def _signal(counter):
        """Publish this CTA's stores (CTA barrier, then a release increment at GPU scope by one thread)."""
        _cta_barrier()
        gl.atomic_add(counter, 1, sem="release", scope="gpu")

    @gluon.jit
    def _silu_store(acc, out_ptr, stride_om, ids_ptr, tile0, N, num_rows, WARPS: gl.constexpr,
                    TOK: gl.constexpr):
        """Gated epilogue: accumulator rows [w, r8, g] hold gate (r8 = 0) and up (r8 = 1) of the same output
        column in one thread; stores SiLU(gate) * up [tokens, N / 2]."""
        acc4 = gl.permute(gl.reshape(acc, [WARPS, 2, 8, TOK]), [0, 2, 3, 1])
        gate, up = gl.split(acc4)
        h = gate / (1.0 + gl.exp(-gate)) * up
        hl: gl.constexpr = gate.type.layout
        hw = gl.arange(0, WARPS, layout=gl.SliceLayout(1, gl.SliceLayout(2, hl)))
        hg = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(2, hl)))
        hn = gl.arange(0, TOK, layout=gl.SliceLayout(0, gl.SliceLayout(1, hl)))
        hcol = (tile0 + hw)[:, None, None] * 8 + hg[None, :, None]
        hids = gl.load(ids_ptr + hn)
        hok = (hcol < N // 2) & (hids < num_rows)[None, None, :]
        gl.store(out_ptr + hids.to(gl.int64)[None, None, :] * stride_om + hcol,
                 h.to(out_ptr.dtype.element_ty), mask=hok)

def available(device=None) -> bool:
    """Whether the MMA-fragment NVFP4 path can run: Gluon importable, a Hopper (sm_90) CUDA device
    (the only one it is tested on), not the interpreter, not disabled by LINRNN_NVFP4_GEMM
    (auto / mma select it; asm / triton / dot_scaled force the grouped_gemm.py paths)."""
    if not HAVE_GLUON or os.environ.get("TRITON_INTERPRET") == "1" or not torch.cuda.is_available():
        return False
    if device is not None and torch.device(device).type != "cuda":
        return False
    if os.environ.get("LINRNN_NVFP4_GEMM", "auto") not in ("auto", "mma"):
        return False
    major, _ = torch.cuda.get_device_capability(device)
    return major == 9


# Programmatic dependent launch through moe_experts_mma's chain (gate_up -> down -> combine), module docstring.
# H200, one call each (benchmarks/results/kernels/moe/round5/): one 35B-A3B layer 0.7-1.4 us faster at B = 1-128
# (23.1 vs 24.5 us at B = 1), the same at 256; engine 2.173 vs 2.253 ms/step at npl 1, 4.055 vs 4.150 at npl 8
DEFAULT_PDL = True


def pdl_default(device) -> bool:
    """Whether moe_experts_mma chains its launches with PDL: DEFAULT_PDL, unless LINRNN_MMA_PDL=0 or PDL is off or
    unavailable (LINRNN_PDL=0, before sm_90, the CPU)."""
    return (DEFAULT_PDL and os.environ.get("LINRNN_MMA_PDL", "1") != "0" and os.environ.get("LINRNN_PDL", "1") != "0"
            and pdl_available(torch.device(device)))


def split_k(k_units: int, programs: int, num_sms: int, per_sm: int = 2) -> int:
    """Smallest power-of-two split of the K units giving >= per_sm programs per SM (each split keeps
    >= 2 units), so B = 1-8 decode still fills the SMs."""
    split = 1
    while programs * split < per_sm * num_sms and k_units % (2 * split) == 0 and k_units // (2 * split) >= 2:
        split *= 2
    return split


def units_per_step(k_units: int, split: int, most: int = 4) -> int:
    """64-k units per K step: the largest power of two <= `most` dividing a split's units."""
    per = k_units // split
    units = most
    while per % units:
        units //= 2
    return units


@functools.lru_cache(maxsize=None)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device) -> int:
    return _num_sms(torch.device(device).index or 0)


def programs_per_block(w: lay.PackedNvfp4, warps: int = 4, mrep: int = 1) -> int:
    """CTAs per expert block and K split (launch's warps / mrep adjustment)."""
    T = w.codes.shape[1]
    warps = min(warps, T)
    while T % warps:
        warps //= 2
    while (T // warps) % mrep:
        mrep //= 2
    return T // (warps * mrep)


# split-K tickets: int32 counters, one buffer per device, zero between launches (each launch's last
# splits reset theirs; launches on one stream do not overlap). Allocated on first use (a warm-up,
# before any graph capture).
TICKETS = 1 << 16
_tickets: dict = {}


def tickets(device) -> torch.Tensor:
    device = torch.device(device)
    t = _tickets.get(device)
    if t is None:
        t = _tickets[device] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def _can_prefetch(prefetch: bool, w: lay.PackedNvfp4, split: int, units: int) -> bool:
    """The prefetch runs two K steps per iteration and reads up to two steps past a split's end: only with an even
    step count and over buffers with pack()'s slack."""
    U = w.codes.shape[2]
    return prefetch and (U // split // units) % 2 == 0 and lay.has_slack(w.codes) and lay.has_slack(w.scales)


def launch(x: torch.Tensor, w: lay.PackedNvfp4, out: torch.Tensor, *, num_rows: int, num_m_blocks: int,
           sorted_ids: torch.Tensor, expert_ids: torch.Tensor, route_weights=None, a_row_div: int = 1,
           split: int = 1, warps: int = 4, units: int | None = None, tokens: int = 8, groups: int = 1,
           prefetch: bool = False, h: torch.Tensor | None = None, weight_hint: str = DEFAULT_WEIGHT_HINT,
           n_fastest: bool = False, maxnreg: int | None = None, pdl_wait: bool = False,
           pdl_trigger: bool = False, adaptive: bool = False, units8: int | None = None, mrep: int = 1,
           pdl_wait_first: bool = False, smem_x: bool = False):
    """One grouped GEMM over 8-token blocks (weight_hint: the cache hint of the weight loads, WEIGHT_HINTS). out: [rows, N/2] (gated, split 1: SiLU(gate) * up) or
    f32 partials [split, rows, N] (columns in the original row order of w). Gated with split > 1 and
    h [rows, N/2] given: the last split of each tile also reduces the partials in out (fixed order,
    through tickets) and stores SiLU(gate) * up into h (no separate reduction launch). maxnreg: ptxas's
    register budget (None: its own choice; see REGISTER_BUDGET_WHY). Programmatic dependent launch (module
    docstring): pdl_trigger lets the next kernel launch at once; pdl_wait launches this one with PDL, its expert ids,
    token ids and first weights loaded before the grid dependency wait, so the previous kernel (the one whose
    output x is) must have been launched without PDL, after those were written (or with pdl_wait_first).
    pdl_wait_first: launched with PDL, waiting for the previous kernel before anything else (then pdl_trigger):
    the gate_up kernel right behind the router that wrote its alignment. adaptive (tokens = 16): blocks
    with <= 8 valid slots run the 8-token tile (ADAPT of _gemm_tile) at units8 units per K step (default: units).
    mrep: 16-row tiles per warp (MREP of _gemm_tile_body; fewer where the row tiles do not divide).
    smem_x: the prefetching loop stages a split's activations in shared memory once per CTA (XSU; one row group,
    mrep 1, K a whole number of units)."""
    E, T, U, _ = w.codes.shape
    units = units_per_step(U, split, units or 4)
    if U % (units * split):
        raise ValueError(f"k units {U} not divisible by split {split} x units {units}")
    warps = min(warps, T)
    while T % warps:
        warps //= 2
    while (T // warps) % mrep:
        mrep //= 2
    while (T // (warps * mrep)) % groups:
        groups //= 2
    adaptive = adaptive and tokens == 16
    units8 = units_per_step(U, split, units8 or units) if adaptive else 1
    prefetch8 = adaptive and _can_prefetch(prefetch, w, split, units8)
    prefetch = _can_prefetch(prefetch, w, split, units)
    scales32 = w.scales.view(torch.int32)
    grid = (num_m_blocks * (T // (warps * mrep * groups)), split)
    fused = h is not None
    if fused and not (w.gated and split > 1 and grid[0] * groups <= TICKETS):
        raise ValueError(f"the fused split-K reduction needs gated weights, split > 1 and <= {TICKETS} tiles")
    dummy = out
    _nvfp4_mma_kernel[grid](
        x, x.stride(0), w.codes, scales32, w.row_scale, out,
        out.stride(0) if out.dim() == 3 else 0, out.stride(-2),
        sorted_ids, expert_ids, route_weights if route_weights is not None else dummy,
        h if fused else dummy, h.stride(0) if fused else 0, tickets(x.device) if fused else sorted_ids,
        num_rows, w.n, w.k, T, U, num_m_blocks,
        w.codes.stride(0), scales32.stride(0), w.row_scale.stride(0),
        A_ROW_DIV=a_row_div, GATED=w.gated, ROUTE_WEIGHTED=route_weights is not None,
        SPLIT_K=split, UNITS=units, WARPS=warps, EVEN_K=w.k % 64 == 0 and w.k == U * 64,
        DECODE=DECODE_ASM, CONSTRAINTS=DECODE_CONSTRAINTS, GAIN=lay.DECODE_GAIN, TOK=tokens,
        GROUPS=groups, PREFETCH=prefetch, FUSED_REDUCE=fused,
        **_hint_consts(weight_hint), N_FASTEST=n_fastest, TRIGGER_NEXT=pdl_trigger, WAIT_PREV=pdl_wait,
        ADAPT=adaptive, UNITS8=units8, PREFETCH8=prefetch8, MREP=mrep,
        WAIT_FIRST=pdl_wait_first,
        XSU=U // split if smem_x and prefetch and mrep == 1 and groups == 1 and w.k == U * 64 else 0,
        num_warps=warps, maxnreg=maxnreg,
        **({"launch_pdl": True} if pdl_wait or pdl_wait_first else {}))


# the persistent kernel holds both GEMMs' state (74 registers uncapped, 6 CTAs per SM); capped at 64 it
# compiles without spills (sm_90, triton 3.6 / 3.9) and 8 CTAs of 4 warps fit an SM
PERSISTENT_MAXNREG = 64


def _sync(device) -> torch.Tensor:
    """The persistent kernel's counters (work, exits, one per expert block), zero between launches."""
    device = torch.device(device)
    key = ("sync", device)
    t = _tickets.get(key)
    if t is None:
        t = _tickets[key] = torch.zeros(TICKETS, dtype=torch.int32, device=device)
    return t


def launch_persistent(x: torch.Tensor, p13: lay.PackedNvfp4, p2: lay.PackedNvfp4, h: torch.Tensor, ws, part: torch.Tensor,
                      *, num_rows: int, num_m_blocks: int, sorted_ids: torch.Tensor, expert_ids: torch.Tensor,
                      route_weights: torch.Tensor, a_row_div: int, splits: tuple[int, int], warps: int = 4,
                      units: int | None = None, tokens: int = 8, prefetch: bool = False,
                      weight_hint: str = DEFAULT_WEIGHT_HINT, ctas_per_sm: int = 8):
    """gate_up (SiLU(gate) * up into h; split-K partials in ws [s13, rows, 2I], reduced by the last split) and
    down (f32 partials [s2, rows, N] into part) in one persistent launch of ctas_per_sm CTAs per SM."""
    s13, s2 = splits
    if p13.codes.shape[1] % warps or p2.codes.shape[1] % warps:
        raise ValueError(f"row tiles {p13.codes.shape[1]}, {p2.codes.shape[1]} not divisible by {warps} warps")
    if num_m_blocks * (p13.codes.shape[1] // warps) > TICKETS - 2 or (s13 > 1) != (ws is not None):
        raise ValueError("persistent MoE launch: too many expert blocks, or split-K partials without a buffer")
    args, consts = [], {}
    for p, s, tag in ((p13, s13, "13"), (p2, s2, "2")):
        U = p.codes.shape[2]
        u = units_per_step(U, s, units or 4)
        if U % (u * s):
            raise ValueError(f"k units {U} not divisible by split {s} x units {u}")
        pf = prefetch and (U // s // u) % 2 == 0 and lay.has_slack(p.codes) and lay.has_slack(p.scales)
        consts.update({f"UNITS{tag}": u, f"PREFETCH{tag}": pf, f"EVEN_K{tag}": p.k % 64 == 0 and p.k == U * 64})
    c13, sc13 = p13.codes, p13.scales.view(torch.int32)
    c2, sc2 = p2.codes, p2.scales.view(torch.int32)
    dummy = part
    grid = (num_sms(x.device) * ctas_per_sm,)
    _moe_persistent_kernel[grid](
        x, x.stride(0), c13, sc13, p13.row_scale, ws if ws is not None else dummy,
        ws.stride(0) if ws is not None else 0, ws.stride(1) if ws is not None else 0, h, h.stride(0),
        c2, sc2, p2.row_scale, part, part.stride(0), part.stride(1), route_weights,
        sorted_ids, expert_ids, tickets(x.device), _sync(x.device), num_rows, num_m_blocks,
        p13.n, p13.k, p13.codes.shape[1], p13.codes.shape[2], c13.stride(0), sc13.stride(0), p13.row_scale.stride(0),
        p2.n, p2.k, p2.codes.shape[1], p2.codes.shape[2], c2.stride(0), sc2.stride(0), p2.row_scale.stride(0),
        A_ROW_DIV=a_row_div, SPLIT13=s13, SPLIT2=s2, WARPS=warps, DECODE=DECODE_ASM, CONSTRAINTS=DECODE_CONSTRAINTS,
        GAIN=lay.DECODE_GAIN, TOK=tokens, **_hint_consts(weight_hint), **consts, num_warps=warps,
        maxnreg=PERSISTENT_MAXNREG)


# ---------------------------------------------------------------------------------------------
# Offline compilation (tests, benchmark tables): SASS of the kernel for sm_90 without a GPU

def compile_offline(gated: bool = True, split: int = 1, units: int = 4, warps: int = 4,
                    route_weighted: bool = False, arch: int = 90, tokens: int = 8, groups: int = 1,
                    prefetch: bool = False, fused_reduce: bool = False, weight_hint: str = "none",
                    maxnreg: int | None = None, pdl_wait: bool = False, pdl_trigger: bool = False,
                    adaptive: bool = False, units8: int | None = None, prefetch8: bool | None = None,
                    mrep: int = 1, pdl_wait_first: bool = False, xsu: int = 0):
    """triton.compile the kernel for sm_<arch> (no GPU needed; maxnreg, pdl_*, adaptive as in launch; xsu: the units
    per split staged in shared memory, XSU); returns the CompiledKernel."""
    from triton.backends.compiler import GPUTarget
    sig = {"x_ptr": "*bf16", "stride_x": "i32", "codes_ptr": "*i32", "scales_ptr": "*i32", "rs_ptr": "*fp32",
           "out_ptr": "*bf16" if (gated and split == 1) else "*fp32", "stride_os": "i32", "stride_om": "i32",
           "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "route_w_ptr": "*bf16",
           "h_ptr": "*bf16", "stride_h": "i32", "tick_ptr": "*i32", "num_rows": "i32", "N": "i32", "K": "i32", "n_tiles": "i32", "k_units": "i32",
           "num_m_blocks": "i32", "stride_ce": "i64", "stride_se": "i64", "stride_rse": "i64"}
    consts = dict(A_ROW_DIV=8 if gated else 1, GATED=gated, ROUTE_WEIGHTED=route_weighted, SPLIT_K=split,
                  UNITS=units, WARPS=warps, EVEN_K=True, DECODE=DECODE_ASM, CONSTRAINTS=DECODE_CONSTRAINTS,
                  GAIN=lay.DECODE_GAIN, TOK=tokens, GROUPS=groups, PREFETCH=prefetch,
                  FUSED_REDUCE=fused_reduce, **_hint_consts(weight_hint), N_FASTEST=False, TRIGGER_NEXT=pdl_trigger,
                  WAIT_PREV=pdl_wait, ADAPT=adaptive and tokens == 16, UNITS8=units8 or units,
                  PREFETCH8=prefetch if prefetch8 is None else prefetch8, MREP=mrep, WAIT_FIRST=pdl_wait_first,
                  XSU=xsu)
    for k in consts:
        sig[k] = "constexpr"
    # what the JIT specializes at run time: pointers and these ints divisible by 16
    div16 = {"x_ptr", "stride_x", "codes_ptr", "scales_ptr", "rs_ptr", "out_ptr", "stride_os", "stride_om",
             "sorted_ids_ptr", "expert_ids_ptr", "route_w_ptr", "h_ptr", "stride_h", "tick_ptr", "N", "K", "stride_ce", "stride_se", "stride_rse"}
    names = list(_nvfp4_mma_kernel.arg_names)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = gluon._runtime.GluonASTSource(fn=_nvfp4_mma_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": warps, "maxnreg": maxnreg})


def compile_persistent_offline(splits: tuple[int, int] = (1, 1), units: int = DEFAULT_UNITS, warps: int = 4,
                               prefetch: bool = DEFAULT_PREFETCH, arch: int = 90, weight_hint: str = DEFAULT_WEIGHT_HINT):
    """triton.compile the persistent two-GEMM kernel for sm_<arch> (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    ptrs = {"x_ptr": "*bf16", "c13_ptr": "*i32", "s13_ptr": "*i32", "rs13_ptr": "*fp32", "ws_ptr": "*fp32",
            "h_ptr": "*bf16", "c2_ptr": "*i32", "s2_ptr": "*i32", "rs2_ptr": "*fp32", "part_ptr": "*fp32",
            "route_w_ptr": "*bf16", "sorted_ids_ptr": "*i32", "expert_ids_ptr": "*i32", "tick_ptr": "*i32",
            "sync_ptr": "*i32"}
    consts = dict(A_ROW_DIV=8, SPLIT13=splits[0], SPLIT2=splits[1], UNITS13=units, UNITS2=units, WARPS=warps,
                  EVEN_K13=True, EVEN_K2=True, DECODE=DECODE_ASM, CONSTRAINTS=DECODE_CONSTRAINTS, GAIN=lay.DECODE_GAIN,
                  TOK=8, PREFETCH13=prefetch, PREFETCH2=prefetch, **_hint_consts(weight_hint))
    names = list(_moe_persistent_kernel.arg_names)
    sig = {n: ptrs.get(n, "constexpr" if n in consts else ("i64" if n.startswith(("stride_ce", "stride_se", "stride_rse"))
                                                           else "i32")) for n in names}
    div16 = [n for n in names if n in ptrs or n.startswith(("stride", "N", "K"))]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in div16}
    src = gluon._runtime.GluonASTSource(fn=_moe_persistent_kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": warps, "maxnreg": PERSISTENT_MAXNREG})


def _sass(cubin: bytes, what: str = "-sass") -> str:
    import subprocess
    import tempfile

    from triton.backends.nvidia import compiler as nvc

    tool = os.path.join(os.path.dirname(nvc.__file__), "bin", "cuobjdump")  # shipped with triton
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, what, f.name], check=True, capture_output=True, text=True).stdout


@functools.lru_cache(maxsize=None)
def k_loop_stats(gated: bool = True, split: int = 1, units: int = DEFAULT_UNITS, warps: int = 4, arch: int = 90,
                 tokens: int = 8, groups: int = 1, prefetch: bool = DEFAULT_PREFETCH, fused_reduce: bool = False,
                 weight_hint: str = DEFAULT_WEIGHT_HINT, maxnreg: int | None = None, adaptive: bool = False,
                 units8: int | None = None, mrep: int = 1) -> dict:
    """SASS statistics of the kernel's K loop compiled for sm_<arch> (no GPU needed):
    instructions per loop iteration and per weight (thread instructions / weights a thread
    consumes: 16 * mrep rows x 64 * units k per warp), opcode counts, shared-memory / barrier opcodes in
    the loop, register spills, registers and shared memory of the kernel. adaptive (tokens 16): the kernel holds
    a 16- and an 8-token K loop (units8 units per step, default units); the statistics are the 16-token loop's,
    "per_weight_8" / "smem_ops_in_loop_8" / "loads_before_mma_8" the 8-token loop's."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return in_clean_process(__name__, "k_loop_stats", gated=gated, split=split, units=units, warps=warps, arch=arch,
                                 tokens=tokens, groups=groups, prefetch=prefetch, fused_reduce=fused_reduce,
                                 weight_hint=weight_hint, maxnreg=maxnreg, adaptive=adaptive, units8=units8, mrep=mrep)
    k = compile_offline(gated=gated, split=split, units=units, warps=warps, route_weighted=not gated, arch=arch,
                        tokens=tokens, groups=groups, prefetch=prefetch, fused_reduce=fused_reduce,
                        weight_hint=weight_hint, maxnreg=maxnreg, adaptive=adaptive, units8=units8, mrep=mrep)
    weights = 16 * mrep * 64 * units // 32 * (2 if prefetch else 1)  # the prefetching loop runs two K steps
    smem = ("STS", "LDS", "LDSM", "BAR", "STSM")
    if adaptive and tokens == 16:
        weights8 = 16 * mrep * 64 * (units8 or units) // 32 * (2 if prefetch else 1)
        st8 = sass_loop_stats(k, "HMMA", weights8, loop_16=False)
        st = sass_loop_stats(k, "HMMA", weights, loop_16=True)
        if st8["ops"]["HMMA"] * 2 * units != st["ops"]["HMMA"] * (units8 or units):
            raise RuntimeError(f"adaptive kernel: expected an 8- and a 16-token K loop, got {st8['ops']} / {st['ops']}")
        st.update(per_weight_8=st8["per_weight"], loads_before_mma_8=st8["loads_before_mma"],
                  smem_ops_in_loop_8=sum(v for o, v in st8["ops"].items() if o in smem))
    else:
        st = sass_loop_stats(k, "HMMA", weights)
    st["smem_ops_in_loop"] = sum(v for o, v in st["ops"].items() if o in smem)
    return st


def _shared_a_fraction(body: list[str]) -> float:
    """Of a loop's HMMAs, the fraction whose A operand register is the previous HMMA's, unwritten in between: ~1/2 in
    the 16-token loop (two n8 MMAs per decoded A fragment), ~0 in the 8-token loop."""
    import re

    shared, last, mmas = 0, None, 0
    for t in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", t)
        regs = [r.split(".")[0] for r in re.findall(r"\bR\d+(?:\.reuse)?", op)]
        if op.startswith("HMMA"):
            mmas += 1
            shared += last is not None and regs[1] == last
            last = regs[1]
        elif regs and regs[0] == last:  # the destination (first operand) overwrites it
            last = None
    return shared / max(mmas, 1)


def sass_loop_stats(k, mma_op: str, weights_per_iter: int, loop_16: bool | None = None) -> dict:
    """SASS statistics of a compiled kernel's K loop: the innermost backward branch whose body issues
    `mma_op` (HMMA: mma.sync; HGMMA: wgmma; an outer loop may run over row groups; the shortest such loop unless
    loop_16 is given: of an adaptive kernel's two K loops, the 16-token (True) or the 8-token (False) one,
    told apart by their HMMAs sharing A fragments, _shared_a_fraction). Instructions per
    weight, op counts, global loads issued before the loop's first MMA, spills and atomics anywhere in the
    kernel, registers, shared memory."""
    import collections
    import re

    sass = _sass(k.asm["cubin"])
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2).strip()))
    loops = []
    for addr, text in ins:
        m = re.search(r"BRA (0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            loops.append((int(m.group(1), 16), addr))
    loops = [r for r in loops if any(r[0] <= a <= r[1] and mma_op in t for a, t in ins)]
    if not loops:
        raise RuntimeError(f"no loop with {mma_op} found in the SASS")
    if loop_16 is not None:
        shared = {r: _shared_a_fraction([t for a, t in ins if r[0] <= a <= r[1]]) for r in loops}
        lo, hi = (max if loop_16 else min)(loops, key=lambda r: (shared[r], r[0] - r[1]))
    else:
        lo, hi = min(loops, key=lambda r: r[1] - r[0])
    body = [t for a, t in ins if lo <= a <= hi]
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
    first_mma = next(i for i, t in enumerate(body) if mma_op in t)
    # wgmma kernels: the loop's work issued while its wgmmas run (from the last one, around the back edge, to the
    # next wgmma wait)
    last = max(i for i, t in enumerate(body) if mma_op in t)
    after = body[last + 1:] + body[:last + 1]
    wait = next((i for i, t in enumerate(after) if "WARPGROUP.DEPBAR" in t), 0)
    in_flight = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in after[:wait])
    res = re.search(r"REG:(\d+)", _sass(k.asm["cubin"], "-res-usage"))
    return {"instructions": len(body), "per_weight": len(body) / weights_per_iter, "ops": dict(ops),
            "ops_under_mma": dict(in_flight),
            "loads_before_mma": sum(1 for t in body[:first_mma] if re.search(r"\bLDG\b", t)),
            "spill_ops": sum(1 for _, t in ins if re.search(r"\b(STL|LDL)\b", t)),
            "atomics": sum(1 for _, t in ins if re.search(r"\b(ATOMG|RED)\b", t)),
            "regs": int(res.group(1)) if res else None, "shared": k.metadata.shared}


def staged_x_stats(units: int = 1, xsu: int = 8, maxnreg: int | None = 40, tokens: int = 8) -> dict:
    """SASS facts of the down kernel with its split's activations staged in shared memory (XSU; sm_90 compile, no
    GPU): its K steps are unrolled, so the K region runs from the copy's CTA barrier to the last HMMA. Registers,
    spills, shared memory, the STS / BAR up to the region (the copy) and inside it (none may be: the decoded weights
    never pass through shared memory), the LDS inside it, instructions per weight of the region."""
    import re

    if os.environ.get("TRITON_INTERPRET") == "1":
        return in_clean_process(__name__, "staged_x_stats", units=units, xsu=xsu, maxnreg=maxnreg, tokens=tokens)
    k = compile_offline(gated=False, route_weighted=True, split=1, units=units, prefetch=True, tokens=tokens,
                        weight_hint=DEFAULT_WEIGHT_HINT, maxnreg=maxnreg, pdl_wait=True, pdl_trigger=True, xsu=xsu)
    ops = [re.sub(r"^@!?U?P\w+\s+", "", m.group(1).strip())
           for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", _sass(k.asm["cubin"]))]
    mma = [i for i, t in enumerate(ops) if t.startswith("HMMA")]
    bar = next(i for i, t in enumerate(ops) if t.startswith("BAR"))  # the end of the copy
    lo, hi = bar + 1, mma[-1]
    region = ops[lo:hi + 1]

    def count(pat, seq):
        return sum(1 for t in seq if re.match(pat, t))
    weights = 16 * 64 * xsu // 32  # a lane's weights over the split
    return {"regs": int(re.search(r"REG:(\d+)", _sass(k.asm["cubin"], "-res-usage")).group(1)),
            "spill_ops": count(r"(STL|LDL)\b", ops), "shared": k.metadata.shared, "hmma": len(mma),
            "sts_before": count(r"STS", ops[:lo]), "bar_before": count(r"BAR", ops[:lo]),  # the copy
            "smem_stores_in_k": count(r"(STS|STSM|BAR)", region), "lds_in_k": count(r"LDS", region),
            "per_weight": len(region) / weights}


def pdl_order_stats(gated: bool = False, split: int = 2, units: int = DEFAULT_UNITS, prefetch: bool = DEFAULT_PREFETCH,
                    maxnreg: int | None = 80, pdl_wait: bool = True, pdl_trigger: bool = True,
                    pdl_wait_first: bool = False) -> dict:
    """Where the grid dependency instructions sit in the kernel compiled for sm_90 (no GPU; evict-first weight loads,
    so LDG.E.EF are weights and plain 16-byte LDG activations): `trigger_first` (launch_dependents, PREEXIT, before
    any load), `wait_before_trigger` (a grid dependency wait, ACQBULK, before it), the weight / activation / all
    loads issued before the first wait, whether every EXIT directly follows a wait, and the K loop's statistics
    (k_loop_stats). pdl_wait_first: as in compile_offline."""
    import re

    if os.environ.get("TRITON_INTERPRET") == "1":
        return in_clean_process(__name__, "pdl_order_stats", gated=gated, split=split, units=units, prefetch=prefetch,
                                maxnreg=maxnreg, pdl_wait=pdl_wait, pdl_trigger=pdl_trigger,
                                pdl_wait_first=pdl_wait_first)
    k = compile_offline(gated=gated, split=split, units=units, route_weighted=not gated, prefetch=prefetch,
                        fused_reduce=gated and split > 1, weight_hint="evict_first", maxnreg=maxnreg,
                        pdl_wait=pdl_wait, pdl_trigger=pdl_trigger, pdl_wait_first=pdl_wait_first)
    body = [m.group(1).strip() for m in re.finditer(r"/\*[0-9a-f]{4,}\*/\s+(.*?);", _sass(k.asm["cubin"]))]
    ops = [re.sub(r"^@!?U?P\w+\s+", "", t) for t in body]
    first_wait = next((i for i, t in enumerate(ops) if t.startswith("ACQBULK")), len(ops))
    first_load = next(i for i, t in enumerate(ops) if t.startswith("LDG"))
    trigger = next((i for i, t in enumerate(ops) if t.startswith("PREEXIT")), None)
    before = ops[:first_wait]
    weights_per_iter = 16 * 64 * units // 32 * (2 if prefetch else 1)
    st = sass_loop_stats(k, "HMMA", weights_per_iter)
    return {"trigger_first": trigger is not None and trigger < first_load,
            "wait_before_trigger": trigger is not None and first_wait < trigger,
            "loads_before_wait": sum(t.startswith("LDG") for t in before),
            "waits": sum(t.startswith("ACQBULK") for t in ops),
            "weight_loads_before_wait": sum(t.startswith("LDG.E.EF") for t in before),
            "activation_loads_before_wait": sum(bool(re.match(r"LDG\.E\.128\b", t)) for t in before),
            "exits_without_wait": sum(1 for i, t in enumerate(ops) if t.startswith("EXIT")
                                      and not (i and ops[i - 1].startswith("ACQBULK"))),
            "per_weight": st["per_weight"], "loop_instructions": st["instructions"], "regs": st["regs"],
            "spill_ops": st["spill_ops"], "smem_ops_in_loop": sum(v for o, v in st["ops"].items()
                                                                   if o in ("STS", "LDS", "LDSM", "BAR", "STSM"))}


def persistent_compile_stats(splits: tuple[int, int] = (1, 1)) -> dict:
    """SASS facts of the persistent two-GEMM kernel compiled for sm_90 (no GPU needed): registers, shared
    memory, the number of innermost HMMA K loops, spill opcodes inside them, the atomic opcodes of the
    kernel. Compiles in a clean process under TRITON_INTERPRET (see k_loop_stats)."""
    import re

    if os.environ.get("TRITON_INTERPRET") == "1":
        return in_clean_process(__name__, "persistent_compile_stats", splits=list(splits))
    k = compile_persistent_offline(splits=tuple(splits))
    sass = _sass(k.asm["cubin"])
    regs = int(re.search(r"REG:(\d+)", _sass(k.asm["cubin"], "-res-usage")).group(1))
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins for m in [re.search(r"BRA (0x[0-9a-f]+)", t)]
             if m and int(m.group(1), 16) < a]

    def has_mma(lo, hi):
        return any(lo <= a <= hi and "HMMA" in t for a, t in ins)

    k_loops = [(lo, hi) for lo, hi in loops if has_mma(lo, hi)
               and not any(lo < lo2 and hi2 <= hi for lo2, hi2 in loops if (lo2, hi2) != (lo, hi) and has_mma(lo2, hi2))]
    return {"regs": regs, "shared": k.metadata.shared, "k_loops": len(k_loops),
            "k_loop_spills": sum(1 for lo, hi in k_loops for a, t in ins
                                 if lo <= a <= hi and re.search(r"\b(STL|LDL)\b", t)),
            "atomics": re.findall(r"(?:ATOMG|RED)\.[A-Z0-9.]*", sass)}


def ptx_operand_wiring(gated: bool = True, split: int = 1, units: int = DEFAULT_UNITS, tokens: int = 8,
                       prefetch: bool = DEFAULT_PREFETCH, weight_hint: str = DEFAULT_WEIGHT_HINT, mrep: int = 1,
                       adaptive: bool = False) -> dict:
    """Where every mma.sync operand of the kernel (compiled for sm_90, no GPU) comes from, checked against the
    packed layout (nvfp4_layout): A registers a0..a3 are the decoded pair j of the lane's code words 0..3
    (cb 0 row g, cb 0 row g + 8, cb 1 row g, cb 1 row g + 8) of one 16-byte load, j the same for all four, and
    scaled by the word's row scale; B registers b0, b1 are registers (2 j', 2 j' + 1) of one 16-byte activation
    load with j' = j % 2, the two MMAs of a load taking pairs j and j + 1 of the same code words (no register
    move: k = 16 t + 4 j + 2 cb + h on both sides). Returns {"mmas": count, "errors": [...]}."""
    import re

    if os.environ.get("TRITON_INTERPRET") == "1":
        return in_clean_process(__name__, "ptx_operand_wiring", gated=gated, split=split, units=units, tokens=tokens,
                                prefetch=prefetch, weight_hint=weight_hint, mrep=mrep, adaptive=adaptive)
    ptx = compile_offline(gated=gated, split=split, units=units, route_weighted=not gated, tokens=tokens,
                          prefetch=prefetch, fused_reduce=gated and split > 1, weight_hint=weight_hint, mrep=mrep,
                          adaptive=adaptive).asm["ptx"]
    vec = {}  # register -> (its position in a 16-byte load, the load's registers)
    for m in re.finditer(r"ld\.global[\w:.]*\.v4\.b32\s*\{\s*(%r\d+),\s*(%r\d+),\s*(%r\d+),\s*(%r\d+)\s*\}", ptx):
        for i, r in enumerate(m.groups()):
            vec[r] = (i, m.groups())
    dec = {}  # decoded register -> (decode block, code word register, pair j, scale row)
    for b, block in enumerate(ptx.split("mov.b32 nz, 0x80008000;")[1:]):
        block = block.split("}")[0]
        words = re.findall(r"and\.b32 %r\d+, (%r\d+), 0x81C081C0;", block)
        fmas = re.findall(r"fma\.rn\.bf16x2 (%r\d+), %r\d+, s(\d), nz;", block)
        for i, (out, row) in enumerate(fmas):
            dec[out] = (b, words[i // 4], i % 4, int(row))
    errors, mmas = [], re.findall(r"mma\.sync\.aligned\.m16n8k16[^{]*\{[^}]*\},\s*\{([^}]*)\},\s*\{([^}]*)\}", ptx)
    pairs = {}  # (decode block, code-word load) -> {j: activation load}
    for a_txt, b_txt in mmas:
        a = [r.strip() for r in a_txt.split(",")]
        bb = [r.strip() for r in b_txt.split(",")]
        src = [dec.get(r) for r in a]
        if None in src:
            errors.append(f"A operand not straight from the decode: {a}")
            continue
        j = src[0][2]
        if {x[0] for x in src} != {src[0][0]} or {x[2] for x in src} != {j}:
            errors.append(f"A operand mixes decode blocks or pairs: {src}")
        if any(w not in vec for _, w, _, _ in src) or len({vec[w][1] for _, w, _, _ in src}) != 1:
            errors.append(f"A words not of one 16-byte load: {src}")
        elif [vec[w][0] for _, w, _, _ in src] != [0, 1, 2, 3] or [x[3] for x in src] != [0, 1, 0, 1]:
            errors.append(f"A words / scale rows out of layout order: {[(vec[w][0], x) for x in src for w in [x[1]]]}")
        if any(r not in vec for r in bb) or vec[bb[0]][1] != vec[bb[1]][1] \
                or (vec[bb[0]][0], vec[bb[1]][0]) != (2 * (j % 2), 2 * (j % 2) + 1):
            errors.append(f"B operand {bb} is not the ready pair {j % 2} of one 16-byte load (pair j = {j})")
        else:
            pairs.setdefault((src[0][0], vec[src[0][1]][1]), {})[j] = vec[bb[0]][1]
    for key, by_j in pairs.items():
        if sorted(by_j) != [0, 1, 2, 3] or by_j[0] != by_j[1] or by_j[2] != by_j[3] or by_j[0] == by_j[2]:
            errors.append(f"decode block {key[0]}: pairs j -> activation loads {by_j} (want j, j + 1 on one load)")
    return {"mmas": len(mmas), "errors": errors[:8]}


def in_clean_process(module: str, fn: str, **kwargs) -> dict:
    """`module.fn(**kwargs)` (a module with this __main__ convention) in a fresh interpreter without TRITON_INTERPRET: once a kernel has run
    in the interpreter, triton.language is patched for the whole process and real compilation breaks."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", module, fn, json.dumps(kwargs)], env=env,
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


if __name__ == "__main__":  # a compile-statistics function in a clean process: python -m ... k_loop_stats '{"gated": true}'
    import json
    import sys

    print(json.dumps(globals()[sys.argv[1]](**json.loads(sys.argv[2]))))
