"""Skinny GEMM (kernels/gemv) on the model's dense decode projections, each with the fusion the layers
use, against the unfused chain it replaces (cuBLAS + the separate kernels) and plain cuBLAS, M in 1..32.

Cases (Qwen3.5-35B-A3B shapes, calls per decode step in brackets):
  gdn.in_proj  [30]  in_proj + causal conv + SiLU epilogue        chain: F.linear + conv1d_decode
  gdn.out_proj [30]  gated RMSNorm prologue, residual + next norm  chain: gated_rmsnorm + F.linear + add_rmsnorm
  attn.qkv     [10]  plain                                         chain: F.linear
  attn.o_proj  [10]  sigmoid-gate prologue, residual + next norm   chain: x * sigmoid(g) + F.linear + add_rmsnorm
  shared.down  [40]  gate_add epilogue, residual + next norm       chain: F.linear + sigmoid add + add_rmsnorm
  router       [40]  fused router + shared gate_up (SiLU*mul)      chain: F.linear + route + align + F.linear + silu_mul
  lm_head      [1]   plain                                         chain: F.linear
  diag.out_proj_plain / _res / _res_norm (only when named in --only): the out projections' shape without fusions,
                     with the residual add, with residual + next RMSNorm (the fusions' costs; not in the table)
Every (case, M) tries a list of tile configs (FMA path up to 8 rows, tensor-core dots from 4 rows up); each
candidate is first checked against the naive composition (NaN-poisoned outputs) and not timed if wrong.
Timing: CUDA-graph replay over rotating weight copies (> L2), median; GB/s of the weight stream and its
fraction of the copy bandwidth measured in the same run. Compiles run first in a process pool (the Triton
disk cache then serves the timing process).

Writes <out>/gemv.md, gemv.json and skinny_table.json (per N,K,fmt key: the fastest config per M and `max_m`,
the largest M up to which the fused kernel beat the unfused chain at every M; "router": {"max_m": ...}); with
--base-table, that table updated by this sweep's keys and rows (a sweep over some M or cases only).

    python -m linrnn_bench.kernels.gemv --out benchmarks/results/kernels/gemv
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SMS = 132


@dataclass(frozen=True)
class Case:
    name: str
    rows: int  # weight rows
    K: int
    calls: int  # per decode step (35B-A3B)
    kind: str  # plain | conv | gated | sigmoid | gate_add | router


# the fusion each case's call site tunes by (kernels/gemv fusion_kind)
FUSION = {"plain": "", "conv": "conv", "gated": "gated_norm", "sigmoid": "sigmoid_gate", "gate_add": "gate_add",
          "router": "", "res": "", "res_norm": ""}


def cases(cfg) -> list[Case]:
    H = cfg.hidden_size
    return [Case("gdn.in_proj", cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, H, 30, "conv"),
            Case("gdn.out_proj", H, cfg.value_dim, 30, "gated"),
            Case("attn.qkv", cfg.num_attention_heads * cfg.head_dim * 2 + 2 * cfg.num_key_value_heads * cfg.head_dim,
                 H, 10, "plain"),
            Case("attn.o_proj", H, cfg.num_attention_heads * cfg.head_dim, 10, "sigmoid"),
            Case("shared.down", H, cfg.shared_expert_intermediate_size, 40, "gate_add"),
            Case("router", cfg.num_experts + 1, H, 40, "router"),
            Case("lm_head", cfg.vocab_size, H, 1, "plain"),
            # diagnostic, only when named in --only: the out projections' GEMV without their fusions (no tickets)
            Case("diag.out_proj_plain", H, cfg.value_dim, 0, "plain"),
            Case("diag.out_proj_res", H, cfg.value_dim, 0, "res"),  # + residual add
            Case("diag.out_proj_res_norm", H, cfg.value_dim, 0, "res_norm")]  # + residual add + next RMSNorm


def selected(case: Case, only: set) -> bool:
    return case.name in only if only else not case.name.startswith("diag.")


def n_out(case: Case, cfg) -> int:
    """The N the call site passes to skinny_config (the table key)."""
    if case.kind == "router":
        return case.rows + cfg.shared_expert_intermediate_size
    return case.rows


# FMA tiles (block_n, block_k): the narrow / long ones (1-8 weight rows x 1024-2048 of K) put a program's
# whole K slice in flight at once (K = 4096 out projections: no split-K ticket, or one short split)
FMA_TILES = ((32, 256), (16, 256), (16, 512), (8, 512), (8, 256), (4, 512), (8, 128), (4, 256),
             (16, 1024), (8, 1024), (4, 1024), (2, 1024), (4, 2048), (2, 2048), (1, 2048))
DOT_TILES = ((32, 128, 4), (64, 128, 4), (64, 64, 6), (32, 256, 3), (128, 64, 4), (64, 256, 3), (16, 256, 3))


def candidates(M: int, N: int, K: int, lm_head: bool = False, one_shot_only: bool = False):
    """Tile configs worth timing for an [M, K] x [N, K]^T projection: FMA tiles with 4 or 8 warps (at most 64
    f32 products per thread, at least 16) up to 8 rows, tensor-core dots from 4 rows up."""
    from linrnn_kernels.gemv.config import SkinnyConfig, split_for

    if one_shot_only:
        return one_shot_candidates(M, N, K)
    bm = 1 << (max(M, 1) - 1).bit_length()
    out = []
    if bm <= 8:
        for warps in (4, 8):
            for bn, bk in FMA_TILES:
                if bk > K or not 16 * 32 * warps <= bm * bn * bk <= 64 * 32 * warps:
                    continue
                s = split_for(N, K, bn, bk, 4 * SMS)
                out.append(SkinnyConfig(bn, bk, s, warps, 1, False))
                if s > 1 and not lm_head:
                    out.append(SkinnyConfig(bn, bk, max(1, s // 2), warps, 1, False))
    if M >= 4:
        for warps in (4, 8):
            for bn, bk, st in DOT_TILES:
                if bk <= K and (warps == 4 or bn >= 64):
                    out.append(SkinnyConfig(bn, bk, split_for(N, K, bn, bk, 2 * SMS), warps, st, True))
    if not lm_head:
        out += one_shot_candidates(M, N, K)
    seen, uniq = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            uniq.append(c)
    return uniq[:4] if lm_head else uniq


def one_shot_candidates(M: int, N: int, K: int):
    """One-shot tiles (skinny.py ONE_SHOT: a program's whole K slice of block_k loaded before the PDL wait, no K
    loop): 8-64 KB of weights per program, at least one program per SM, at most 2x the resident capacity (~4
    per SM); FMA up to 8 rows (<= 1024 products per thread), tensor-core dots from 2 rows."""
    from linrnn_kernels.gemv.config import SkinnyConfig

    bm = 1 << (max(M, 1) - 1).bit_length()
    out = []
    for bn in (1, 2, 4, 8, 16, 32, 64):
        for bk in (256, 512, 1024, 2048, 4096):
            if bk > K or bn > N or not 8 << 10 <= 2 * bn * bk <= 64 << 10:
                continue
            programs = -(-N // bn) * -(-K // bk)
            if not SMS <= programs <= 8 * SMS:
                continue
            if bm <= 8 and bn <= 16:
                for warps in ((8, 16) if bn * bk >= 16384 else (4, 8)):
                    per_thread = bn * bk // (32 * warps)
                    if 16 <= per_thread <= 64 and bm * per_thread <= 1024:
                        out.append(SkinnyConfig(bn, bk, 0, warps, 1, False, one_shot=True))
            if M >= 2 and bn >= 16:
                for warps in (4, 8):
                    if bn * bk // (32 * warps) <= 128:
                        out.append(SkinnyConfig(bn, bk, 0, warps, 1, True, one_shot=True))
    return out


class Inputs:
    """Weights (rotating copies), activations and the fused / chain / reference calls of one case at M rows."""

    def __init__(self, case: Case, cfg, M: int, dev, copies: int):
        from linrnn_kernels.quant import WeightTensor

        torch.manual_seed(1000 * M + case.rows)
        bf = torch.bfloat16
        self.case, self.M, self.cfg = case, M, cfg
        H, K = cfg.hidden_size, case.K

        def wt(n, k):
            return WeightTensor("dense", (torch.randn(n, k, device=dev) / math.sqrt(k)).to(bf))

        self.ws = [wt(case.rows, K) for _ in range(copies)]
        self.x = torch.randn(M, K, device=dev).to(bf)
        self.res = torch.randn(M, H, device=dev).to(bf)
        self.nw = (0.1 * torch.randn(H, device=dev)).to(bf)
        self.kw: dict = {}
        if case.kind == "conv":
            C = cfg.conv_dim
            self.cw = (0.5 * torch.randn(C, cfg.linear_conv_kernel_dim, device=dev)).to(bf)
            self.state = torch.randn(M + 1, cfg.linear_conv_kernel_dim - 1, C, device=dev).to(bf)
            self.idx = torch.arange(1, M + 1, dtype=torch.int32, device=dev)
            self.kw = dict(epilogue="conv", conv=(self.cw, self.state, self.idx))
        elif case.kind == "gated":
            dv = cfg.linear_value_head_dim
            self.z = torch.randn(M, K + 64, device=dev).to(bf)[:, 64:]
            self.kw = dict(prologue_kind="gated_norm", gate=self.z, pro_w=(1 + 0.1 * torch.randn(dv, device=dev)).to(bf),
                           head=dv, residual=self.res, norm_w=self.nw)
        elif case.kind == "sigmoid":
            d = cfg.head_dim
            self.g = torch.randn(M, K // d, 2 * d, device=dev).to(bf)[..., d:]
            self.kw = dict(prologue_kind="sigmoid_gate", gate=self.g, head=d, residual=self.res, norm_w=self.nw)
        elif case.kind == "gate_add":
            self.logits = torch.randn(M, cfg.num_experts + 1, device=dev).to(bf)
            self.kw = dict(epilogue="gate_add", addend=torch.randn(M, H, device=dev).to(bf),
                           gate_logit=self.logits[:, cfg.num_experts:], residual=self.res, norm_w=self.nw)
        elif case.kind == "router":
            self.w13 = [wt(2 * cfg.shared_expert_intermediate_size, H) for _ in range(copies)]
        elif case.kind in ("res", "res_norm"):
            self.kw = dict(residual=self.res, **({"norm_w": self.nw} if case.kind == "res_norm" else {}))

    def fused(self, w_i: int, c):
        from linrnn_kernels.gemv import skinny

        if self.case.kind == "router":
            from linrnn_kernels.moe import router_fused

            return router_fused.route_align(self.x, self.ws[w_i], self.cfg.num_experts, self.cfg.num_experts_per_tok,
                                            True, 8, c, shared_w13=self.w13[w_i])
        return skinny.skinny_linear(self.x, self.ws[w_i], c, **self.kw)

    def chain(self, w_i: int):
        from linrnn_kernels import norm as norm_ops
        from linrnn_kernels.gdn import conv1d_decode
        from linrnn_kernels.moe.align import moe_align_block_size
        from linrnn_kernels.moe.router import route

        x, w, kind = self.x, self.ws[w_i].data, self.case.kind
        if kind == "router":
            logits = F.linear(x, w)
            tw, ids = route(logits[:, :self.cfg.num_experts], self.cfg.num_experts_per_tok, True)
            moe_align_block_size(ids, self.cfg.num_experts, 8)
            return norm_ops.silu_mul(F.linear(x, self.w13[w_i].data))
        if kind == "conv":
            y = F.linear(x, w)
            return conv1d_decode(y[:, :self.cfg.conv_dim], self.cw, self.state, self.idx)
        if kind == "gated":
            T, head = self.M, self.kw["head"]
            x = norm_ops.gated_rmsnorm(x.reshape(T, -1, head), self.z.reshape(T, -1, head), self.kw["pro_w"],
                                       1e-6).reshape(T, -1)
        elif kind == "sigmoid":
            x = x * torch.sigmoid(self.g.reshape(x.shape))
        y = F.linear(x, w)
        if kind == "res":
            return y + self.res
        if kind == "gate_add":
            y = self.kw["addend"] + torch.sigmoid(self.kw["gate_logit"]) * y
        if "norm_w" in self.kw:
            return norm_ops.add_rmsnorm(y, self.res, self.nw, 1e-6)
        return y

    def check(self, c) -> float:
        """rel. error of the fused call against the naive composition (inf on NaN)."""
        from linrnn_kernels.gemv import naive

        if self.case.kind == "router":
            from linrnn_kernels.moe import router_fused

            logits, tw, ids, _, h = self.fused(0, c)
            ref_l = router_fused.naive_route_align(self.x, self.ws[0], self.cfg.num_experts,
                                                   self.cfg.num_experts_per_tok, True, 8)[0]
            ref_h = router_fused.naive_shared_gate_up(self.x, self.w13[0])
            return max(_rel(logits, ref_l), _rel(h, ref_h))
        if self.case.kind == "conv":
            st = self.state.clone()
            out = self.fused(0, c)
            self.state.copy_(st)
            ref = naive.skinny_linear(self.x, self.ws[0], **{**self.kw, "conv": (self.cw, st, self.idx)})
        else:
            out = self.fused(0, c)
            ref = naive.skinny_linear(self.x, self.ws[0], **self.kw)
        outs = out if isinstance(out, tuple) else (out,)
        refs = ref if isinstance(ref, tuple) else (ref,)
        return max(_rel(a, b) for a, b in zip(outs, refs))


def _rel(a, b) -> float:
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def _copies(case: Case, cfg) -> int:
    wbytes = case.rows * case.K * 2
    if case.kind == "router":
        wbytes += 2 * cfg.shared_expert_intermediate_size * cfg.hidden_size * 2
    return max(1, min(16, (256 << 20) // wbytes))


def weight_bytes(case: Case, cfg) -> int:
    b = case.rows * case.K * 2
    if case.kind == "router":
        b += 2 * cfg.shared_expert_intermediate_size * cfg.hidden_size * 2
    return b


def table_from_rows(rows: list[dict]) -> dict:
    """Per table key: the fastest config per M, and max_m = the largest M up to which the fused call beat
    the best unfused alternative (the chain; cuBLAS alone for a plain projection) at every M."""
    table: dict = {}
    for r in sorted(rows, key=lambda r: (r["key"], r["M"])):
        e = table.setdefault(r["key"], {"max_m": 0, "_winning": True})
        e[str(r["M"])] = r["best_config"]
        alt = min(r["chain_us"], r["cublas_us"]) if r["plain"] else r["chain_us"]
        if e["_winning"] and r["fused_us"] < alt:
            e["max_m"] = r["M"]
        else:
            e["_winning"] = False
    for e in table.values():
        e.pop("_winning")
    return table


def merge_tables(base: dict, new: dict, ms: list[int]) -> dict:
    """`base` (an earlier table) updated by a sweep over the rows `ms` only: each measured key takes the new
    config at the measured M and keeps the base's at the others; its max_m is the new one where the fused
    call lost at a measured M, else (it won at every measured M) the base's if that reaches further."""
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for key, e in new.items():
        m = out.setdefault(key, {})
        m.update({k: v for k, v in e.items() if k != "max_m"})
        won_all = e["max_m"] >= max(ms)
        m["max_m"] = max(e["max_m"], int(m.get("max_m", 0))) if won_all and "max_m" in m else e["max_m"]
    return out


def _jobs(cfg, ms, only, one_shot_only=False):
    jobs = []
    for ci, case in enumerate(cases(cfg)):
        if not selected(case, only):
            continue
        for M in ms:
            cands = candidates(M, n_out(case, cfg), case.K, case.name == "lm_head", one_shot_only)
            if case.name.startswith("diag."):  # the out projections' chosen tiles (tuned.json, round 5) only
                cands = [c for c in cands if c.astuple()[:7] in DIAG_TILES]
            if case.kind in ("gated", "sigmoid"):  # the prologue in its own launch, the GEMM without it
                cands += [dataclasses.replace(c, split_prologue=True) for c in cands
                          if c.one_shot and (M >= 2 or c.astuple()[:4] in SPLIT_PROLOGUE_M1)]
            for c in cands:
                jobs.append((ci, M, c))
    return jobs


DIAG_TILES = ([8, 4096, 0, 16, 1, 0, 1], [64, 512, 0, 8, 1, 1, 1], [4, 4096, 0, 8, 1, 0, 1])
# at one row the split prologue is tried on the one-shot tiles that won with the fused prologue (H200, round 5)
SPLIT_PROLOGUE_M1 = ([8, 4096, 0, 16], [4, 4096, 0, 8], [16, 1024, 0, 8], [8, 2048, 0, 8])


def _compile_worker(args):
    """Runs each job once (compiles it into the Triton disk cache); returns the failures."""
    model, jobs = args
    import warnings

    warnings.filterwarnings("ignore")
    from linrnn_serve.presets import resolve_model

    torch.cuda.set_device(0)
    cfg = resolve_model(model, "dummy").cfg
    cs = cases(cfg)
    dev = torch.device("cuda")
    failed, cache = [], {}
    for ci, M, c in jobs:
        key = (ci, M)
        if key not in cache:
            cache.clear()
            cache[key] = Inputs(cs[ci], cfg, M, dev, 1)
        try:
            cache[key].fused(0, c)
        except Exception as e:  # noqa: BLE001 - reported, the candidate is skipped later
            failed.append((ci, M, c.astuple(), f"{type(e).__name__}: {str(e)[:200]}"))
    torch.cuda.synchronize()
    return failed


def precompile(model: str, jobs, workers: int) -> list:
    import multiprocessing as mp

    if workers <= 1:
        return _compile_worker((model, jobs))
    shards = [jobs[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        out = pool.map(_compile_worker, [(model, s) for s in shards if s])
    return [f for part in out for f in part]


def run(args) -> dict:
    from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info, time_graph
    from linrnn_kernels.gemv import config as gcfg
    from linrnn_serve.presets import resolve_model

    dev = torch.device("cuda")
    cfg = resolve_model(args.model, "dummy").cfg
    ms = [int(v) for v in args.m.split(",")]
    only = set(args.only.split(",")) if args.only else set()
    jobs = _jobs(cfg, ms, only, args.one_shot_only)
    t0 = time.time()
    failed = precompile(args.model, jobs, args.workers)
    print(f"precompiled {len(jobs)} kernels in {time.time() - t0:.0f} s ({len(failed)} failed)", flush=True)
    for f in failed[:20]:
        print("  compile/run failure:", f, flush=True)
    copy = copy_bandwidth_gbs(dev)
    rows = []
    by_case: dict = {}
    for ci, M, c in jobs:
        by_case.setdefault((ci, M), []).append(c)
    for ci, case in enumerate(cases(cfg)):
        if not selected(case, only):
            continue
        wbytes = weight_bytes(case, cfg)
        key = gcfg.table_key(n_out(case, cfg), case.K, "router" if case.kind == "router" else "dense",
                             FUSION[case.kind])
        for M in ms:
            inp = Inputs(case, cfg, M, dev, _copies(case, cfg))
            n = len(inp.ws)
            t_chain = time_graph([lambda i=i: inp.chain(i) for i in range(n)], iters=args.iters)
            t_cublas = time_graph([lambda i=i: F.linear(inp.x, inp.ws[i].data) for i in range(n)], iters=args.iters)
            default = (gcfg.skinny_config(M, n_out(case, cfg), case.K, "dense", dev, inp.kw.get("head", 0),
                                          FUSION[case.kind])
                       if case.kind != "router" else gcfg.router_config(M, n_out(case, cfg), case.K, dev))
            results = []
            for c in by_case.get((ci, M), []) + [default]:
                try:
                    err = inp.check(c)
                    if not err <= 2e-2:
                        print(f"{case.name} M={M} {c.astuple()}: rel err {err:.3g}: not timed", flush=True)
                        continue
                    t = time_graph([lambda i=i: inp.fused(i, c) for i in range(n)], iters=args.iters)
                except Exception as e:  # noqa: BLE001 - a config that does not compile / fit: report, go on
                    print(f"{case.name} M={M} {c.astuple()}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                results.append((t, c, c is default))
            if not results:
                continue
            t_best, c_best, _ = min(results, key=lambda r: r[0])
            t_def = next((r[0] for r in results if r[2]), float("nan"))
            gbs = wbytes / (t_best * 1e-3) / 1e9
            row = {"case": case.name, "key": key, "plain": case.kind == "plain", "N": case.rows, "K": case.K, "M": M,
                   "calls": case.calls,
                   "chain_us": 1e3 * t_chain, "cublas_us": 1e3 * t_cublas, "fused_us": 1e3 * t_best,
                   "default_us": 1e3 * t_def, "fused_GBs": gbs, "pct_copy": 100 * gbs / copy,
                   "cublas_pct_copy": 100 * wbytes / (t_cublas * 1e-3) / 1e9 / copy,
                   "floor_us": wbytes / (copy * 1e9) * 1e6, "vs_chain": t_chain / t_best,
                   "best_config": c_best.astuple(),
                   "all": [(1e3 * t, c.astuple()) for t, c, _ in sorted(results, key=lambda r: r[0])]}
            rows.append(row)
            print(f"{case.name:13s} M={M:2d} chain {row['chain_us']:7.1f} cuBLAS {row['cublas_us']:7.1f} "
                  f"fused {row['fused_us']:7.1f} (default {row['default_us']:7.1f}) us  {row['pct_copy']:5.1f}% copy "
                  f"(cuBLAS {row['cublas_pct_copy']:5.1f}%)  {row['vs_chain']:.2f}x chain  {c_best.astuple()}",
                  flush=True)
            del inp
            torch.cuda.empty_cache()
    table = table_from_rows([r for r in rows if not r["case"].startswith("diag.")])
    if args.base_table:
        with open(args.base_table) as f:
            table = merge_tables(json.load(f), table, ms)
    res = {"env": env_info(model=args.model), "copy_GBs": copy, "rows": rows, "table": table,
           "compile_failures": failed}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "skinny_table.json"), "w") as f:
        json.dump(table, f, indent=1)
    text = markdown(res, ms)
    with open(os.path.join(args.out, "gemv.md"), "w") as f:
        f.write(text)
    print(text, flush=True)
    return res


def markdown(res: dict, ms: list[int]) -> str:
    """gemv.md of a run's gemv.json content (rows measured at the rows `ms`)."""
    rows, table, copy = res["rows"], res["table"], res["copy_GBs"]
    env = res["env"]
    lines = [f"# Skinny GEMM + fusions vs the unfused chain ({env.get('gpu')}, {str(env.get('commit', ''))[:10]}, "
             f"{env.get('date')})", "",
             f"Copy bandwidth {copy:.0f} GB/s. us per call (CUDA-graph replay, rotating weights); % copy = weight bytes"
             " / time / copy bandwidth; chain = the unfused ops the fused call replaces.", "",
             "| case | N | K | M | chain us | cuBLAS us | fused us | fused % copy | cuBLAS % copy | floor us | "
             "fused vs chain | config [bn, bk, split, warps, stages, dot] |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['case']} | {r['N']} | {r['K']} | {r['M']} | {r['chain_us']:.1f} | {r['cublas_us']:.1f} | "
                     f"{r['fused_us']:.1f} | {r['pct_copy']:.0f} | {r['cublas_pct_copy']:.0f} | {r['floor_us']:.1f} | "
                     f"{r['vs_chain']:.2f}x | {r['best_config']} |")
    lines += ["", "Per decode step (calls x us): " + ", ".join(
        f"M={M}: fused {sum(r['calls'] * r['fused_us'] for r in rows if r['M'] == M):.0f} us vs chain "
        f"{sum(r['calls'] * r['chain_us'] for r in rows if r['M'] == M):.0f} us" for M in ms),
        "", "max_m per key (fused used up to this M): " + ", ".join(
            f"{k}: {v['max_m']}" for k, v in table.items() if isinstance(v, dict))]  # "_source" is a note
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen35moe-nvfp4")
    p.add_argument("--m", default="1,2,4,8,16,32")
    p.add_argument("--only", default="", help="comma list of case names")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--one-shot-only", action="store_true",
                   help="time only the one-shot tiles (and the table's current config) per case and M")
    p.add_argument("--workers", type=int, default=min(14, os.cpu_count() or 1))
    p.add_argument("--out", default="benchmarks/results/kernels/gemv")
    p.add_argument("--base-table", default=None, metavar="JSON",
                   help="write skinny_table.json as this table updated by the sweep (merge_tables)")
    p.add_argument("--table-from", default=None, metavar="GEMV_JSON",
                   help="only rebuild skinny_table.json (current keys) from an earlier run's gemv.json")
    args = p.parse_args(argv)
    if args.table_from:
        rows = json.load(open(args.table_from))["rows"]
        for r in rows:  # runs before the fusion-keyed table: derive key / plain from the case
            kind = {c.name: c.kind for c in cases(_shape_cfg(args.model))}[r["case"]]
            r.setdefault("plain", kind == "plain")
            if "key" not in r:
                from linrnn_kernels.gemv.config import table_key

                n = r["N"] + (_shape_cfg(args.model).shared_expert_intermediate_size if kind == "router" else 0)
                r["key"] = table_key(n, r["K"], "router" if kind == "router" else "dense", FUSION[kind])
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "skinny_table.json"), "w") as f:
            json.dump(table_from_rows(rows), f, indent=1)
        return 0
    run(args)
    return 0


def _shape_cfg(model: str):
    from linrnn_serve.presets import resolve_model

    return resolve_model(model, "dummy").cfg


if __name__ == "__main__":
    raise SystemExit(main())
