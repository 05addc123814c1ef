"""GDN chunked prefill launch-config sweep (kernels/gdn/prefill.py) at Qwen3.5-35B-A3B shapes: per-kernel
device time (wy / state / output, torch profiler, mean over reps) for prefill_config overrides, at the
shapes of a prefill step (64 x 128-token prompts; 16 x 129-token continuations from a nonzero state).

Correctness first: the default config is checked against the naive reference on a reduced batch, and every
override against the default config (o and final state, relative Frobenius <= 1e-2); a failing config
is reported and not timed. Each override only changes the kernel it names, so the other two kernels'
times are the default's (compiled once).

    python tools/gdn_prefill_sweep.py [--shapes 64x128,16x129] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import re
import sys

import torch

# (label, prefill_config overrides): one kernel's knobs at a time
SWEEP = [
    ("default", {}),
    ("wy_warps=2", {"wy_warps": 2}),
    ("wy_warps=8", {"wy_warps": 8}),
    ("state bv32", {"state_bv": 32}),
    ("state bv64", {"state_bv": 64}),
    ("state bv128 w8", {"state_bv": 128, "state_warps": 8}),
    ("state bv64 w8", {"state_bv": 64, "state_warps": 8}),
    ("state bv32 w2", {"state_bv": 32, "state_warps": 2}),
    ("state stages1", {"state_stages": 1}),
    ("state stages3", {"state_stages": 3}),
    ("output w8", {"output_warps": 8}),
    ("output bv128 w8", {"output_bv": 128, "output_warps": 8}),
    ("output bv128 w4", {"output_bv": 128, "output_warps": 4}),
]
KERNELS = ("wy", "state", "output")


def rel(x, y) -> float:
    x, y = x.float(), y.float()
    if not torch.isfinite(x).all():
        return float("inf")
    return ((x - y).norm() / y.norm().clamp_min(1e-30)).item()


def kernel_us(fn, reps: int) -> dict:
    """Mean device us per call of each _chunk_* kernel over reps calls of fn."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = {k: 0.0 for k in KERNELS}
    for e in prof.key_averages():
        m = re.search(r"_chunk_(wy|state|output)", e.key)
        if m and e.device_type.name == "CUDA":
            out[m[1]] += e.self_device_time_total / reps
    out["total"] = sum(out[k] for k in KERNELS)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="64x128,16x129")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from linrnn_bench.kernels.gdn import DEVICE, HV, make_pools, make_step_inputs
    from linrnn_kernels.gdn import naive
    from linrnn_kernels.gdn.prefill import gdn_prefill

    res = {"device": torch.cuda.get_device_name(0), "rows": []}
    for shape in args.shapes.split(","):
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
        for label, cfg in SWEEP:
            row = {"shape": shape, "label": label, "config": cfg, "naive_err": e_naive}
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
