"""NVFP4 MoE layer benchmark (BENCH.md "Kernel benchmarks" / "NVFP4 MoE").

One sparse-MoE layer of Qwen3.5-35B-A3B shapes (E=256, top-8, H=2048, I=512) at B tokens, from
router logits to the combined expert output, routing realistic (softmax of x @ W_router^T with
random x and a router at HF init scale 0.02, so some experts are hot). Side by side, in one run:
  nvfp4/mma       our default NVFP4 path on Hopper: decode batches on the MMA-fragment kernel
                  (nvfp4_mma.py, experts repacked once per weight set as the loader does), large
                  batches dequantized once to bf16 for the bf16 grouped GEMM (dequant.py); up to 64
                  pairs routed in one launch as the engine's layer is (softmax, top-k, bf16 weights
                  and the experts' alignment: router_fused.route_align_logits; up to 8 tokens on the MMA
                  kernel as pair blocks, align.moe_pair_blocks)
  nvfp4/mma-r5    nvfp4/mma with round 5's launch chain (the router and gate_up launched without PDL): the before
                  of round 6 in the same run
  nvfp4/mma-route the same experts behind the separate route kernel, weight cast and alignment
  nvfp4/mma-parts nvfp4/mma without the top-k combine launch: the engine's decode layer hands the
                  uncombined partials to the shared expert's down projection, which sums them
                  (LINRNN_FUSED_MOE_COMBINE, on by default); checked after summing them outside the timing
  nvfp4/asm       our kernels, NVFP4 experts, inline-PTX decode (the older Hopper kernel)
  nvfp4/wgmma     the prefill kernel (nvfp4_wgmma.py: wide token blocks on wgmma) at any batch; -nN-wW fix its
                  tokens per expert block (64 / 128 / 256), warps per CTA (4 / 8 / 16) 64-k units per K step (1 / 2), -sS the cp.async ring depth (default 4);
                  -nN-wW-uU-sS-{rs,ss}-{f32,b16}: also the K loop schedule (nvfp4_wgmma.MODES) and the down partials' dtype;
                  -n64-wW-uU-sS-xX: adaptive width (expert blocks of 64 << X slots, wgmma N = 64 x valid sub-blocks)
  nvfp4/mma-any / nvfp4/dequant-bf16: the MMA kernel / dequantize-to-bf16 path at any batch
  nvfp4/w4a4      our kernels, W4A4 on FP4 tensor cores (sm_100+ only, added there automatically;
                  checked against the W4A4 reference, with a 2e-2 bound)
  nvfp4/triton    our kernels, NVFP4 experts, plain-Triton decode
  fp8             our kernels, FP8 experts
  bf16/ours       our kernels, bf16 experts
  bf16/grouped_mm peer: torch routing, gather, torch._grouped_mm gate_up, SiLU*mul, grouped down,
                  index_add (BENCH.md's measured peer)
  nvfp4/dequant   baseline: dequantize all experts to bf16, then the grouped_mm peer
Each variant is first checked against the naive reference (relative Frobenius error <= 1e-2, no
NaN) and is not timed if it fails. Times are medians over do_bench's protocol with L2 flushed before every
repetition by reading 256 MB (--flush read, the default; --flush zero: do_bench's own zeroing flush, whose dirty
lines the timed kernels write back: 2-11 us more per layer call, results/final_run_9/moe_flush/) of CUDA-graph
replays (what a decode step sees; eager if capture fails),
rotating through --sets independent weight/input sets. GB/s counts the bytes that must move:
experts touched (from the actual routing) x bytes per expert incl. scales, + logits, x and output;
% copy is relative to a device-to-device copy measured in the same run (read + write counted).

  python -m linrnn_bench.kernels.moe --out benchmarks/results            # table + JSON
  python -m linrnn_bench.kernels.moe --sweep --out benchmarks/results    # + per-GEMM config sweep
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

import torch.nn.functional as F

from linrnn_kernels.moe import experts, naive, router
from linrnn_kernels.moe import grouped_gemm as gg
from linrnn_kernels.moe.align import moe_align_block_size
from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info
from linrnn_kernels.quant import WeightTensor, nvfp4

QWEN35 = dict(E=256, k=8, H=2048, I=512)
TINY = dict(E=8, k=2, H=64, I=32)
TOL = 1e-2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--sets", type=int, default=3, help="independent weight/input sets rotated through")
    p.add_argument("--variants", default="nvfp4/mma,nvfp4/asm,bf16/ours,bf16/grouped_mm,fp8,nvfp4/triton,"
                                          "nvfp4/dequant")
    p.add_argument("--out", default=None, help="directory for moe_<gpu>.md / .json")
    p.add_argument("--sweep", action="store_true", help="also sweep gate_up / down configs (nvfp4/asm)")
    p.add_argument("--no-graph", action="store_true", help="time eager calls instead of graph replays")
    p.add_argument("--warmup", type=int, default=25, help="do_bench warm-up (ms)")
    p.add_argument("--rep", type=int, default=200, help="do_bench repetition time (ms)")
    p.add_argument("--flush", choices=FLUSHES, default="read",
                   help="L2 flush before each timed call: read a 256 MB buffer (default: clean lines, as in a decode "
                        "step) or zero it (do_bench's: dirty lines written back during the timed call)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes (smoke test; runs on CPU too)")
    p.add_argument("--mma-sweep", action="store_true",
                   help="also time the nvfp4/mma layer over MMA_CANDIDATES (tile, split-K, reduction, cache-hint variants)")
    p.add_argument("--mma-candidates", default="",
                   help="comma-separated MMA_CANDIDATES keys for --mma-sweep (default: all)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one graph replay per variant: device time per kernel")


# ------------------------------------------------------------------------------------ weights

def quantize(W: torch.Tensor, fmt: str, parts: int = 1) -> WeightTensor:
    """W [E, N, K] f32 -> WeightTensor; gate and up halves get their own global scale."""
    if fmt == "bf16":
        return WeightTensor("dense", W.to(torch.bfloat16).contiguous())
    if fmt == "fp8":
        rs = W.abs().amax(-1).clamp_min(1e-12) / 448.0
        return WeightTensor("fp8", (W / rs[..., None]).to(torch.float8_e4m3fn), None, rs.float().contiguous())
    pk, sb, rs = [], [], []
    for Wp in W.chunk(parts, dim=-2):
        p_, s_, g_ = nvfp4.quantize(Wp)
        pk.append(p_)
        sb.append(s_)
        rs.append(g_[..., None].expand(*Wp.shape[:-1]))
    return WeightTensor("nvfp4", torch.cat(pk, -2).contiguous(), torch.cat(sb, -2).contiguous(),
                        torch.cat(rs, -1).float().contiguous())


def make_set(shape: dict, fmts: set[str], device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    E, H, I = shape["E"], shape["H"], shape["I"]
    out = {"router": torch.randn(E, H, device=device, generator=g) * 0.02}
    for name, (N, K, parts) in {"w13": (2 * I, H, 2), "w2": (H, I, 1)}.items():
        W = torch.randn(E, N, K, device=device, generator=g) * 0.02
        for fmt in fmts:
            out[(fmt, name)] = quantize(W, fmt, parts)
        del W
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def expert_bytes(w13: WeightTensor, w2: WeightTensor) -> int:
    """Bytes of one expert in storage (data + block scales + row scales)."""
    total = 0
    for w in (w13, w2):
        for t in (w.data, w.block_scale, w.row_scale):
            if t is not None:
                total += t[0].numel() * t.element_size()
    return total


# ------------------------------------------------------------------------------------- layers

def peer_grouped_mm(logits, x, top_k, w13: torch.Tensor, w2: torch.Tensor):
    """BENCH.md's bf16 peer: torch routing, gather, grouped gate_up, SiLU*mul, grouped down,
    weighted index_add. w13 [E, 2I, H], w2 [E, H, I] bf16."""
    E = w13.shape[0]
    inter = w13.shape[1] // 2
    p = torch.softmax(logits.float(), dim=-1)
    topw, ids = torch.topk(p, top_k, dim=-1)
    topw = (topw / topw.sum(-1, keepdim=True)).to(x.dtype)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    # counts without bincount (which syncs to size its output), so the peer is graph-capturable
    counts = torch.zeros(E, dtype=torch.int32, device=x.device).index_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // top_k
    h = torch._grouped_mm(x[tok], w13.transpose(1, 2), offs=offs)
    h = F.silu(h[:, :inter]) * h[:, inter:]
    y = torch._grouped_mm(h, w2.transpose(1, 2), offs=offs)
    y = y * topw.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, tok, y)


def ours(logits, x, top_k, w13, w2, path=None):
    topw, ids = router.route(logits, top_k, True, weight_dtype=x.dtype)
    return experts.moe_experts(x, topw, ids, w13, w2, nvfp4_path=path)


# round 5's MMA launch chain (experts.PDL_GATE_UP off; the routers without PDL: router.ROUTE_PDL)
R5_CHAIN_ENV = {"LINRNN_MMA_PDL_GATE_UP": "0", "LINRNN_ROUTE_PDL": "0"}


def ours_engine_routing_r5(logits, x, top_k, w13, w2):
    """ours_engine_routing with round 5's launch chain (the before of round 6, in the same run)."""
    return with_env(R5_CHAIN_ENV, lambda: ours_engine_routing(logits, x, top_k, w13, w2, router_pdl=False))


def ours_engine_routing(logits, x, top_k, w13, w2, combine: bool = True, router_pdl: bool | None = None):
    """Routing in one launch as the engine's decode layer does (there the fused router also runs the
    gate GEMM): softmax + top-k + alignment with bf16 weights in one launch whose alignment the experts reuse
    (up to router_fused.LOGITS_MAX_PAIRS pairs, or up to 8 tokens as pair blocks where the MMA kernel takes
    them); then our default expert path. router_pdl: route_align_logits' PDL (None: its default)."""
    from linrnn_kernels.moe import router_fused

    E = w13.data.shape[0]
    pair_blocks = experts.takes_pair_blocks(x, top_k, w13, w2)
    if x.shape[0] * top_k > router_fused.LOGITS_MAX_PAIRS and not pair_blocks:
        topw, ids = router.route(logits, top_k, True, weight_dtype=x.dtype)
        return experts.moe_experts(x, topw, ids, w13, w2, combine=combine)
    block_m = experts.alignment_block_m(x, top_k, w13, w2)
    topw, ids, (sid, eid, npad) = router_fused.route_align_logits(logits, E, top_k, True, block_m, x.dtype,
                                                                  pair_blocks=pair_blocks, pdl=router_pdl)
    return experts.moe_experts(x, topw, ids, w13, w2, combine=combine,
                               alignment=experts.Alignment(sid, eid, npad, block_m, pair_blocks))


def combined(y):
    """The layer output of a variant: experts.Partials summed over splits and top-k (outside the timing)."""
    if isinstance(y, experts.Partials):
        T = y.part.shape[1] // y.group
        return y.part.sum(0).view(T, y.group, -1).sum(1).bfloat16()
    return y


_PACKED: dict = {}


def with_packed(w13: WeightTensor, w2: WeightTensor):
    """The weights plus their MMA-fragment repack (done once per set, as the loader does)."""
    from linrnn_kernels.moe import nvfp4_layout

    out = []
    for w, gated in ((w13, True), (w2, False)):
        key = w.data.data_ptr()
        if key not in _PACKED:
            _PACKED[key] = nvfp4_layout.pack(w.data, w.block_scale, w.row_scale, gated)
        out.append(w._replace(packed=_PACKED[key]))
    return out


def dequant_then_peer(logits, x, top_k, w13: WeightTensor, w2: WeightTensor):
    return peer_grouped_mm(logits, x, top_k, w13.dequantize(torch.bfloat16), w2.dequantize(torch.bfloat16))


def ours_mma_any(logits, x, top_k, w13: WeightTensor, w2: WeightTensor):
    """The MMA-fragment kernel at any batch ("nvfp4/mma" follows the engine's choice by batch, which leaves
    it above experts.MMA_MAX_MEAN_PAIRS pairs per expert): the sweep that places that threshold."""
    topw, ids = router.route(logits, top_k, True, weight_dtype=x.dtype)
    a, b = with_packed(w13, w2)
    return experts.moe_experts_mma(x, topw, ids, a.packed, b.packed)


def ours_wgmma(block_n=None, warps=None, units=None, stages=None, proxy_fence=True, mode=None, bf16p=None,
               sub_log=None):
    """The wide-token wgmma prefill kernel (nvfp4_wgmma.py) at any batch, `block_n` tokens per expert block
    (None: experts.wgmma_block_n's choice): the sweep that places experts.WGMMA_MIN_MEAN_PAIRS. mode: the K loop
    schedule (nvfp4_wgmma.MODES), bf16p: bf16 down partials on / off (None: the defaults)."""
    def fn(logits, x, top_k, w13: WeightTensor, w2: WeightTensor):
        topw, ids = router.route(logits, top_k, True)
        a, b = with_packed(w13, w2)
        opts = {k: v for k, v in (("warps", warps), ("units", units), ("stages", stages), ("mode", mode),
                                  ("bf16_partials", bf16p), ("sub_log", sub_log)) if v is not None}
        return experts.moe_experts_wgmma(x, topw.to(x.dtype), ids, a.packed, b.packed, block_n=block_n,
                                         proxy_fence=proxy_fence, **opts)
    return fn


def ours_dequant(logits, x, top_k, w13: WeightTensor, w2: WeightTensor):
    """The engine's large-batch path at any batch: dequantize to bf16 (dequant.py), bf16 grouped GEMMs."""
    from linrnn_kernels.moe import dequant

    return ours(logits, x, top_k, dequant.dequantize(w13), dequant.dequantize(w2))


VARIANTS = {
    # name: (weight format, callable(logits, x, k, w13, w2))
    "nvfp4/mma": ("nvfp4", lambda l, x, k, a, b: ours_engine_routing(l, x, k, *with_packed(a, b))),
    "nvfp4/mma-r5": ("nvfp4", lambda l, x, k, a, b: ours_engine_routing_r5(l, x, k, *with_packed(a, b))),
    "nvfp4/mma-route": ("nvfp4", lambda l, x, k, a, b: ours(l, x, k, *with_packed(a, b), "mma")),
    "nvfp4/mma-parts": ("nvfp4", lambda l, x, k, a, b: ours_engine_routing(l, x, k, *with_packed(a, b), combine=False)),
    "nvfp4/mma-any": ("nvfp4", ours_mma_any),
    "nvfp4/dequant-bf16": ("nvfp4", ours_dequant),
    "nvfp4/wgmma": ("nvfp4", ours_wgmma()),
    **{f"nvfp4/wgmma-n{n}-w{w}-u{u}" + (f"-s{st}" if st != 4 else ""): ("nvfp4", ours_wgmma(n, w, u, st))
       for n in (64, 128, 256) for w in (4, 8, 16) for u in (1, 2) for st in (3, 4, 6) if 4 * w <= n},
    # experiment: without the proxy fence before the wgmma (is its MEMBAR draining the cp.async ring?)
    **{f"nvfp4/wgmma-n64-w8-u{u}-nf": ("nvfp4", ours_wgmma(64, 8, u, 4, False)) for u in (1, 2)},
    # round 2: the K loop schedule (nvfp4_wgmma.MODES) and the down partials' dtype (-f32 / -b16)
    **{f"nvfp4/wgmma-n{n}-w{w}-u{u}-s{st}-{m}-{d}": ("nvfp4", ours_wgmma(n, w, u, st, True, m, d == "b16"))
       for n in (64, 128) for w in (4, 8) for u in (1, 2) for st in (3, 4) for m in ("rs", "ss")
       for d in ("f32", "b16") if 4 * w <= n},
    # round 3: adaptive width, expert blocks of 64 << x slots run at wgmma N = 64 x their valid sub-blocks (-xX)
    **{f"nvfp4/wgmma-n64-w{w}-u{u}-s{st}-x{x}": ("nvfp4", ours_wgmma(64, w, u, st, sub_log=x))
       for w in (4, 8) for u in (1, 2) for st in (3, 4) for x in (1, 2)},
    "nvfp4/asm": ("nvfp4", lambda l, x, k, a, b: ours(l, x, k, a, b, "asm")),
    "nvfp4/w4a4": ("nvfp4", lambda l, x, k, a, b: ours(l, x, k, a, b, "dot_scaled")),
    "nvfp4/triton": ("nvfp4", lambda l, x, k, a, b: ours(l, x, k, a, b, "triton")),
    "fp8": ("fp8", ours),
    "bf16/ours": ("bf16", ours),
    "bf16/grouped_mm": ("bf16", lambda l, x, k, a, b: peer_grouped_mm(l, x, k, a.data, b.data)),
    "nvfp4/dequant": ("nvfp4", dequant_then_peer),
}


# nvfp4.dequantize builds its lookup table with a host-to-device copy: not capturable
EAGER_ONLY = {"nvfp4/dequant"}

# ------------------------------------------------------------------------------------- timing

# L2 flush between timed calls: "zero" (triton.testing.do_bench: a 256 MB buffer zeroed, which leaves L2 full of
# dirty lines that the timed kernels then write back to HBM while they stream their weights) or "read" (the buffer
# summed: L2 left holding clean lines, as in a decode step whose previous kernels wrote little)
FLUSHES = ("zero", "read")


def bench(fns: list, warmup: int, rep: int, cuda: bool, flush: str = "read") -> float:
    """Median microseconds of one call, rotating through `fns` (one per weight/input set); L2 flushed before each
    timed call (`flush`, FLUSHES)."""
    state = {"i": 0}

    def call():
        fns[state["i"] % len(fns)]()
        state["i"] += 1

    if cuda and flush == "read":
        return _bench_read_flush(call, warmup, rep)
    if cuda:
        import triton.testing

        return 1e3 * triton.testing.do_bench(call, warmup=warmup, rep=rep, return_mode="median")
    times = []
    for _ in range(max(3, len(fns))):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def _bench_read_flush(call, warmup_ms: float, rep_ms: float) -> float:
    """do_bench's protocol (warm-up, then timed calls each behind an L2 flush, the median) with a flush that reads a
    256 MB buffer instead of zeroing it, timed per call with CUDA events."""
    cache = torch.ones(64 << 20, dtype=torch.float32, device="cuda")
    sink = torch.empty((), dtype=torch.float32, device="cuda")
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    call()
    torch.cuda.synchronize()
    start.record()
    for _ in range(5):
        torch.sum(cache, dim=0, out=sink)
        call()
    end.record()
    torch.cuda.synchronize()
    per = max(start.elapsed_time(end) / 5, 1e-3)  # ms per flush + call
    for _ in range(max(1, int(warmup_ms / per))):
        call()
    n = max(5, int(rep_ms / per))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for s, e in events:
        torch.sum(cache, dim=0, out=sink)
        s.record()
        call()
        e.record()
    torch.cuda.synchronize()
    times = sorted(s.elapsed_time(e) for s, e in events)
    return 1e3 * times[len(times) // 2]


def graphed(fn, cuda: bool):
    """A CUDA-graph replay of fn (what a decode step sees), or fn itself if capture fails."""
    if not cuda:
        return fn, "eager"
    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        torch.cuda.synchronize()
        return g.replay, "graph"
    except Exception as e:  # report, fall back to eager
        torch.cuda.synchronize()
        return fn, f"eager ({type(e).__name__})"


# ---------------------------------------------------------------------------------- reporting

def markdown(rows: list[dict], variants: list[str], copy_gbs: float, info: dict, ipw: dict | None = None) -> str:
    lines = [f"# MoE layer benchmark: E={rows[0]['E']}, top-{rows[0]['k']}, H={rows[0]['H']}, I={rows[0]['I']}",
             "", f"{info.get('gpu', 'cpu')} · torch {info['torch']} · triton {info.get('triton')} · "
             f"commit {info.get('commit', '?')[:12]} · {info['date']}", "",
             f"Copy bandwidth (same run): {copy_gbs:.0f} GB/s. Times: median us per layer call "
             f"(router logits -> output), {rows[0]['timing']}; GB/s and % copy from the bytes that must move."]
    if ipw:
        lines += ["", "nvfp4/mma K loop, SASS instructions per weight (sm_90 compile, per GEMM and split): "
                  + "; ".join(f"{k}: {v:.2f}" for k, v in ipw.items())]
    pct_of = [v for v in ("nvfp4/mma", "nvfp4/mma-parts", "nvfp4/asm", "bf16/ours") if v in variants]
    gemm_pct = any(isinstance(r.get("profile", {}).get("nvfp4/mma"), dict) for r in rows)
    ipw_col = any("mma_ipw" in r for r in rows)
    lines += ["", "| B | experts hit | " + " | ".join(f"{v} us" for v in variants)
              + "".join(f" | {v} % copy" for v in pct_of)
              + " | mma x vs asm | mma x vs bf16/ours |" + (" nvfp4/mma routed GEMMs us (profile) | % copy |" if gemm_pct else "")
              + (" mma instr/weight gate_up / down |" if ipw_col else ""),
              "|---:|---:|" + "---:|" * (len(variants) + len(pct_of)) + "---:|---:|" + ("---:|---:|" if gemm_pct else "")
              + ("---:|" if ipw_col else "")]
    for r in rows:
        cells = []
        for v in variants:
            t = r["us"].get(v)
            cells.append(f"{t:.1f}" if isinstance(t, float) else str(t))
        for v in pct_of:
            gbs = r["gbs"].get(v)
            cells.append(f"{100 * gbs / copy_gbs:.0f} %" if gbs else "-")
        main = r["us"].get("nvfp4/mma")
        for p in ("nvfp4/asm", "bf16/ours"):
            other = r["us"].get(p)
            cells.append(f"{other / main:.2f}x" if isinstance(main, float) and isinstance(other, float) else "-")
        if gemm_pct:  # the expert GEMM kernels alone: expert bytes over their device time
            prof = r.get("profile", {}).get("nvfp4/mma")
            t = sum(v for k, v in prof.items() if ("nvfp4_mma" in k or "moe_persistent" in k) and not k.endswith("]")) \
                if isinstance(prof, dict) else 0
            cells += [f"{t:.1f}", f"{100 * r['expert_bytes'] / t / 1e3 / copy_gbs:.0f} %"] if t else ["-", "-"]
        if ipw_col:
            cells.append(r.get("mma_ipw", "-"))
        lines.append(f"| {r['B']} | {r['experts_hit']} | " + " | ".join(cells) + " |")
    notes = sorted({n for r in rows for n in r.get("notes", [])})
    if notes:
        lines += ["", "Timed eagerly (no CUDA graph): " + "; ".join(notes)]
    return "\n".join(lines) + "\n"


# -------------------------------------------------------------------------------------- sweep

GATE_UP_CANDIDATES = [  # (block_n per half, block_k, split_k, num_warps, num_stages)
    (64, 128, 1, 4, 4), (64, 128, 1, 4, 3), (64, 128, 1, 4, 2), (64, 256, 1, 4, 3), (64, 64, 1, 4, 4),
    (32, 128, 1, 4, 4), (128, 128, 1, 8, 3), (64, 128, 1, 8, 4), (64, 128, 2, 4, 4), (32, 256, 1, 4, 3)]
DOWN_CANDIDATES = [
    (128, 128, 1, 4, 4), (128, 128, 1, 4, 3), (64, 128, 1, 4, 4), (256, 128, 1, 8, 3), (128, 256, 1, 4, 2),
    (128, 64, 1, 4, 4), (128, 128, 1, 8, 4), (128, 128, 2, 4, 4), (64, 256, 1, 4, 3), (256, 64, 1, 8, 4)]


def sweep(shape, sets, B, args, cuda, device) -> dict:
    """Time gate_up and down separately over candidate configs (nvfp4/asm; the plain-Triton decode
    off the GPU), checking each against a reference config's output; returns the best per BLOCK_M."""
    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    path = "asm" if cuda else "triton"
    cases = []
    for s in sets:
        x = torch.randn(B, H, device=device).bfloat16()
        topw, ids = router.route(x.float() @ s["router"].t(), k, True)
        cases.append((x, topw.bfloat16().reshape(-1).contiguous(), ids, s[("nvfp4", "w13")], s[("nvfp4", "w2")]))
    default13, default2 = experts.moe_configs(B, k, E, I, H, "nvfp4", "nvfp4", device)
    bms = sorted({default13.block_m} | ({32} if B * k / E >= 2 else set()))
    result = {"default": [default13.__dict__, default2.__dict__], "per_block_m": {}}
    P = B * k
    for bm in bms:
        aligned = [moe_align_block_size(c[2], E, bm) for c in cases]

        def run13(cfg, i):
            x, _, _, w13, _ = cases[i]
            sid, eid, _ = aligned[i]
            out = torch.empty(cfg.split_k, P, 2 * I, dtype=torch.float32, device=device) if cfg.split_k > 1 \
                else torch.empty(P, I, dtype=x.dtype, device=device)
            gg.launch_gemm(x, w13, out, cfg, num_rows=P, n=I, k=H, num_m_blocks=eid.numel(), sorted_ids=sid,
                           expert_ids=eid, a_row_div=k, gated=True, nvfp4_path=path)
            if cfg.split_k > 1:
                h = torch.empty(P, I, dtype=x.dtype, device=device)
                gg.silu_mul_reduce(out, h)
                return h
            return out

        h_ref = [run13(gg.GemmConfig(bm, 64, 128, 1, 4, 3), i) for i in range(len(cases))]

        def run2(cfg, i):
            _, rw, _, _, w2 = cases[i]
            sid, eid, _ = aligned[i]
            part = torch.empty(cfg.split_k, P, H, dtype=torch.float32, device=device)
            gg.launch_gemm(h_ref[i], w2, part, cfg, num_rows=P, n=H, k=I, num_m_blocks=eid.numel(),
                           sorted_ids=sid, expert_ids=eid, route_weights=rw, nvfp4_path=path)
            return part.sum(0)

        p_ref = [run2(gg.GemmConfig(bm, 128, 128, 1, 4, 3), i) for i in range(len(cases))]
        entry = {}
        for name, cands, run, refs in (("gate_up", GATE_UP_CANDIDATES, run13, h_ref),
                                       ("down", DOWN_CANDIDATES, run2, p_ref)):
            timings = []
            for bn, bk, split, warps, stages in cands:
                cfg = gg.GemmConfig(bm, bn, bk, split, warps, stages)
                try:
                    err = float((run(cfg, 0).float() - refs[0].float()).norm() / refs[0].float().norm())
                    if not err <= TOL:
                        timings.append((cfg.__dict__, f"wrong (rel err {err:.2e})"))
                        continue
                    us = bench([lambda i=i: run(cfg, i) for i in range(len(cases))], args.warmup, args.rep, cuda,
                               args.flush)
                    timings.append((cfg.__dict__, us))
                except Exception as e:  # e.g. out of shared memory
                    timings.append((cfg.__dict__, f"failed: {type(e).__name__}: {str(e)[:120]}"))
            ok = [t for t in timings if isinstance(t[1], float)]
            entry[name] = {"best": min(ok, key=lambda t: t[1]) if ok else None, "all": timings}
        result["per_block_m"][bm] = entry
    return result


# ------------------------------------------------------------------------ MMA sweep / profile

# moe_experts_mma options per candidate, over the default (8-token blocks, 16 from experts.MMA_16_MIN_MEAN_PAIRS
# pairs per expert, 4 warps, 1 unit per step with
# the next step prefetched, split-K to 2 programs per SM, gate_up's split-K reduced by its last split,
# evict-first weight loads, CTA order by batch: experts.N_FASTEST_MAX_MEAN_PAIRS)
MMA_CANDIDATES = {
    "default": {},
    "hint none": {"weight_hint": "none"},
    "split to 4/SM": {"per_sm": 4},
    "separate SiLU reduce": {"fused_reduce": False},
    "16-token blocks": {"tokens": 16},
    "8-token blocks": {"tokens": 8},
    "2 units per step": {"units": 2, "maxnreg": 0},
    # ptxas register budget (experts.MMA_TILES; 0: ptxas's own choice, round 3's tile at every batch)
    # (keys without commas: --mma-candidates is a comma-separated list)
    "round 3 tile (1 unit without budget)": {"units": 1, "maxnreg": 0},
    "1 unit budget 64": {"units": 1, "maxnreg": 64},
    "1 unit budget 80": {"units": 1, "maxnreg": 80},
    "2 units budget 64": {"units": 2, "maxnreg": 64},
    "2 units budget 80": {"units": 2, "maxnreg": 80},
    "budget 80 split to 1/SM": {"units": 1, "maxnreg": 80, "per_sm": 1},
    "budget 80 split to 4/SM": {"units": 1, "maxnreg": 80, "per_sm": 4},
    "row tiles of a block together": {"n_fastest": True},
    "one row tile of every block first": {"n_fastest": False},
    "persistent (both GEMMs in one launch)": {"persistent": True},
    # programmatic dependent launch through gate_up -> down -> combine (nvfp4_mma.DEFAULT_PDL)
    "PDL off": {"pdl": False},
    "PDL on": {"pdl": True},
    "PDL on 2 units budget 64": {"pdl": True, "units": 2, "maxnreg": 64},
    "2 units budget 72": {"units": 2, "maxnreg": 72},
    # round 6 (small batches): the chain around the GEMMs (experts.PDL_GATE_UP, router.ROUTE_PDL)
    "round 5 chain": {"pdl_gate_up": False, "env": {"LINRNN_ROUTE_PDL": "0"}},
    "gate_up plain": {"pdl_gate_up": False},
    "split to 1/SM": {"per_sm": 1},
    # B = 1: ~4 CTAs per SM, so a larger register budget keeps every K step's loads of a split in flight at once
    "2 units budget 128": {"units": 2, "maxnreg": 128},
    "4 units budget 128": {"units": 4, "maxnreg": 128},
    # "env": environment variables set while the candidate is captured (router.chain_pdl: route and align under PDL)
    "route and align PDL": {"env": {"LINRNN_ROUTE_PDL": "1"}},
    "route and align plain": {"env": {"LINRNN_ROUTE_PDL": "0"}},
    # 16-token blocks: fixed (every block on the 16-token tile, main before round 6 at B >= 256) or adaptive (blocks
    # with <= 8 tokens on the 8-token tile, experts.MMA_ADAPTIVE_16) at any batch
    "16-token fixed": {"tokens": 16, "adaptive": False},
    # round 7: longer down CTAs (K = 512 is 8 units: each CTA runs 2 or 4 row groups one after the other)
    "down 2 row groups": {"groups": (1, 2)},
    "down 4 row groups": {"groups": (1, 4)},
    # the down GEMM's own tile (K = 512: 8 units, CTAs 4x shorter than gate_up's)
    "down tile off": {"down_tile": {}},  # the common tile for both GEMMs (before round 7)
    # round 8: the down GEMM's activations staged in shared memory once per CTA (nvfp4_mma XSU; 8 / 16 KB per CTA):
    # Nsight charges 60 % of its long-scoreboard stalls at B = 128 to the activation loads, which every warp of a CTA
    # issued from L2 for every K step
    "down smem x": {"down_tile": {"units": 1, "maxnreg": 40, "smem_x": True}},
    "down smem x off": {"down_tile": {"units": 1, "maxnreg": 40}},  # round 7's down tile (B = 32-255)
    "down smem x b48": {"down_tile": {"units": 1, "maxnreg": 48, "smem_x": True}},
    "16-token down smem x": {"down_tile": {"smem_x": True}},  # B >= 256: the common tile (56 registers with it)
    # round 8, B = 1: gate_up split deeper so that every split's codes are in flight at once (1-2 K steps per CTA)
    "gate_up split 8 4 units budget 64": {"splits": (8, 2), "units": 4, "maxnreg": 64,
                                          "down_tile": {"units": 1, "maxnreg": 80}},
    "gate_up split 8 2 units budget 64": {"splits": (8, 2), "units": 2, "maxnreg": 64,
                                          "down_tile": {"units": 1, "maxnreg": 80}},
    "gate_up split 16 2 units budget 64": {"splits": (16, 2), "units": 2, "maxnreg": 64,
                                           "down_tile": {"units": 1, "maxnreg": 80}},
    "down 1 unit": {"down_tile": {"units": 1, "maxnreg": None}},
    "down 1 unit budget 40": {"down_tile": {"units": 1, "maxnreg": 40}},
    "down 1 unit budget 32": {"down_tile": {"units": 1, "maxnreg": 32}},
    "down 1 unit budget 48": {"down_tile": {"units": 1, "maxnreg": 48}},
    "down 1 unit budget 56": {"down_tile": {"units": 1, "maxnreg": 56}},
    "1 unit budget 40": {"units": 1, "maxnreg": 40},
    "1 unit budget 48": {"units": 1, "maxnreg": 48},
    "down 4 units": {"down_tile": {"units": 4, "maxnreg": None}},
    "down 4 units budget 80": {"down_tile": {"units": 4, "maxnreg": 80}},
    "down 2 row tiles per warp": {"down_tile": {"mrep": 2}},
    "16-token adaptive": {"tokens": 16, "units": 1, "maxnreg": 0, "adaptive": True},
    "16-token adaptive budget 80": {"tokens": 16, "units": 1, "maxnreg": 80, "adaptive": True},
    "16-token adaptive 8-token loop 2 units": {"tokens": 16, "units": 1, "maxnreg": 0, "adaptive": True, "units8": 2},
    # 16-row tiles per warp (mrep: each activation load feeds both tiles' MMAs) and 8-warp CTAs (activations shared
    # by 128 rows through L1)
    "2 row tiles per warp": {"mrep": 2},
    "2 row tiles per warp 1 unit": {"mrep": 2, "units": 1, "maxnreg": 0},
    "2 row tiles per warp 8-token blocks": {"mrep": 2, "tokens": 8, "units": 1, "maxnreg": 0},
    "2 row tiles per warp 16-token fixed": {"mrep": 2, "tokens": 16, "units": 1, "maxnreg": 0, "adaptive": False},
    "8 warps": {"warps": 8},
    # the B = 8-128 tile (8-token blocks, 2 units per step: 56 registers, 9 CTAs per SM) at any batch
    "8-token blocks 2 units": {"tokens": 8, "units": 2, "maxnreg": 0},
}


def with_env(env: dict, fn):
    """fn() with the environment variables `env` set (restored after)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return fn()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def mma_ipw(num_pairs: int, w13: WeightTensor, w2: WeightTensor, num_sms: int | None = None) -> str:
    """SASS instructions per weight of the K loops moe_experts_mma runs for num_pairs pairs (its tile and split-K
    per GEMM; sm_90 compile): "gate_up / down" (num_sms: the device's where not given)."""
    from linrnn_kernels.moe import nvfp4_mma

    p13, p2 = w13.packed, w2.packed
    E = p13.codes.shape[0]
    units, maxnreg, mrep = experts.mma_tile(num_pairs, E)
    splits = experts.mma_splits(num_pairs, p13, p2, num_sms or nvfp4_mma.num_sms(w13.data.device), mrep=mrep)
    down = experts.mma_down_tile(num_pairs, E)
    out = []
    for p, sp in zip((p13, p2), splits):
        tile = {"units": units, "maxnreg": maxnreg, "mrep": mrep, **({} if p.gated else down)}
        u = nvfp4_mma.units_per_step(p.codes.shape[2], sp, tile["units"])
        pf = nvfp4_mma.DEFAULT_PREFETCH and (p.codes.shape[2] // sp // u) % 2 == 0
        if tile.get("smem_x") and pf:  # staged activations: the K steps unrolled (staged_x_stats)
            st = nvfp4_mma.staged_x_stats(units=u, xsu=p.codes.shape[2] // sp, maxnreg=tile["maxnreg"] or None,
                                          tokens=experts.mma_tokens(num_pairs, E))
        else:
            st = nvfp4_mma.k_loop_stats(gated=p.gated, split=sp, units=u, prefetch=pf, fused_reduce=p.gated and sp > 1,
                                        tokens=experts.mma_tokens(num_pairs, E), maxnreg=tile["maxnreg"] or None,
                                        adaptive=experts.MMA_ADAPTIVE_16, units8=experts.MMA_ADAPTIVE_UNITS8,
                                        mrep=tile["mrep"])
        # adaptive 16-token kernel: "16-token loop (8-token loop)"
        out.append(f"{st['per_weight']:.2f}" + (f" ({st['per_weight_8']:.2f})" if "per_weight_8" in st else ""))
    return " / ".join(out)


def mma_candidates(args) -> list[str]:
    """The --mma-candidates keys (empty: all); an unknown key is an error, not a silently skipped column."""
    wanted = [w.strip() for w in args.mma_candidates.split(",") if w.strip()]
    unknown = [w for w in wanted if w not in MMA_CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown --mma-candidates {unknown}; choose from {list(MMA_CANDIDATES)}")
    return wanted


def mma_sweep(sets, inputs, k, args, cuda) -> dict:
    """Layer time of the nvfp4/mma path per MMA_CANDIDATES entry (graph replays; --mma-candidates: a subset)."""
    out = {}
    wanted = mma_candidates(args)
    for key, opts in MMA_CANDIDATES.items():
        if wanted and key not in wanted:
            continue
        env = opts.get("env", {})
        kw = {kk: vv for kk, vv in opts.items() if kk != "env"}

        def call(s, x, logits):
            topw, ids = router.route(logits, k, True, weight_dtype=x.dtype)
            a, b = with_packed(s[("nvfp4", "w13")], s[("nvfp4", "w2")])
            return experts.moe_experts_mma(x, topw, ids, a.packed, b.packed, **kw)
        try:
            calls = [with_env(env, lambda s=s, inp=inp: graphed(lambda: call(s, inp[0], inp[1]), cuda)[0])
                     for s, inp in zip(sets, inputs)]
            out[key] = bench(calls, args.warmup, args.rep, cuda, args.flush)
        except Exception as e:
            out[key] = f"failed: {type(e).__name__}: {str(e)[:100]}"
    return out


def profile_kernels(fn) -> dict:
    """Device microseconds per kernel name over 20 replays of fn, divided by 20. The MMA chain's programmatic
    dependent launch is off here (LINRNN_MMA_PDL=0): under PDL a kernel's span includes its wait for the previous
    kernel, so the routed GEMMs' share would count gate_up's tail twice."""
    from torch.profiler import ProfilerActivity, profile

    before = os.environ.get("LINRNN_MMA_PDL")
    os.environ["LINRNN_MMA_PDL"] = "0"
    try:
        fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fn()
            torch.cuda.synchronize()
    finally:
        if before is None:
            os.environ.pop("LINRNN_MMA_PDL")
        else:
            os.environ["LINRNN_MMA_PDL"] = before
    times = {}
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t:
            times[ev.key[:60]] = round(t / 20, 2)
    times.update(_by_launch(prof, 20))
    return dict(sorted(times.items(), key=lambda kv: -kv[1]))


def _by_launch(prof, calls: int) -> dict:
    """A GEMM kernel launched n > 1 times per call (the MMA / wgmma kernels: gate_up, then down) also per launch, in
    launch order: "name [1]", "name [2]" (device us per call); {} where the profiler's events do not say."""
    try:
        from torch.autograd import DeviceType

        by_name: dict = {}
        for e in prof.events():
            if e.device_type == DeviceType.CUDA and ("nvfp4_mma" in e.name or "nvfp4_wgmma" in e.name):
                by_name.setdefault(e.name, []).append(e)
        out = {}
        for name, evs in by_name.items():
            per = len(evs) // calls
            if per < 2 or per * calls != len(evs):
                continue
            for i, e in enumerate(sorted(evs, key=lambda e: e.time_range.start)):
                key = f"{name[:50]} [{i % per + 1}]"
                out[key] = out.get(key, 0.0) + e.time_range.elapsed_us() / calls
        return {k: round(v, 2) for k, v in out.items()}
    except Exception:  # noqa: BLE001 - a profiler without these fields: the totals stand alone
        return {}
        out = {}
        for i, e in enumerate(evs):
            key = f"{e.name[:50]} [{i % per + 1}]"
            out[key] = out.get(key, 0.0) + e.time_range.elapsed_us() / calls
        return {k: round(v, 2) for k, v in out.items()}
    except Exception:  # noqa: BLE001 - a profiler without these fields: the totals stand alone
        return {}


# ---------------------------------------------------------------------------------------- run

def run(args) -> int:
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if not cuda and not args.tiny:
        raise SystemExit("the MoE benchmark needs a CUDA GPU (or --tiny for a CPU smoke run)")
    shape = TINY if args.tiny else QWEN35
    E, k, H, I = shape["E"], shape["k"], shape["H"], shape["I"]
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    mma_candidates(args)
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"unknown variants {unknown}; choose from {list(VARIANTS)}")
    if not hasattr(torch, "_grouped_mm"):
        print("torch._grouped_mm is missing: skipping the grouped_mm peer and dequant baseline")
        variants = [v for v in variants if v not in ("bf16/grouped_mm", "nvfp4/dequant")]
    if not cuda:
        variants = [v for v in variants if not v.startswith(("nvfp4/mma", "nvfp4/asm", "nvfp4/w4a4"))]  # GPU-only paths
    elif torch.cuda.get_device_capability()[0] >= 10 and "nvfp4/w4a4" not in variants:
        variants.insert(1, "nvfp4/w4a4")  # FP4 tensor cores: time the (untested) W4A4 path too
    fmts = {VARIANTS[v][0] for v in variants}
    info = env_info(**({"nvfp4_gemm": gg.describe_nvfp4_gemm()} if cuda else {}))
    print(info.get("nvfp4_gemm", "interpreter run"), flush=True)
    sets = [make_set(shape, fmts, device, seed) for seed in range(args.sets)]
    copy_gbs = copy_bandwidth_gbs(device)
    print(f"copy bandwidth {copy_gbs:.0f} GB/s", flush=True)

    rows = []
    for B in [int(b) for b in args.batch_sizes.split(",")]:
        inputs = []
        for s in sets:
            x = torch.randn(B, H, device=device).bfloat16()
            # f32 logits: bf16 ones tie often among 256 experts, and tie order is unspecified
            inputs.append((x, x.float() @ s["router"].t()))
        ids0 = naive.route(inputs[0][1], k, True)[1]
        hit = int(ids0.unique().numel())
        row = {"B": B, "E": E, "k": k, "H": H, "I": I, "experts_hit": hit, "us": {}, "gbs": {}, "err": {},
               "expert_bytes": hit * expert_bytes(sets[0][("nvfp4", "w13")], sets[0][("nvfp4", "w2")])
               if ("nvfp4", "w13") in sets[0] else 0,
               "timing": ("eager" if args.no_graph else "CUDA-graph replay")
               + (", L2 flushed by reading 256 MB (--flush read)" if args.flush == "read"
                  else ", L2 flushed by zeroing 256 MB (--flush zero)")}
        refs = {}  # one reference per (set, format, activations), shared by the variants
        for v in variants:
            fmt, fn = VARIANTS[v]
            calls = [lambda s=s, inp=inp: fn(inp[1], inp[0], k, s[(fmt, "w13")], s[(fmt, "w2")])
                     for s, inp in zip(sets, inputs)]
            try:
                # correctness first, on every set: a red kernel is not timed
                errs = []
                for si, (s, (x, logits)) in enumerate(zip(sets, inputs)):
                    act = "nvfp4" if v == "nvfp4/w4a4" else "float"
                    if (si, fmt, act) not in refs:
                        topw, ids = naive.route(logits, k, True)
                        refs[(si, fmt, act)] = naive.moe_experts(x, topw.to(x.dtype), ids, s[(fmt, "w13")],
                                                                 s[(fmt, "w2")], activations=act)
                    ref = refs[(si, fmt, act)]
                    y = combined(fn(logits, x, k, s[(fmt, "w13")], s[(fmt, "w2")]))
                    errs.append(float((y.double() - ref.double()).norm() / ref.double().norm()))
                row["err"][v] = max(errs)
                if not max(errs) <= (2 * TOL if v == "nvfp4/w4a4" else TOL):
                    row["us"][v] = f"FAILED (rel err {max(errs):.2e})"
                    continue
                modes = set()
                if not args.no_graph and v not in EAGER_ONLY:
                    calls, modes = zip(*[graphed(c, cuda) for c in calls])
                    calls, modes = list(calls), set(modes)
                us = bench(calls, args.warmup, args.rep, cuda, args.flush)
                row["us"][v] = us
                if (modes - {"graph"} or v in EAGER_ONLY) and not args.no_graph:
                    row.setdefault("notes", []).append(f"{v}: {sorted(modes) or ['eager']}")
                per_expert = expert_bytes(sets[0][(fmt, "w13")], sets[0][(fmt, "w2")])
                moved = hit * per_expert + B * E * 2 + 2 * B * H * 2
                row["gbs"][v] = moved / us / 1e3
                row.setdefault("tflops", {})[v] = 2 * B * k * 3 * I * H / us / 1e6  # routed GEMMs only
            except Exception as e:  # a failing peer is reported, not hidden
                row["us"][v] = f"error: {type(e).__name__}: {str(e)[:100]}"
        if "nvfp4/mma" in variants and cuda and ("nvfp4", "w13") in sets[0]:
            row["mma_ipw"] = mma_ipw(B * k, *with_packed(sets[0][("nvfp4", "w13")], sets[0][("nvfp4", "w2")]))
        if args.sweep:
            row["sweep"] = sweep(shape, sets, B, args, cuda, device)
        if args.mma_sweep and cuda:
            row["mma_sweep"] = mma_sweep(sets, inputs, k, args, cuda)
            print("mma sweep", B, json.dumps(row["mma_sweep"]), flush=True)
        if args.profile and cuda:
            row["profile"] = {}
            for v in variants:
                fmt, fn = VARIANTS[v]
                s, inp = sets[0], inputs[0]
                try:
                    row["profile"][v] = profile_kernels(lambda: fn(inp[1], inp[0], k, s[(fmt, "w13")], s[(fmt, "w2")]))
                except Exception as e:
                    row["profile"][v] = f"failed: {type(e).__name__}: {e}"
            print("profile", B, json.dumps(row["profile"]), flush=True)
        rows.append(row)
        print(json.dumps({kk: vv for kk, vv in row.items() if kk not in ("sweep", "mma_sweep", "profile")},
                         default=str), flush=True)

    ipw = None
    if "nvfp4/mma" in variants:
        try:
            from linrnn_kernels.moe import nvfp4_mma

            ipw = {f"{'gate_up' if g else 'down'} split {sp} u{u}{' pf' if pf else ''}":
                   nvfp4_mma.k_loop_stats(gated=g, split=sp, units=u, prefetch=pf)["per_weight"]
                   for g, sp, u, pf in ((True, 1, 1, True), (True, 4, 1, True), (False, 1, 1, True),
                                        (False, 2, 1, True))}
        except Exception as e:  # the table still stands without it
            print(f"instruction count unavailable: {type(e).__name__}: {e}")
    table = markdown(rows, variants, copy_gbs, info, ipw)
    if any(r["B"] >= 128 for r in rows):  # prefill sizes: the routed GEMMs are compute-bound
        table += ("\n## Routed-GEMM TFLOP/s (2 x B x top-k x 3 I H per layer / layer time; bf16 tensor-core peak "
                  "measured ~790 on the H200)\n\n| B | " + " | ".join(variants) + " |\n|---:|"
                  + "---:|" * len(variants) + "\n")
        for r in rows:
            tf = r.get("tflops", {})
            table += f"| {r['B']} | " + " | ".join(f"{tf[v]:.0f}" if v in tf else "-" for v in variants) + " |\n"
    if args.sweep:
        table += "\n## Config sweep (nvfp4, per GEMM, median us)\n\n"
        table += "| B | block_m | default | best gate_up | best down |\n|---:|---:|---|---|---|\n"
        for r in rows:
            sw = r.get("sweep", {})
            for bm, entry in sw.get("per_block_m", {}).items():
                best = [f"{e['best'][0]} {e['best'][1]:.1f}" if e["best"] else "none" for e in
                        (entry["gate_up"], entry["down"])]
                table += f"| {r['B']} | {bm} | {sw['default']} | {best[0]} | {best[1]} |\n"
    if args.mma_sweep:
        keys = [kk for kk in MMA_CANDIDATES if kk in rows[0].get("mma_sweep", {})]
        table += ("\n## nvfp4/mma layer time per variant (benchmarks/kernels/moe.py MMA_CANDIDATES; routed by the separate "
                  "route kernel), us\n\n")
        table += "| B | " + " | ".join(keys) + " |\n|---:|" + "---:|" * len(keys) + "\n"
        for r in rows:
            cells = [r.get("mma_sweep", {}).get(kk) for kk in keys]
            table += f"| {r['B']} | " + " | ".join(f"{c:.1f}" if isinstance(c, float) else str(c) for c in cells) + " |\n"
    if args.profile:
        table += "\n## Device time per kernel (us per layer call, torch.profiler, eager calls, the MMA chain's PDL off)\n\n"
        for r in rows:
            for v, prof in r.get("profile", {}).items():
                items = prof.items() if isinstance(prof, dict) else []
                table += f"- B={r['B']} {v}: " + "; ".join(f"{kk} {vv}" for kk, vv in items) + "\n"
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        tag = (info.get("gpu", "cpu").replace(" ", "_") + ("_tiny" if args.tiny else ""))
        with open(os.path.join(args.out, f"moe_{tag}.md"), "w") as f:
            f.write(table)
        with open(os.path.join(args.out, f"moe_{tag}.json"), "w") as f:
            json.dump({"env": info, "copy_gbs": copy_gbs, "rows": rows}, f, indent=1, default=str)
        print(f"wrote {args.out}/moe_{tag}.md and .json")
    ours_variants = [v for v in variants if v in ("nvfp4/mma", "nvfp4/asm", "nvfp4/triton", "fp8", "bf16/ours")]
    failed = [(r["B"], v) for r in rows for v in ours_variants if not isinstance(r["us"].get(v), float)]
    if failed:
        print(f"our kernels failed or were not timed at (B, variant): {failed}")
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
