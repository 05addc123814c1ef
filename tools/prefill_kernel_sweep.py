"""Prefill kernel launch-config sweeps at Qwen3.5-35B-A3B shapes, per kernel device time (torch profiler, mean
over reps), at the shapes of a prefill step: 64 x 128-token prompts (#14's c = 64 wave) and 16 x 129-token
continuations after 3072 cached tokens (#16's prefix-cache burst).

  gdn        the chunked GDN prefill (kernels/gdn/prefill.py): prefill_config overrides; per kernel wy / state /
             output us; each override changes only the kernel it names
  conv       the varlen causal conv (kernels/gdn/conv.py): CONV_VARLEN_CONFIG overrides, on a row-strided view
             of the in_proj output as in the layer
  attention  the varlen paged prefill attention (kernels/attention/prefill.py) with the output gate: LaunchConfig

Correctness first: each part's default is checked against its naive reference, every override against the
default (relative Frobenius <= 1e-2; GDN also the final state); a failing or non-compiling config is reported
and not timed.

    python tools/prefill_kernel_sweep.py [--parts gdn,conv,attention] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

# (label, prefill_config overrides): one kernel's knobs at a time
GDN_SWEEP = [
    ("default", {}),
    ("wy_warps=1", {"wy_warps": 1}),
    ("wy_warps=4", {"wy_warps": 4}),
    ("state bv32", {"state_bv": 32}),
    ("state bv128 w8", {"state_bv": 128, "state_warps": 8}),
    ("output bv64", {"output_bv": 64}),
    ("output bv128 w8", {"output_bv": 128, "output_warps": 8}),
]
# conv: (bt tokens, bc channels, warps)
CONV_SWEEP = [(32, 128, 4), (64, 128, 4), (64, 256, 8), (128, 128, 8), (16, 256, 4), (32, 256, 4), (128, 64, 4),
              (64, 64, 2)]
# attention: (block_m rows = tokens x 8 heads, block_n keys, warps, stages)
ATTN_SWEEP = [(64, 32, 4, 3), (128, 32, 8, 3), (128, 32, 8, 2), (128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2),
              (64, 16, 4, 4), (32, 32, 4, 3)]
KERNELS = ("wy", "state", "output")


def rel(x, y) -> float:
    x, y = x.float(), y.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def kernel_us(fn, reps: int, pattern: str = r"_chunk_(wy|state|output)", parts=KERNELS) -> dict:
    """Mean device us per call of fn of each kernel whose name matches pattern (group 1 names the part)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {k: 0.0 for k in parts}
    for e in prof.key_averages():
        m = re.search(pattern, e.key)
        if m and e.device_type.name == "CUDA":
            out[m[1]] += e.self_device_time_total / reps
    out["total"] = sum(out[k] for k in parts)
    return out


def sweep_gdn(args, res):
    from linrnn_bench.kernels.gdn import DEVICE, HV, make_pools, make_step_inputs
    from linrnn_kernels.gdn import naive
    from linrnn_kernels.gdn.prefill import gdn_prefill

    for shape in args.gdn_shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        T = B * L
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(T, seed=B)
        f32, bf, isb, loc = make_pools([False] * HV, B + 1)  # all-f32 state (the default tau = inf)
        f32.mul_(0.5)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
        idx = torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE)
        start = f32.clone()

        def run(cfg, pool):
            return gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, pool, bf, isb, loc, idx, config=cfg)

        # default vs naive on the first 4 sequences (the naive recurrence is token by token)
        n4 = min(B, 4)
        p_ref, p_ker = start[: n4 + 1].clone(), start[: n4 + 1].clone()
        o_ref = naive.gdn_prefill(q[: n4 * L], k[: n4 * L], v[: n4 * L], a[: n4 * L], b[: n4 * L], A_log, dt_bias,
                                  cu[: n4 + 1], p_ref, bf[: n4 + 1], isb, loc, idx[:n4])
        o_ker = gdn_prefill(q[: n4 * L], k[: n4 * L], v[: n4 * L], a[: n4 * L], b[: n4 * L], A_log, dt_bias,
                            cu[: n4 + 1], p_ker, bf[: n4 + 1], isb, loc, idx[:n4])
        e_naive = (rel(o_ker, o_ref), rel(p_ker[1:], p_ref[1:]))
        print(f"{shape}: default vs naive (first {n4} sequences) o {e_naive[0]:.2e} state {e_naive[1]:.2e}", flush=True)
        ref_pool = start.clone()
        o_def = run(None, ref_pool)
        print(f"\n| {shape} config | wy us | state us | output us | total us | vs default | err o / state |")
        print("|---|---:|---:|---:|---:|---:|---|")
        base = None
        for label, cfg in GDN_SWEEP:
            row = {"part": "gdn", "shape": shape, "label": label, "config": cfg, "naive_err": e_naive}
            try:
                pool = start.clone()
                o = run(cfg, pool)
                err = (rel(o, o_def), rel(pool[1:], ref_pool[1:]))
                row["err"] = err
                if not (err[0] <= 1e-2 and err[1] <= 1e-2):
                    row["status"] = "FAILED vs default: not timed"
                else:
                    pool = start.clone()
                    row.update(kernel_us(lambda: run(cfg, pool), args.reps))
            except Exception as e:  # noqa: BLE001  (a config that fails to compile is reported, the sweep goes on)
                row["status"] = f"{type(e).__name__}: {e}"[:200]
            res["rows"].append(row)
            if "total" in row:
                base = base or row["total"]
                print(f"| {label} | {row['wy']:.1f} | {row['state']:.1f} | {row['output']:.1f} | {row['total']:.1f} | "
                      f"{row['total'] / base:.3f} | {row['err'][0]:.1e} / {row['err'][1]:.1e} |", flush=True)
            else:
                print(f"| {label} | - | - | - | - | - | {row.get('status')} |", flush=True)
        del q, k, v, a, b, f32, start, ref_pool
        torch.cuda.empty_cache()


def timed_row(row, base, fn, reps, pattern, name):
    try:
        row.update(kernel_us(fn, reps, pattern, (name,)))
    except Exception as e:  # noqa: BLE001
        row["status"] = f"{type(e).__name__}: {e}"[:200]
    return row


def sweep_conv(args, res):
    from linrnn_kernels.gdn import naive
    from linrnn_kernels.gdn.conv import conv1d_varlen
    from linrnn_kernels.gdn.prefill import varlen_plan
    C, K, W = 8192, 4, 12352  # conv_dim, kernel, the in_proj output row (q k v | z | b a)
    for shape in args.conv_shapes.split(","):
        B, L = (int(x) for x in shape.split("x"))
        T = B * L
        x = torch.randn(T, W, device="cuda").to(torch.bfloat16)[:, :C]
        w = (0.5 * torch.randn(C, K, device="cuda")).to(torch.bfloat16)
        state0 = torch.randn(B + 1, K - 1, C, device="cuda").to(torch.bfloat16)
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        idx = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
        sot = varlen_plan(cu, T).seq_of_token
        ref = naive.conv1d_varlen(x, w, state0.clone(), cu, idx)
        print(f"\n| conv {shape} (bt, bc, warps) | us | vs default | err vs naive |")
        print("|---|---:|---:|---|")
        base = None
        for bt, bc, nw in CONV_SWEEP:
            cfg = {"bt": bt, "bc": bc, "warps": nw}
            row = {"part": "conv", "shape": shape, "config": cfg}
            try:
                y = conv1d_varlen(x, w, state0.clone(), cu, idx, seq_of_token=sot, config=cfg)
                row["err"] = rel(y, ref)
                if row["err"] > 1e-2:
                    row["status"] = "FAILED vs naive: not timed"
                else:
                    st = state0.clone()
                    timed_row(row, base, lambda: conv1d_varlen(x, w, st, cu, idx, seq_of_token=sot, config=cfg),
                              args.reps, r"_(conv1d_varlen)_kernel", "conv1d_varlen")
            except Exception as e:  # noqa: BLE001
                row["status"] = f"{type(e).__name__}: {e}"[:200]
            res["rows"].append(row)
            if "total" in row:
                base = base or row["total"]
                print(f"| {bt}, {bc}, {nw} | {row['total']:.1f} | {row['total'] / base:.3f} | {row['err']:.1e} |",
                      flush=True)
            else:
                print(f"| {bt}, {bc}, {nw} | - | - | {row.get('status')} |", flush=True)


def sweep_attention(args, res):
    from linrnn_kernels.attention import naive
    from linrnn_kernels.attention.common import LaunchConfig
    from linrnn_kernels.attention.prefill import prefill_attention
    HQ, HKV, D, BS = 16, 2, 256, 16
    for shape in args.attn_shapes.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?", shape)
        B, L, ctx = int(m[1]), int(m[2]), int(m[3] or 0)
        T, nblk = B * L, -(-(ctx + L) // BS)
        kc = torch.randn(1 + B * nblk, BS, HKV, D, device="cuda").to(torch.bfloat16)
        vc = torch.randn_like(kc)
        tables = (torch.randperm(B * nblk, device="cuda").int() + 1).view(B, nblk)
        q = torch.randn(T, HQ, D, device="cuda").to(torch.bfloat16)
        gate = torch.randn(T, HQ, 2 * D, device="cuda").to(torch.bfloat16)[..., D:]
        cu = torch.arange(0, T + 1, L, dtype=torch.int32, device="cuda")
        lens = torch.full((B,), ctx + L, dtype=torch.int32, device="cuda")
        args_ = (q, kc, vc, cu, lens, tables, D ** -0.5)
        ref = naive.paged_attention(*args_, gate=gate)
        print(f"\n| attention {shape} (block_m, block_n, warps, stages) | us | vs default | err vs naive |")
        print("|---|---:|---:|---|")
        base = None
        for bm, bn, nw, ns in ATTN_SWEEP:
            cfg = LaunchConfig(block_n=bn, num_warps=nw, num_stages=ns, block_m=bm)
            row = {"part": "attention", "shape": shape, "config": [bm, bn, nw, ns]}
            try:
                o = prefill_attention(*args_, config=cfg, gate=gate)
                row["err"] = rel(o, ref)
                if row["err"] > 1e-2:
                    row["status"] = "FAILED vs naive: not timed"
                else:
                    timed_row(row, base, lambda: prefill_attention(*args_, config=cfg, gate=gate, out=o), args.reps,
                              r"_(prefill)_kernel", "prefill")
            except Exception as e:  # noqa: BLE001
                row["status"] = f"{type(e).__name__}: {e}"[:200]
            res["rows"].append(row)
            if "total" in row:
                base = base or row["total"]
                print(f"| {bm}, {bn}, {nw}, {ns} | {row['total']:.1f} | {row['total'] / base:.3f} | {row['err']:.1e} |",
                      flush=True)
            else:
                print(f"| {bm}, {bn}, {nw}, {ns} | - | - | {row.get('status')} |", flush=True)
        del kc, vc
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="gdn,conv,attention")
    ap.add_argument("--gdn-shapes", default="64x128,16x129")
    ap.add_argument("--conv-shapes", default="64x128,16x129")
    ap.add_argument("--attn-shapes", default="16x129@3072,64x128")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    res = {"device": torch.cuda.get_device_name(0), "rows": []}
    for part in args.parts.split(","):
        try:
            {"gdn": sweep_gdn, "conv": sweep_conv, "attention": sweep_attention}[part](args, res)
        except Exception as e:  # noqa: BLE001  (one part failing leaves the others' results)
            print(f"{part}: {type(e).__name__}: {e}"[:300], flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
