"""GDN decode probe (issue #4, the B = 64 bandwidth target): decode-kernel variants side by side in one run.

For B in --batches and each fraction of f32 heads in --fractions: the copy bandwidth of one large buffer
(the benchmark's reference), a size-matched copy (CUDA-graph replays of device-to-device copies moving the
same bytes as one f32 decode call, rotated like the decode calls), and the decode kernel under each
(module, DecodeConfig) variant, in two interleaved passes so the spread between passes shows the noise.
A module other than `decode` is a copy of an older kernel placed beside it (e.g. `git show
REV:kernels/gdn/decode.py > kernels/gdn/decode_rev.py`), so old and new are timed in one run.

    python -m linrnn_bench.kernels.gdn_decode_probe --variants "[('decode', (64, 4, 'evict_first', 'evict_first'))]"
"""
from __future__ import annotations

import argparse
import ast
import importlib
import json
import os

import torch

from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info, time_graph
from linrnn_bench.kernels.gdn import bench_decode, decode_bytes, head_mask, rotation_sets


def sized_copy_us(nbytes: int, iters: int) -> float:
    """us per device-to-device copy moving nbytes (read + write), rotated over >= 256 MB like the decode."""
    sets, _ = rotation_sets(1, nbytes)
    half = nbytes // 2 // 4
    bufs = [(torch.empty(half, device="cuda").uniform_(), torch.empty(half, device="cuda")) for _ in sets]
    return time_graph([lambda s=s, d=d: d.copy_(s) for s, d in bufs], iters) * 1e3


def timed(module: str, B: int, f: float, iters: int, cfg) -> float:
    """bench_decode with gdn_decode taken from linrnn_kernels.gdn.<module>."""
    decode = importlib.import_module("linrnn_kernels.gdn.decode")
    own = decode.gdn_decode
    decode.gdn_decode = importlib.import_module(f"linrnn_kernels.gdn.{module}").gdn_decode
    try:
        r = bench_decode(B, f, iters, config=cfg)
    finally:
        decode.gdn_decode = own
    if "status" in r:
        print(f"B={B} f32={f} {module} {cfg}: {r['status']}", flush=True)
    return r.get("us", float("nan"))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="64,128,256")
    p.add_argument("--fractions", default="1.0")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--variants", required=True, help="python literal list of (module, DecodeConfig tuple)")
    p.add_argument("--out", default="scratch/probe")
    args = p.parse_args()
    variants = ast.literal_eval(args.variants)
    copy = copy_bandwidth_gbs("cuda")
    res = {"env": env_info(), "copy_gbs": copy, "variants": [list(v) for v in variants], "rows": []}
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for B in [int(x) for x in args.batches.split(",")]:
        for f in [float(x) for x in args.fractions.split(",")]:
            nbytes = decode_bytes(B, head_mask(f))
            row = {"B": B, "f32_fraction": f, "bytes": nbytes, "copy_us": [], "us": [[] for _ in variants]}
            for _ in range(2):
                row["copy_us"].append(sized_copy_us(decode_bytes(B, head_mask(1.0)), args.iters))
                for i, (mod, cfg) in enumerate(variants):
                    row["us"][i].append(timed(mod, B, f, args.iters, cfg))
            res["rows"].append(row)
            ideal = nbytes / (copy * 1e3)
            print(f"\nB={B} f32 heads {f:.0%}: {nbytes / 1e6:.1f} MB, ideal {ideal:.1f} us at {copy:.0f} GB/s; "
                  f"size-matched f32 copy {' / '.join(f'{x:.1f}' for x in row['copy_us'])} us", flush=True)
            for (mod, cfg), ts in zip(variants, row["us"]):
                print(f"  {mod:12s} {str(cfg):58s} {' / '.join(f'{t:6.1f}' for t in ts)} us  "
                      f"{100 * ideal / min(ts):5.1f} % copy bw", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gdn_decode_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
