"""Routed-expert computation with Triton (SPEC §1.8): align -> grouped gate_up GEMM with fused
SiLU*up -> grouped down GEMM with the routing weight -> deterministic top-k combine.

Every buffer has a size fixed by (T, top_k, E, config) and no step reads a device value on the
host, so the whole thing can be captured in a CUDA graph.
"""
from __future__ import annotations

import os
from typing import NamedTuple

import torch

from linrnn_kernels.moe import grouped_gemm as gg
from linrnn_kernels.moe import nvfp4_mma, nvfp4_wgmma
from linrnn_kernels.moe.align import moe_align_block_size
from linrnn_kernels.quant import WeightTensor

# Path choice for NVFP4 experts by the mean number of (token, expert) pairs per expert. With repacked weights on
# Hopper: the MMA-fragment kernel below WGMMA_MIN_MEAN_PAIRS, the wgmma kernel from it. The two thresholds after
# this one apply where the wgmma kernel cannot run (no repack, other shapes, LINRNN_NVFP4_WGMMA=0).
# Up to this mean number of (token, expert) pairs per expert the 8-token MMA-fragment kernel runs (it
# decodes every weight tile once per 8 tokens); above it the dequantize-in-tile grouped GEMM with wide row
# blocks. H200, one 35B-A3B layer, CUDA-graph replays (tools/gpu_prefill.sh part D, 2026-11-24), MMA vs
# grouped GEMM: 128 tokens (4 pairs/expert) 183 vs 329 us, 512 (16) 323 vs 383, 1024 (32) 560 vs 537,
# 2048 (64) 1032 vs 1408, 4096 (128) 2087 vs 2195 (dequantize + bf16: 1939)
MMA_MAX_MEAN_PAIRS = 64

# At and above this mean number of pairs per expert (and on a GPU, activations bf16) NVFP4 experts are
# dequantized once per layer call into a bf16 scratch and the bf16 grouped GEMM runs on it (prefill:
# the GEMMs are compute-bound there and bf16 tensor cores need no decode); dequant.py
# H200, 35B-A3B shapes (results/kernels/moe/prefill): the dequantization costs ~0.88 ms per layer call;
# B = 2048 (64 pairs per expert): 1.41 ms NVFP4 grouped GEMM vs 1.57 dequant + bf16 (a loss);
# B = 4096 (128): 2.16 vs 1.93; B = 8192: 4.23 vs 2.99
DEQUANT_MIN_MEAN_PAIRS = 128

# From this mean number of (token, expert) pairs per expert (and with repacked NVFP4 weights on Hopper) the
# wide-token wgmma kernel (nvfp4_wgmma.py: each weight tile decoded once per 64-token expert block) runs instead
# of the MMA kernel, the grouped GEMM and the dequantization. H200, one 35B-A3B layer, CUDA-graph replays, wgmma vs
# MMA kernel in one run (benchmarks/results/kernels/moe/prefill_wgmma/round2/, 96df7e1): 512 tokens (16 pairs per
# expert) 303 vs 256 us, 1024 (32) 328 vs 422, 2048 501.7 vs 744, 4096 850 vs 1456, 8192 1531 vs 3049; linear
# between 16 and 32 pairs the two cross at ~21 (round 1 had the MMA kernel at 326 us at 512 tokens: threshold 16).
# Round 3 (the chunked alignment, the Triton permute; benchmarks/results/kernels/moe-prefill/round3/): the wgmma
# layer 473.3 / 1386.0 us at 2048 / 8192 tokens (was 503.1 / 1527.1 in the same run); the crossover not re-measured.
# (dequantize + bf16, round 1: 1561 / 1942 / 2999 us at 2048 / 4096 / 8192; bf16 weights: 691 / 1060 / 2127)
WGMMA_MIN_MEAN_PAIRS = 21

# Prefill is processed in token chunks so the f32 [T * k, H] partials stay bounded (8192 tokens x top-8 x H=2048 x
# 4 B = 512 MB, inside the activation peak the engine measures at start-up); decode batches never reach it. 8192,
# the default token budget on large GPUs, runs as one launch: wgmma 1612 us per layer vs 2 x 867 in two 4096-token
# chunks (H200, benchmarks/results/kernels/moe/prefill_wgmma/).
MAX_CHUNK_TOKENS = 8192


def supported(x: torch.Tensor, *weights: WeightTensor) -> bool:
    """Whether the Triton path can run these weights on x's device (E4M3 conversions need sm_89+). Compiled, the
    grouped GEMMs decode quantized weights to 16-bit MMA operands: f32 activations (`--dtype float32`, e.g. an
    f32 KL reference) take the naive path there."""
    if not x.is_cuda:
        return True  # interpreter
    major, minor = torch.cuda.get_device_capability(x.device)
    if (major, minor) < (8, 0):
        return False
    if x.dtype == torch.float32 and any(w.fmt != "dense" for w in weights):
        return False
    return all(w.fmt == "dense" for w in weights) or (major, minor) >= (8, 9)


class Partials(NamedTuple):
    """The routed experts' output before its top-k / split-K combine: out[t] = sum_j sum_s part[s, t * group + j]
    (f32 [splits, T * group, H]); a fused consumer (the shared expert's down projection) combines them."""
    part: torch.Tensor
    group: int


class Alignment(NamedTuple):
    """moe_align_block_size's outputs computed ahead (the fused router), for block_m rows per block;
    pair_blocks: align.moe_pair_blocks' instead (block b = pair b, token n in slot n; the MMA kernel only)."""

    sorted_ids: torch.Tensor
    expert_ids: torch.Tensor
    num_padded: torch.Tensor
    block_m: int
    pair_blocks: bool = False


def aligned(topk_ids: torch.Tensor, num_experts: int, block_m: int, alignment: Alignment | None,
            pair_blocks_ok: bool = False):
    """(sorted_ids, expert_ids) for block_m-token expert blocks: the alignment computed ahead (e.g. by the
    fused router) when it used the same block size (and is expert-sorted, unless the caller takes pair
    blocks), else moe_align_block_size."""
    if (alignment is not None and alignment.block_m == block_m
            and (pair_blocks_ok or not alignment.pair_blocks)):
        return alignment.sorted_ids, alignment.expert_ids
    sorted_ids, expert_ids, _ = moe_align_block_size(topk_ids, num_experts, block_m)
    return sorted_ids, expert_ids


def expert_block_m(num_tokens: int, top_k: int, num_experts: int) -> int:
    """The block_m moe_configs picks for this batch (so a router can align for it ahead of time)."""
    over = gg._config_override("gate_up") or gg._config_override("down")
    return over.block_m if over else gg.moe_block_m(num_tokens, top_k, num_experts)


def moe_configs(num_tokens: int, top_k: int, num_experts: int, inter: int, hidden: int,
                fmt13: str, fmt2: str, device) -> tuple[gg.GemmConfig, gg.GemmConfig]:
    """(gate_up, down) configs: the default table, or LINRNN_MOE_{GATE_UP,DOWN}_CONFIG overrides."""
    over13, over2 = gg._config_override("gate_up"), gg._config_override("down")
    block_m = expert_block_m(num_tokens, top_k, num_experts)
    active = min(num_experts, num_tokens * top_k)
    cfg13 = over13 or gg.default_config(fmt13, True, block_m, active, inter, hidden, device)
    cfg2 = over2 or gg.default_config(fmt2, False, block_m, active, hidden, inter, device)
    return cfg13, cfg2


def moe_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                w13: WeightTensor, w2: WeightTensor, *, configs=None, nvfp4_path: str | None = None,
                alignment: Alignment | None = None, combine: bool = True):
    """Triton twin of naive.moe_experts. `configs` = (gate_up, down) GemmConfigs with equal
    block_m (default: moe_configs); `nvfp4_path` = "asm" | "triton" | "dot_scaled" forces that
    grouped-GEMM decode; None or "mma" picks by batch: the MMA-fragment kernel for decode batches
    (packed weights, Hopper), bf16 dequantization for large ones, else nvfp4_gemm_path().
    `alignment`: topk_ids already aligned (used when its block_m matches the path's: 8 for the MMA path; pair
    blocks only there).
    combine=False: return the uncombined Partials where the path has them (decode batches), else the output."""
    if x.dim() != 2:
        raise ValueError(f"x must be [T, H], got shape {tuple(x.shape)}")
    if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} "
                         f"must both be [T={x.shape[0]}, k]")
    T, H = x.shape
    top_k = topk_ids.shape[1]
    if w13.data.dim() != 3:
        raise ValueError(f"w13 must be stacked [E, 2I, H], data shape {tuple(w13.data.shape)}")
    E = w13.data.shape[0]
    inter = w13.out_features // 2
    gg.check_weight(w13, "w13", E, 2 * inter, H)
    gg.check_weight(w2, "w2", E, H, inter)
    if nvfp4_path == "mma":  # the default NVFP4 paths by batch size (the MMA kernel where it can run)
        nvfp4_path = None
    wgmma = configs is None and nvfp4_path is None and _wgmma_prefill(x, T * top_k, E, w13, w2)
    if (not wgmma and configs is None and nvfp4_path is None and w13.fmt == "nvfp4" and w2.fmt == "nvfp4" and x.is_cuda
            and x.dtype == torch.bfloat16 and T * top_k >= DEQUANT_MIN_MEAN_PAIRS * E
            and not gg._interpreting() and gg.nvfp4_gemm_path(x.device) != "dot_scaled"):  # sm_100: FP4 MMA
        from linrnn_kernels.moe import dequant

        return moe_experts(x, topk_weights, topk_ids, dequant.dequantize(w13, x.dtype),
                           dequant.dequantize(w2, x.dtype))
    out = gg.alloc(T, H, dtype=x.dtype, device=x.device)
    if T == 0:
        return out
    if T > MAX_CHUNK_TOKENS and configs is None:
        for lo in range(0, T, MAX_CHUNK_TOKENS):
            hi = min(T, lo + MAX_CHUNK_TOKENS)
            out[lo:hi] = moe_experts(x[lo:hi], topk_weights[lo:hi], topk_ids[lo:hi], w13, w2,
                                     nvfp4_path=nvfp4_path)
        return out
    x = x.contiguous()
    P = T * top_k
    if wgmma:
        return moe_experts_wgmma(x, topk_weights, topk_ids, w13.packed, w2.packed, out, alignment=alignment,
                                 combine=combine, **wgmma_tile())
    if configs is None and nvfp4_path is None and _mma_decode(x, P, E, w13, w2):
        return moe_experts_mma(x, topk_weights, topk_ids, w13.packed, w2.packed, out, alignment=alignment,
                               combine=combine)
    cfg13, cfg2 = configs or moe_configs(T, top_k, E, inter, H, w13.fmt, w2.fmt, x.device)
    if cfg13.block_m != cfg2.block_m:
        raise ValueError(f"gate_up and down configs must share block_m ({cfg13.block_m} != {cfg2.block_m})")
    sorted_ids, expert_ids = aligned(topk_ids, E, cfg13.block_m, alignment)
    blocks = expert_ids.numel()
    common = dict(num_rows=P, num_m_blocks=blocks, sorted_ids=sorted_ids, expert_ids=expert_ids,
                  nvfp4_path=nvfp4_path)

    h = gg.alloc(P, inter, dtype=x.dtype, device=x.device)
    if cfg13.split_k == 1:
        gg.launch_gemm(x, w13, h, cfg13, n=inter, k=H, a_row_div=top_k, gated=True, **common)
    else:
        ws = gg.alloc(cfg13.split_k, P, 2 * inter, dtype=torch.float32, device=x.device)
        gg.launch_gemm(x, w13, ws, cfg13, n=inter, k=H, a_row_div=top_k, gated=True, **common)
        gg.silu_mul_reduce(ws, h)

    # [split, T * k, H] f32 partials, combined over k (and splits) in a fixed order: deterministic
    part = gg.alloc(cfg2.split_k, P, H, dtype=torch.float32, device=x.device)
    route_w = topk_weights.reshape(-1).contiguous()
    gg.launch_gemm(h, w2, part, cfg2, n=H, k=inter, route_weights=route_w, **common)
    if not combine:
        return Partials(part, top_k)
    gg.sum_reduce(part, out, group=top_k)
    return out


def _mma_decode(x: torch.Tensor, num_pairs: int, num_experts: int, w13: WeightTensor, w2: WeightTensor) -> bool:
    """Whether this batch runs on the MMA-fragment decode kernel (repacked NVFP4 weights, Hopper)."""
    return (w13.packed is not None and w2.packed is not None and num_pairs <= MMA_MAX_MEAN_PAIRS * num_experts
            and x.dtype == torch.bfloat16 and nvfp4_mma.available(x.device))


def _wgmma_prefill(x: torch.Tensor, num_pairs: int, num_experts: int, w13: WeightTensor, w2: WeightTensor) -> bool:
    """Whether this batch runs on the wide-token wgmma kernel (repacked NVFP4 weights, Hopper, prefill sizes)."""
    return (w13.packed is not None and w2.packed is not None and num_pairs >= WGMMA_MIN_MEAN_PAIRS * num_experts
            and x.dtype == torch.bfloat16 and nvfp4_wgmma.available(x.device)
            and nvfp4_wgmma.supports(w13.packed) and nvfp4_wgmma.supports(w2.packed))


# The wgmma path's down GEMM writes its per-pair outputs [pairs, H] in bf16 for the top-k combine (f32 sums of the
# bf16 values in a fixed order; vLLM's fused MoE also keeps them in the activation dtype): at 8192 tokens the f32
# partials are 537 MB written and read. H200, one 35B-A3B layer (prefill_wgmma/round2): bf16 vs f32 302 vs 307 us at
# 512 tokens, 499 vs 509 at 2048, 841 vs 860 at 4096, 1530 vs 1558 at 8192
WGMMA_BF16_PARTIALS = True


def wgmma_tile() -> dict:
    """moe_experts' wgmma tile options: nvfp4_wgmma's defaults ({}), or LINRNN_WGMMA_TILE="block_n,warps,units,
    stages,sub_log" (an experiment knob: tools/gpu_moe_prefill.sh runs the engine on a measured candidate)."""
    spec = os.environ.get("LINRNN_WGMMA_TILE", "")
    if not spec:
        return {}
    try:
        block_n, warps, units, stages, sub_log = (int(v) for v in spec.split(","))
    except ValueError:
        raise ValueError(f"LINRNN_WGMMA_TILE={spec!r}: expected five integers block_n,warps,units,stages,sub_log") from None
    return dict(block_n=block_n, warps=warps, units=units, stages=stages, sub_log=sub_log)


def wgmma_block_n(num_pairs: int, num_experts: int) -> int:
    """Tokens per expert block of the wgmma kernel: 64 at every measured size (see nvfp4_wgmma.DEFAULT_BLOCK_N)."""
    return nvfp4_wgmma.DEFAULT_BLOCK_N


def moe_experts_wgmma(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, p13, p2,
                      out: torch.Tensor | None = None, block_n: int | None = None,
                      stages: int = nvfp4_wgmma.DEFAULT_STAGES, warps: int = nvfp4_wgmma.DEFAULT_WARPS,
                      units: int = nvfp4_wgmma.DEFAULT_UNITS, proxy_fence: bool = True,
                      mode: str = nvfp4_wgmma.DEFAULT_MODE, bf16_partials: bool = WGMMA_BF16_PARTIALS,
                      sub_log: int = nvfp4_wgmma.DEFAULT_SUB_LOG, alignment: Alignment | None = None,
                      combine: bool = True):
    """The prefill path on Hopper: NVFP4 experts repacked as MMA fragments (the decode path's layout),
    expert blocks of 64-256 tokens on async wgmma (nvfp4_wgmma.py). x [T, H] bf16 in natural k order;
    it is k-permuted once here, and the gate_up kernel writes h in that order for the down kernel.
    mode: the K loop's schedule (nvfp4_wgmma.MODES). sub_log: adaptive width (expert blocks of block_n << sub_log
    slots, each one tile of wgmma N = block_n x its valid sub-blocks; nvfp4_wgmma.launch). bf16_partials: the down GEMM's
    [pairs, H] per-pair outputs in bf16 (half the bytes written and read by the top-k combine, which still adds
    them in f32 in a fixed order); f32 where the caller takes the uncombined Partials."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E = p13.codes.shape[0]
    inter = p13.n // 2
    if out is None:
        out = gg.alloc(T, H, dtype=x.dtype, device=x.device)
    P = T * top_k
    block_n = block_n or wgmma_block_n(P, E)
    sorted_ids, expert_ids = aligned(topk_ids, E, block_n << sub_log, alignment)
    common = dict(num_rows=P, num_m_blocks=expert_ids.numel(), sorted_ids=sorted_ids, expert_ids=expert_ids,
                  block_n=block_n, stages=stages, warps=warps, units=units, proxy_fence=proxy_fence,
                  mode=mode, sub_log=sub_log)
    h = gg.alloc(P, inter, dtype=x.dtype, device=x.device)
    nvfp4_wgmma.launch(nvfp4_wgmma.permute_k(x), p13, h, a_row_div=top_k, **common)
    part_dtype = torch.bfloat16 if bf16_partials and combine else torch.float32
    part = gg.alloc(1, P, H, dtype=part_dtype, device=x.device)
    nvfp4_wgmma.launch(h, p2, part[0], route_weights=topk_weights.reshape(-1).contiguous(), **common)
    if not combine:
        return Partials(part, top_k)
    gg.sum_reduce(part, out, group=top_k)
    return out


def takes_pair_blocks(x: torch.Tensor, top_k: int, w13: WeightTensor, w2: WeightTensor) -> bool:
    """Whether moe_experts runs this batch on the MMA kernel in a single 8-token block per expert, so a router
    may hand it pair blocks (align.moe_pair_blocks: a cheaper alignment, the same per-token results)."""
    T, E = x.shape[0], w13.data.shape[0]
    return _mma_decode(x, T * top_k, E, w13, w2) and T <= mma_tokens(T * top_k, E)


def alignment_block_m(x: torch.Tensor, top_k: int, w13: WeightTensor, w2: WeightTensor) -> int:
    """The block_m moe_experts (default configs) aligns this batch's pairs to: a router that aligns
    ahead of time (router_fused) uses it, so the experts reuse its alignment instead of redoing it."""
    T, E = x.shape[0], w13.data.shape[0]
    if _wgmma_prefill(x, T * top_k, E, w13, w2) and T <= MAX_CHUNK_TOKENS:
        return wgmma_block_n(T * top_k, E)
    if _mma_decode(x, T * top_k, E, w13, w2):
        return mma_tokens(T * top_k, E)
    return expert_block_m(T, top_k, E)


# The MMA kernel's CTA order: up to this mean number of pairs per expert (and without split-K) the row
# tiles of one expert block run next to each other, above it one row tile of every block after the other.
# H200 layer sweep at d2c705d: 1.1 / 1.9 / 1.9 / 1.6 us faster at B = 8 / 32 / 64 / 128 (0.25-4 pairs per
# expert), 4.6 us slower at B = 256 (8), 1.4 us slower at B = 1 (split-K 4)
N_FASTEST_MAX_MEAN_PAIRS = 4


# From this mean number of (token, expert) pairs per expert the MMA kernel takes 16-token expert blocks (an expert
# with 9-16 tokens decodes its weights once, not twice; 62 registers, 2.78 SASS instructions per weight against
# 48 / 2.41 at 8 tokens). H200, one 35B-A3B layer (benchmarks/results/kernels/moe/round3/): 16 vs 8 tokens
# 189.9 vs 197.3 us at B = 256 (8 pairs per expert), 178.0 vs 165.3 at B = 128 (4), slower below
MMA_16_MIN_MEAN_PAIRS = 8


# Adaptive 16-token tile (off by default): 16-token expert blocks whose slots 8..15 are all padding (an expert with
# <= 8 tokens) run the 8-token K loop on their first 8 slots (nvfp4_mma ADAPT, in the same launch; the same bits). At
# B = 256 (8 pairs per expert on average, realistic routing) about half the experts have <= 8 tokens, yet the layer
# did not move: H200, one 35B-A3B layer, one run (benchmarks/results/kernels/moe/round6/): 190.8 us adaptive vs 190.0
# fixed; its 8-token loop at 2 units per step 192.3, with a register budget of 80 200.9 (6 CTAs per SM). Triton 3.6
# compiles the two-loop kernel's loops to 3.00 / 2.53 SASS instructions per weight (16 / 8 tokens; 2.78 / 2.41 alone).
# At this batch the kernel follows the weight bytes in flight per SM (resident warps x bytes per warp), not the
# instructions per block (round6/README.md).
MMA_ADAPTIVE_16 = False
# units per K step of the adaptive kernel's 8-token loop (None: the tile's units, mma_tile)
MMA_ADAPTIVE_UNITS8 = None


def mma_tokens(num_pairs: int, num_experts: int) -> int:
    """Tokens per expert block of the MMA kernel: 8, or 16 from MMA_16_MIN_MEAN_PAIRS pairs per expert."""
    return 16 if num_pairs >= MMA_16_MIN_MEAN_PAIRS * num_experts else 8


# The MMA kernel's tile by batch: (from this mean number of (token, expert) pairs per expert, 64-k units per K step,
# ptxas register budget (0: ptxas's own choice)); the last row that applies wins. Without a budget ptxas compiles the
# 1-unit loop to 44 registers by sinking the activation loads next to their MMAs and the next step's code loads behind
# the first MMAs (4 serial L1/L2 round trips per loop iteration, nvfp4_mma.py "Register budget"): hidden by occupancy at
# large batches, not at B = 1 (about 4 CTAs per SM). H200, one 35B-A3B layer against round 3's tile (1 unit, no budget)
# in one run (benchmarks/results/kernels/moe/round4/): 24.2 vs 26.7 us at B = 1 (MMA kernel 10.4 vs 13.1), 49.9 vs 52.8
# at 8, 156.6 vs 163.6 at 128 (2 units at B = 32 / 64: +5.0 / +4.3 us here, -7.0 / -3.7 in round 3's run: not settled);
# engine 2.315 / 4.166 / 13.689 vs 2.416 / 4.258 / 13.997 ms per step at npl 1 / 8 / 128. B = 2-7 not measured.
# Fourth column: 16-row tiles per warp (mrep; nvfp4_mma MREP): 2 doubles the weight bytes a warp has in flight and
# halves the activation loads per weight (72 registers at 8 tokens, 1 unit: 7 CTAs of 4 warps per SM; 88 at 16 tokens),
# GPU-tested bitwise equal to 1 but not yet timed (the benchmark's "2 row tiles per warp" candidates): 1 everywhere.
MMA_TILES = ((0, 1, 80, 1), (0.25, 2, 0, 1), (8, 1, 0, 1))


# The down GEMM's own tile (K = 512: 8 units, its CTAs 4x shorter than gate_up's, so it gains from more CTAs per SM):
# (from this mean number of pairs per expert, units per K step, register budget); below the first row it runs the
# tile of MMA_TILES. H200, one 35B-A3B layer, candidates in one run each (benchmarks/results/kernels/moe/round7/):
# 1 unit at a budget of 40 (12 CTAs of 4 warps per SM against 9) -2.2 to -2.6 us at B = 64, -4.0 to -4.4 at 128. The
# 16-token tile (B >= 256) keeps the common one: 9 CTAs per SM need a budget of 56, where ptxas spills the weight loads'
# 64-bit L2 policy register inside the K loop (measured -3.7 / -3.9 us all the same; budget 40: +64 us). The same MMAs
# in the same k order: bitwise the same results. LINRNN_MMA_DOWN_TILES=0: the common tile everywhere (the A/B switch)
MMA_DOWN_TILES = ((1, 1, 40),)
# With the down tile, the activations (h) of each CTA's split are staged in shared memory once (nvfp4_mma XSU: 8 KB at
# 8 tokens) and every K step reads them from there: Nsight charged 60 % of the down GEMM's long-scoreboard stalls at
# B = 128 to the activation loads, which each of a CTA's 4 warps issued to L2 at every K step. H200, one 35B-A3B layer,
# two passes in one run against round 7's tile (benchmarks/results/kernels/moe/round8/ call 15): -3.1 / -2.9 us at
# B = 32, -3.5 / -3.6 at 64, -3.4 / -3.4 at 128; engine (bench batched f32) 7.784 / 9.830 / 12.988 vs 7.915 / 10.019 /
# 13.141 ms per step at npl 32 / 64 / 128. The 16-token tile (B >= 256) was slower with it (+7 us): not used there. The
# same MMAs in the same k order: bitwise the same results. LINRNN_MMA_SMEM_X=0: off (the A/B switch)
MMA_DOWN_SMEM_X = True
# (Round 8 measured a B = 1 down tile, one 4-unit K step per split at 48 registers with every code and scale loaded
# before the PDL wait: the layer 0.3-0.4 us faster, the engine 31 us per step slower at npl 1 (2.206 vs 2.175 ms, two
# runs each); not kept, round8/README.md.)


def mma_down_tile(num_pairs: int, num_experts: int) -> dict:
    """moe_experts_mma's down_tile for num_pairs pairs (MMA_DOWN_TILES; {}: the common tile)."""
    if os.environ.get("LINRNN_MMA_DOWN_TILES", "1") == "0" or mma_tokens(num_pairs, num_experts) != 8:
        return {}
    tile = {}
    for lo, units, maxnreg in MMA_DOWN_TILES:
        if num_pairs >= lo * num_experts:
            tile = {"units": units, "maxnreg": maxnreg}
    if tile and MMA_DOWN_SMEM_X and os.environ.get("LINRNN_MMA_SMEM_X", "1") != "0":
        tile["smem_x"] = True
    return tile


def mma_tile(num_pairs: int, num_experts: int) -> tuple[int, int, int]:
    """(units per K step, register budget (0 = none), 16-row tiles per warp) of the MMA kernel for num_pairs pairs
    (MMA_TILES)."""
    tile = MMA_TILES[0][1:]
    for lo, *rest in MMA_TILES:
        if num_pairs >= lo * num_experts:
            tile = tuple(rest)
    return tile


def mma_splits(num_pairs: int, p13, p2, num_sms: int, warps: int = 4, groups: tuple[int, int] = (1, 1),
               per_sm: int = nvfp4_mma.DEFAULT_PER_SM, mrep: int = 1) -> tuple[int, int]:
    """The split-K of moe_experts_mma's (gate_up, down) GEMMs for num_pairs (token, expert) pairs (mrep: 16-row
    tiles per warp)."""
    active = min(p13.codes.shape[0], num_pairs)
    return tuple(nvfp4_mma.split_k(p.codes.shape[2], active * nvfp4_mma.programs_per_block(p, warps, mrep) // g,
                                   num_sms, per_sm)
                 for p, g in ((p13, groups[0]), (p2, groups[1])))


# Under PDL the gate_up kernel is launched with PDL too: it waits for the router (which lets it launch at its start)
# before anything else and only then lets the down kernel launch, so its launch overlaps the router. H200, one
# 35B-A3B layer, round 6 call 1 (the MMA candidates, with route() and the alignment under PDL off): 0.5-0.8 us faster
# at B = 1 .. 256 (22.2 vs 22.8 at B = 1, 157.7 vs 158.5 at 128). LINRNN_MMA_PDL_GATE_UP=0: launched plainly (round 5)
PDL_GATE_UP = True


def pdl_gate_up_default(pdl: bool) -> bool:
    return pdl and PDL_GATE_UP and os.environ.get("LINRNN_MMA_PDL_GATE_UP", "1") != "0"


def moe_experts_mma(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, p13, p2,
                    out: torch.Tensor | None = None, splits: tuple[int, int] | None = None,
                    tokens: int | None = None, warps: int = 4, units: int | None = None, maxnreg: int | None = None,
                    groups: tuple[int, int] = (1, 1), prefetch: bool = nvfp4_mma.DEFAULT_PREFETCH,
                    alignment: Alignment | None = None, combine: bool = True, fused_reduce: bool = True,
                    per_sm: int = nvfp4_mma.DEFAULT_PER_SM, weight_hint: str = nvfp4_mma.DEFAULT_WEIGHT_HINT,
                    n_fastest: bool | None = None, persistent: bool = False, pdl: bool | None = None,
                    adaptive: bool = MMA_ADAPTIVE_16, units8: int | None = MMA_ADAPTIVE_UNITS8, mrep: int | None = None,
                    pdl_gate_up: bool | None = None, down_tile: dict | None = None):
    """The decode path on Hopper: NVFP4 experts repacked as MMA fragments (nvfp4_layout.PackedNvfp4,
    w13 gated), 8-token expert blocks, split-K so small batches fill the SMs (nvfp4_mma.py; about
    `per_sm` programs per SM); gate_up's split-K partials reduced by its own last split (fused_reduce)
    or by a separate launch. persistent: both GEMMs in one persistent launch (nvfp4_mma.launch_persistent).
    n_fastest: run the row tiles of one expert block next to each other (default:
    for a GEMM without split-K up to N_FASTEST_MAX_MEAN_PAIRS pairs per expert). units (64-k units per K step) and
    maxnreg (ptxas's register budget, 0: its own choice): each from mma_tile where not given.
    pdl: programmatic dependent launch through gate_up -> down -> combine (nvfp4_mma.pdl_default where not given):
    gate_up lets the down kernel launch at once, whose CTAs load their expert ids and first weights while gate_up
    drains and wait for it before reading h; the down kernel lets the combine (or the engine's shared-expert down
    projection) launch the same way. Bitwise the same results. adaptive: 16-token blocks with <= 8 tokens run the
    8-token tile (MMA_ADAPTIVE_16; bitwise the same results) at units8 units per K step (MMA_ADAPTIVE_UNITS8).
    mrep: 16-row tiles per warp (each activation load feeds mrep row tiles; mma_tile where not given; bitwise the
    same results).
    pdl_gate_up (with pdl; default pdl_gate_up_default): gate_up is launched with PDL as well, waiting for the router
    first. down_tile: the down GEMM's own units / maxnreg / mrep / smem_x (mma_down_tile where not given; {}: the common
    tile).
    (The combine in the down kernel's epilogue, per-token tickets, bit-identical, was measured no faster:
    benchmarks/results/kernels/moe/round6_small/.)
    Routing inputs: topk_ids [T, k] in any order (align.py sorts pairs by expert); x [T, H] bf16
    in natural k order."""
    T, H = x.shape
    top_k = topk_ids.shape[1]
    E = p13.codes.shape[0]
    inter = p13.n // 2
    if out is None:
        out = gg.alloc(T, H, dtype=x.dtype, device=x.device)
    P = T * top_k
    tokens = tokens or (8 if persistent else mma_tokens(P, E))  # the persistent kernel: 8 (compile-tested)
    tile = mma_tile(P, E)
    units = units or (nvfp4_mma.DEFAULT_UNITS if persistent else tile[0])  # persistent: the compile-tested tile
    maxnreg = tile[1] if maxnreg is None else maxnreg
    mrep = (1 if persistent else tile[2]) if mrep is None else mrep
    pdl = nvfp4_mma.pdl_default(x.device) if pdl is None else pdl
    pdl_gate_up = pdl and (pdl_gate_up_default(pdl) if pdl_gate_up is None else pdl_gate_up)
    sorted_ids, expert_ids = aligned(topk_ids, E, tokens, alignment, pair_blocks_ok=not persistent)
    blocks = expert_ids.numel()
    if splits is None:
        splits = mma_splits(P, p13, p2, nvfp4_mma.num_sms(x.device), warps, groups, per_sm, mrep)
    s13, s2 = splits
    common = dict(num_rows=P, num_m_blocks=blocks, sorted_ids=sorted_ids, expert_ids=expert_ids,
                  tokens=tokens, warps=warps, units=units, prefetch=prefetch, weight_hint=weight_hint)
    cap = {"maxnreg": maxnreg or None, "adaptive": adaptive, "units8": units8, "mrep": mrep}
    order = [n_fastest if n_fastest is not None else (s == 1 and P <= N_FASTEST_MAX_MEAN_PAIRS * E) for s in splits]
    h = gg.alloc(P, inter, dtype=x.dtype, device=x.device)
    if persistent:  # both GEMMs in one launch
        ws = gg.alloc(s13, P, 2 * inter, dtype=torch.float32, device=x.device) if s13 > 1 else None
        part = gg.alloc(s2, P, H, dtype=torch.float32, device=x.device)
        common.pop("num_rows"), common.pop("num_m_blocks")  # and its own register cap (PERSISTENT_MAXNREG)
        nvfp4_mma.launch_persistent(x, p13, p2, h, ws, part, num_rows=P, num_m_blocks=blocks,
                                    route_weights=topk_weights.reshape(-1).contiguous(), a_row_div=top_k,
                                    splits=splits, **common)
        if not combine:
            return Partials(part, top_k)
        gg.sum_reduce(part, out, group=top_k)
        return out
    # the buffers first: an allocation (or a copy) between two launches would sit between PDL's two kernels
    route_w = topk_weights.reshape(-1).contiguous()
    part = gg.alloc(s2, P, H, dtype=torch.float32, device=x.device)
    ws = gg.alloc(s13, P, 2 * inter, dtype=torch.float32, device=x.device) if s13 > 1 else None
    # gate_up is launched without PDL (it reads the router's output), or with PDL waiting before anything else and
    # only then letting the down kernel launch: either way the down kernel may read the alignment before its grid
    # dependency wait (nvfp4_mma.launch)
    first = dict(pdl_trigger=pdl, pdl_wait_first=pdl_gate_up)
    if s13 == 1:
        nvfp4_mma.launch(x, p13, h, a_row_div=top_k, split=1, groups=groups[0], n_fastest=order[0],
                         **first, **common, **cap)
    else:
        nvfp4_mma.launch(x, p13, ws, a_row_div=top_k, split=s13, groups=groups[0], h=h if fused_reduce else None,
                         n_fastest=order[0], **first, **common, **cap)
        if not fused_reduce:
            gg.silu_mul_reduce(ws, h)
    down_common, down_cap = dict(common), dict(cap)
    for key, val in (mma_down_tile(P, E) if down_tile is None else down_tile).items():
        (down_common if key == "units" else down_cap)[key] = (val or None) if key == "maxnreg" else val
    nvfp4_mma.launch(h, p2, part, route_weights=route_w, split=s2, groups=groups[1], n_fastest=order[1],
                     pdl_wait=pdl, pdl_trigger=pdl, **down_common, **down_cap)
    if not combine:
        return Partials(part, top_k)
    gg.sum_reduce(part, out, group=top_k, pdl=pdl)
    return out
