"""GDN decode, bf16-partition sweep (issue #15 item 4): decode-kernel variants side by side in one run.

Per B and fraction of f32 heads, only the variants that differ there (all-f32 runs the same f32-only
kernel in every new variant); two interleaved passes; a size-matched copy per row. Before timing, each
new variant is checked against the naive reference (B = 64, fresh NaN-poisoned unused slots, 50 % and 0 %
f32) and all-f32 outputs / state of the new kernel must equal the old kernel's bit for bit.
    python tools/gdn_bf16_sweep.py --out DIR   (the old kernel as linrnn_kernels/gdn/decode_main.py)
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info
from linrnn_bench.kernels.gdn import (
    DEVICE, DK, DV, HV, decode_bytes, head_mask, make_pools, make_step_inputs, rel,
)
from linrnn_bench.kernels.gdn_decode_probe import sized_copy_us, timed

EF = "evict_first"


def correctness(variants) -> list[str]:
    import importlib

    from linrnn_kernels.gdn import decode, decode_main, naive

    out = []
    for f in (0.5, 0.0):
        for _, (mod, cfg) in variants:
            fn = importlib.import_module(f"linrnn_kernels.gdn.{mod}").gdn_decode
            for B in (64, 8):
                mask = head_mask(f)
                q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
                f32, bf, isb, loc = make_pools(mask, B + 3)
                idx = (torch.randperm(B + 2, device=DEVICE)[:B] + 1).to(torch.int32)
                dead = sorted(set(range(B + 3)) - set(idx.tolist()))
                f32[dead] = float("nan")
                bf[dead] = float("nan")
                rf, rb = f32.clone(), bf.clone()
                o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, rf, rb, isb, loc, idx)
                o = fn(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)
                live = idx.long()
                e = (rel(o, o_ref), rel(f32[live], rf[live]), rel(bf[live], rb[live]))
                untouched = bool(torch.isnan(f32[dead]).all() and torch.isnan(bf[dead].float()).all())
                ok = e[0] <= 1e-2 and e[1] <= 1e-5 and e[2] <= 1e-2 and untouched
                out.append(f"{'ok' if ok else 'FAIL'} f={f} B={B} {mod} {cfg}: rel o/f32/bf16 {e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e}"
                           f" dead slots untouched={untouched}")
    for B in (1, 8, 64, 256):  # tau = inf: the new kernel's all-f32 bits equal the old kernel's
        mask = head_mask(1.0)
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
        f32, bf, isb, loc = make_pools(mask, B + 1)
        idx = torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE)
        f0, b0 = f32.clone(), bf.clone()
        o_old = decode_main.gdn_decode(q, k, v, a, b, A_log, dt_bias, f0, b0, isb, loc, idx)
        o_new = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx)
        same = torch.equal(o_old.view(torch.int16), o_new.view(torch.int16)) and torch.equal(
            f0.view(torch.int32), f32.view(torch.int32))
        out.append(f"{'ok' if same else 'FAIL'} all-f32 B={B} new == old bit for bit: {same}")
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="128,64,256,32")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", default="scratch/bf16_sweep")
    p.add_argument("--round", type=int, default=1, help="1: slices / split launches; 2: tile shapes and orders")
    args = p.parse_args()
    old = ("decode_main", (64, 4, EF, EF))
    new = {
        "one launch, 1 slice": ("decode", (64, 4, EF, EF, None, 1, 4, False)),
        "split, 1 slice": ("decode", (64, 4, EF, EF, None, 1, 4, True)),
        "split, 1 slice, bf16 maxnreg 80": ("decode", (64, 4, EF, EF, None, 1, 4, True, 80)),
        "split, 2 slices vec8": ("decode", (64, 4, EF, EF, None, 2, 8, True)),
        "split, 2 slices vec8, bf16 maxnreg 128": ("decode", (64, 4, EF, EF, None, 2, 8, True, 128)),
        "split, 2 slices vec4 1 reduction": ("decode_x", (64, 4, EF, EF, None, 2, 4, True)),
        "split, 2 slices vec4 1 reduction, maxnreg 128": ("decode_x", (64, 4, EF, EF, None, 2, 4, True, 128)),
        "one launch, 2 slices vec8": ("decode", (64, 4, EF, EF, None, 2, 8, False)),
    }
    if args.round == 2:
        new = {
            "one launch, 1 slice": ("decode", (64, 4, EF, EF, None, 1, 4, False)),
            "1 slice, no re-widen": ("decode_noremat", (64, 4, EF, EF, None, 1, 4, False)),
            "1 slice vec8": ("decode", (64, 4, EF, EF, None, 1, 8, False)),
            "1 slice vec8, no re-widen": ("decode_noremat", (64, 4, EF, EF, None, 1, 8, False)),
            "split [Dk,128] 8 warps vec8": ("decode", (128, 8, EF, EF, None, 1, 8, True)),
            "split [Dk,32] 2 warps": ("decode", (32, 2, EF, EF, None, 1, 4, True)),
            "split, column block slowest": ("decode_ivslow", (64, 4, EF, EF, None, 1, 4, True)),
            "split, 2 slices vec4 1 reduction": ("decode_x", (64, 4, EF, EF, None, 2, 4, True)),
            "split, 1 slice, no hints": ("decode", (64, 4, "", "", None, 1, 4, True)),
        }
    res = {"env": env_info(), "rows": [], "round": args.round}
    res["checks"] = correctness([(n, c) for n, c in new.items()])
    print("\n".join(res["checks"]), flush=True)
    res["copy_gbs"] = copy = copy_bandwidth_gbs("cuda")
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for B in [int(x) for x in args.batches.split(",")]:
        for f in (0.0, 0.5, 1.0):
            if f == 1.0:
                vs = [("old", old), ("new", new["one launch, 1 slice"])]
            else:
                names = [n for n in new if f == 0.5 or args.round == 2 or not n.startswith("one launch, 2") and "split" in n]
                vs = [("old", old)] + [(n, new[n]) for n in names]
            nbytes = decode_bytes(B, head_mask(f))
            row = {"B": B, "f32_fraction": f, "bytes": nbytes, "copy_us": [], "us": {n: [] for n, _ in vs}}
            for _ in range(2):
                row["copy_us"].append(sized_copy_us(decode_bytes(B, head_mask(1.0)), args.iters))
                for n, (mod, cfg) in vs:
                    row["us"][n].append(timed(mod, B, f, args.iters, cfg))
            res["rows"].append(row)
            ideal = nbytes / (copy * 1e3)
            print(f"\nB={B} f32 {f:.0%}: ideal {ideal:.1f} us; copy {row['copy_us']}", flush=True)
            for n, ts in row["us"].items():
                print(f"  {n:48s} {' / '.join(f'{t:6.1f}' for t in ts)} us  {100 * ideal / min(ts):5.1f} % copy",
                      flush=True)
            os.makedirs(args.out, exist_ok=True)  # after every row: a timeout keeps what was measured
            with open(os.path.join(args.out, "gdn_bf16_sweep.json"), "w") as fh:
                json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
