"""GDN decode, blocked state layout experiment (issue #15 item 4, bf16_round3): per head [Dv / W, Dk, W]
instead of [Dk, Dv], so a [Dk, W] tile (W bf16 / f32 columns) is one contiguous run.

kernels/gdn/decode_blocked.py is the decode kernel with only the state addressing changed (DecodeConfig.block = W,
0 = the [Dk, Dv] layout) plus an optional 8-element (16-byte) bf16 access (bf16_vec). One run:
  (1) correctness at 0 / 50 / 100 % f32 heads, B = 1, 8, 64, 256: the blocked kernel on pools converted to the
      blocked layout (unused slots NaN-poisoned) vs the naive reference (converted back), and vs the current
      kernel (linrnn_kernels.gdn.decode) on the [Dk, Dv] pools: outputs and both partitions bit for bit;
  (2) timing (CUDA-graph replays, state slots rotated over >= 256 MB, two interleaved passes, copy bandwidth of
      the same run): all-bf16 / 50 % f32 / all-f32 at B in --batches for each variant.
    python tools/gdn_blocked_probe.py --out DIR
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info, time_graph
from linrnn_bench.kernels.gdn import (
    DEVICE, DK, DV, HV, decode_bytes, head_mask, make_pools, make_step_inputs, rel, rotation_sets,
)

EF = "evict_first"


def to_blocked(x: torch.Tensor, w: int) -> torch.Tensor:
    """[S, H, Dk, Dv] -> the same states stored [S, H, Dv / w, Dk, w], viewed as [S, H, Dk, Dv]."""
    if w == 0:
        return x.clone()
    S, H, dk, dv = x.shape
    return x.view(S, H, dk, dv // w, w).permute(0, 1, 3, 2, 4).contiguous().view(S, H, dk, dv)


def from_blocked(x: torch.Tensor, w: int) -> torch.Tensor:
    if w == 0:
        return x.clone()
    S, H, dk, dv = x.shape
    return x.view(S, H, dv // w, dk, w).permute(0, 1, 3, 2, 4).reshape(S, H, dk, dv)


def variants(block_widths):
    """name -> (module, DecodeConfig tuple or None = the module's decode_config with `block` set)."""
    out = {"old [Dk,Dv]": ("decode", None, 0, 4)}
    for w in block_widths:
        out[f"blocked {w}"] = ("decode_blocked", None, w, 4)
    out["blocked 64, bf16 vec8"] = ("decode_blocked", None, 64, 8)
    out["blocked 16, bf16 vec8"] = ("decode_blocked", None, 16, 8)
    return out


def config(mod, cfg, w, vec, B):
    import importlib

    m = importlib.import_module(f"linrnn_kernels.gdn.{mod}")
    c = cfg or m.decode_config(B, HV, DK, DV, torch.device(DEVICE))
    if mod == "decode":
        return m, tuple(c)
    return m, m.DecodeConfig(*c[:6], block=w, bf16_vec=vec)


def correctness(vs) -> list[str]:
    from linrnn_kernels.gdn import decode, naive

    out = []
    for name, (mod, cfg, w, vec) in vs.items():
        if mod == "decode":
            continue
        for f in (0.0, 0.5, 1.0):
            for B in (1, 8, 64, 256) if name == "blocked 64" else (8, 64):
                if vec != 4 and f == 1.0:
                    continue
                m, c = config(mod, cfg, w, vec, B)
                q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, seed=B + 1)
                f32, bf, isb, loc = make_pools(head_mask(f, seed=B), B + 3)
                idx = (torch.randperm(B + 2, device=DEVICE)[:B] + 1).to(torch.int32)
                dead = sorted(set(range(B + 3)) - set(idx.tolist()))
                f32[dead], bf[dead] = float("nan"), float("nan")
                f_ref, b_ref, f_old, b_old = f32.clone(), bf.clone(), f32.clone(), bf.clone()
                o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_ref, b_ref, isb, loc, idx)
                o_old = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_old, b_old, isb, loc, idx,
                                          config=tuple(c[:4]))
                fb, bb = to_blocked(f32, w), to_blocked(bf, w)
                o = m.gdn_decode(q, k, v, a, b, A_log, dt_bias, fb, bb, isb, loc, idx, config=c)
                f32, bf = from_blocked(fb, w), from_blocked(bb, w)
                live = idx.long()
                e = (rel(o, o_ref), rel(f32[live], f_ref[live]) if f32.shape[1] else 0.0,
                     rel(bf[live], b_ref[live]) if bf.shape[1] else 0.0)
                untouched = bool(torch.isnan(f32[dead]).all() and torch.isnan(bf[dead].float()).all())
                ok = e[0] <= 1e-2 and e[1] <= 1e-5 and e[2] <= 1e-2 and untouched
                same = (torch.equal(o.view(torch.int16), o_old.view(torch.int16))
                        and torch.equal(f32.view(torch.int32), f_old.view(torch.int32))
                        and torch.equal(bf.view(torch.int16), b_old.view(torch.int16)))
                diff = ""
                if not same:
                    d_bf = (bf[live].float() - b_old[live].float()).abs().max().item() if bf.shape[1] else 0.0
                    d_f = (f32[live] - f_old[live]).abs().max().item() if f32.shape[1] else 0.0
                    diff = f" max |new - old|: o {(o.float() - o_old.float()).abs().max().item():.2e} f32 {d_f:.2e} bf16 {d_bf:.2e}"
                line = (f"{'ok' if ok else 'FAIL'} {name} {tuple(c)} f32 heads {f:.0%} B={B}: vs naive rel o/f32/bf16 "
                        f"{e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e}, dead slots untouched={untouched}; == current kernel "
                        f"bit for bit: {same}{diff}")
                print(line, flush=True)
                out.append(line)
    return out


def timed(m, c, B: int, f: float, iters: int) -> float:
    mask = head_mask(f)
    sets, slots = rotation_sets(B, decode_bytes(B, mask))
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
    f32, bf, isb, loc = make_pools(mask, slots)
    ms = time_graph([lambda s=s: m.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, s, config=c)
                     for s in sets], iters)
    del f32, bf
    return ms * 1e3


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="64,128,256,1,8,32")
    p.add_argument("--blocks", default="64,16")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", default="scratch/blocked")
    p.add_argument("--no-check", action="store_true")
    args = p.parse_args()
    vs = variants([int(x) for x in args.blocks.split(",")])
    res = {"env": env_info(), "variants": {n: list(v) for n, v in vs.items()}, "rows": []}
    os.makedirs(args.out, exist_ok=True)
    if not args.no_check:
        res["checks"] = correctness(vs)
    res["copy_gbs"] = copy = copy_bandwidth_gbs("cuda")
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    for B in [int(x) for x in args.batches.split(",")]:
        for f in (0.0, 0.5, 1.0):
            nbytes = decode_bytes(B, head_mask(f))
            row = {"B": B, "f32_fraction": f, "bytes": nbytes, "us": {}, "config": {}}
            for _ in range(2):
                for n, (mod, cfg, w, vec) in vs.items():
                    if f == 1.0 and vec != 4:
                        continue  # no bf16 heads: the same kernel as vec 4
                    m, c = config(mod, cfg, w, vec, B)
                    row["config"][n] = list(c)
                    row["us"].setdefault(n, []).append(timed(m, c, B, f, args.iters))
            res["rows"].append(row)
            ideal = nbytes / (copy * 1e3)
            print(f"\nB={B} f32 heads {f:.0%}: ideal {ideal:.1f} us", flush=True)
            for n, ts in row["us"].items():
                print(f"  {n:28s} {str(row['config'][n][:2]):9s} {' / '.join(f'{t:6.1f}' for t in ts)} us  "
                      f"{100 * ideal / min(ts):5.1f} % copy", flush=True)
            with open(os.path.join(args.out, "gdn_blocked_probe.json"), "w") as fh:  # a timeout keeps the rows
                json.dump(res, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
