"""Skinny GEMM (kernels/gemv) vs cuBLAS on the model's dense decode projections, M in 1..32 rows.

For every dense projection shape of the model (GDN in_proj / out_proj, attention qkv / o_proj, shared
expert gate_up / down, router + shared gate, lm_head) and M in --m: cuBLAS (F.linear) and the skinny
kernel with its default config and a few neighbours (split-K halved / doubled, wider N tiles), each
timed by CUDA-graph replay over rotating weight copies (> L2), plus the GB/s of the weight stream.

Writes <out>/gemv.md, <out>/gemv.json and <out>/skinny_table.json: per shape the fastest skinny config
per M and `max_m`, the largest M up to which the skinny kernel beat cuBLAS at every M (0: cuBLAS
everywhere). Point LINRNN_SKINNY_TABLE at that file to use it (kernels/gemv/config.py).

    python -m linrnn_bench.kernels.gemv --out benchmarks/results/kernels/gemv
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import torch
import torch.nn.functional as F


def model_shapes(cfg) -> list[tuple[str, int, int, str]]:
    """(name, weight rows, K, epilogue) of the dense projections of one decode step."""
    H = cfg.hidden_size
    out = [("gdn.in_proj", cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads, H, "none"),
           ("gdn.out_proj", H, cfg.value_dim, "none"),
           ("attn.qkv_proj", cfg.num_attention_heads * cfg.head_dim * 2 + 2 * cfg.num_key_value_heads * cfg.head_dim,
            H, "none"),
           ("attn.o_proj", H, cfg.num_attention_heads * cfg.head_dim, "none")]
    if cfg.shared_expert_intermediate_size:
        I = cfg.shared_expert_intermediate_size
        out += [("shared.gate_up (silu_mul)", 2 * I, H, "silu_mul"), ("shared.down", H, I, "none")]
    out += [("router + shared gate", cfg.num_experts + (1 if cfg.shared_expert_intermediate_size else 0), H, "none"),
            ("lm_head", cfg.vocab_size, H, "none")]
    return out


def _candidates(base):
    from linrnn_kernels.gemv.config import SkinnyConfig

    seen, out = set(), []
    for c in (base, dataclasses.replace(base, split_k=max(1, base.split_k // 2)),
              dataclasses.replace(base, split_k=min(16, base.split_k * 2)),
              dataclasses.replace(base, block_n=base.block_n * 2),
              dataclasses.replace(base, block_k=256 if base.block_k == 128 else 128)):
        if isinstance(c, SkinnyConfig) and c not in seen:
            seen.add(c)
            out.append(c)
    return out


def run(args) -> dict:
    from linrnn_bench.kernels.common import env_info, time_graph
    from linrnn_kernels.gemv import config as gcfg
    from linrnn_kernels.gemv import skinny
    from linrnn_kernels.quant import WeightTensor
    from linrnn_serve.presets import resolve_model

    dev = torch.device("cuda")
    cfg = resolve_model(args.model, "dummy").cfg
    ms = [int(v) for v in args.m.split(",")]
    rows, table = [], {}
    t_end = time.time() + args.max_seconds
    for name, n_rows, K, epi in model_shapes(cfg):
        n_out = n_rows // 2 if epi == "silu_mul" else n_rows
        wbytes = n_rows * K * 2
        copies = max(1, min(16, (256 << 20) // wbytes))
        ws = [WeightTensor("dense", torch.randn(n_rows, K, device=dev, dtype=torch.bfloat16) / K ** 0.5)
              for _ in range(copies)]
        entry: dict = {}
        wins_upto, still_winning = 0, True
        for M in ms:
            x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
            t_cublas = time_graph([lambda w=w: F.linear(x, w.data) for w in ws], iters=args.iters)
            base = gcfg.skinny_config(M, n_out, K, "dense", dev)
            best = None
            for c in (_candidates(base) if time.time() < t_end else [base]):
                try:
                    y = skinny.skinny_linear(x, ws[0], c, epilogue=epi)
                    ref = F.linear(x.float(), ws[0].data.float())
                    if epi == "silu_mul":
                        ref = F.silu(ref[:, :n_out]) * ref[:, n_out:]
                    err = ((y.float() - ref).norm() / ref.norm()).item()
                    if not err < 2e-2:
                        print(f"{name} M={M} {c}: rel err {err:.3g}: not timed", flush=True)
                        continue
                    t = time_graph([lambda w=w: skinny.skinny_linear(x, w, c, epilogue=epi) for w in ws],
                                   iters=args.iters)
                except Exception as e:  # a config that does not compile / fit: report, keep going
                    print(f"{name} M={M} {c}: {type(e).__name__}: {e}", flush=True)
                    continue
                if best is None or t < best[0]:
                    best = (t, c)
            if best is None:
                still_winning = False
                continue
            t_sk, c = best
            gbs = lambda t: wbytes / (t * 1e-3) / 1e9  # noqa: E731
            rows.append({"shape": name, "N": n_rows, "K": K, "M": M, "cublas_us": 1e3 * t_cublas,
                         "skinny_us": 1e3 * t_sk, "speedup": t_cublas / t_sk, "cublas_GBs": gbs(t_cublas),
                         "skinny_GBs": gbs(t_sk), "default_config": base.astuple(), "best_config": c.astuple()})
            print(f"{name:28s} M={M:2d}  cuBLAS {1e3 * t_cublas:8.1f} us  skinny {1e3 * t_sk:8.1f} us  "
                  f"{t_cublas / t_sk:5.2f}x  ({gbs(t_sk):6.0f} GB/s)  {c.astuple()}", flush=True)
            entry[str(M)] = c.astuple()
            if still_winning and t_sk < t_cublas:
                wins_upto = M
            else:
                still_winning = False
        entry["max_m"] = wins_upto
        table[f"{n_out},{K},dense"] = entry
        del ws
        torch.cuda.empty_cache()
    res = {"env": env_info(model=args.model), "rows": rows, "table": table}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gemv.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "skinny_table.json"), "w") as f:
        json.dump(table, f, indent=1)
    lines = [f"# Skinny GEMM vs cuBLAS ({res['env'].get('gpu')}, {res['env'].get('commit', '')[:10]})", "",
             "| shape | N | K | M | cuBLAS us | skinny us | speedup | cuBLAS GB/s | skinny GB/s | config |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {r['N']} | {r['K']} | {r['M']} | {r['cublas_us']:.1f} | {r['skinny_us']:.1f} | "
                     f"{r['speedup']:.2f}x | {r['cublas_GBs']:.0f} | {r['skinny_GBs']:.0f} | {r['best_config']} |")
    lines += ["", "max_m per shape (skinny used up to this M): " +
              ", ".join(f"{k}: {v['max_m']}" for k, v in table.items())]
    with open(os.path.join(args.out, "gemv.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen35moe-nvfp4")
    p.add_argument("--m", default="1,2,4,8,16,32")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--max-seconds", type=float, default=150, help="stop sweeping configs after this long")
    p.add_argument("--out", default="benchmarks/results/kernels/gemv")
    run(p.parse_args(argv))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
