"""GDN decode, bf16 state partition rounds 5-6 (issue #15 item 4): kernels/gdn/decode.py ("new") against the kernel
on main before the round (kernels/gdn/decode_main.py, placed there by tools/gpu_gdn_r5.sh / gpu_gdn_r6.sh), checked
and then timed in one run (VARIANTS: add DecodeConfig overrides to sweep launch shapes).

  check   every variant vs the naive reference (fresh inputs, unused slots NaN-poisoned and untouched) at
          0 / 50 / 100 % f32 heads, and vs the main kernel bit for bit where it must be (all-f32 always; bf16
          heads too with main's tile shapes)
  bench   us per layer call (CUDA-graph replays, state slots rotated over >= 256 MB: 2 calls per graph at
          B >= 64, as the registry benchmark), better of two interleaved passes, % of the copy bandwidth of
          the same run; B = 64, 128, 256, 32 at 0 / 50 / 100 % f32 heads
  ncu     (--ncu-case NAME,F,B) one eager call of a variant, for Nsight Compute

    python tools/gdn_r5_sweep.py --out DIR
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

import torch

# name: (module, DecodeConfig fields replacing decode_config's, or None for its default). The variants of the
# round-5 sweep (tensor-core bf16 tiles, 8 warps, [Dk, 128], register caps: all measured slower) are kept in
# benchmarks/results/kernels/gdn-decode/bf16_round5/variants/ with the kernel they ran on. Round 6: the L2 prefetch
# of a later program's tile (DecodeConfig.prefetch: distance in waves of resident programs), every state fraction; its
# other distances and the bulk prefetch, all slower, in bf16_round6/variants/.
VARIANTS = {
    "main": ("decode_main", None),
    "new": ("decode", None),
    "pf0.5": ("decode", {"prefetch": 0.5}),
    "pf1": ("decode", {"prefetch": 1}),
}
HYBRID_OK = tuple(VARIANTS)


def call(name, q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx):
    mod, over = VARIANTS[name]
    m = importlib.import_module(f"linrnn_kernels.gdn.{mod}")
    cfg = None
    if over is not None:
        B, Hv, Dk, Dv = q.shape[0], v.shape[1], q.shape[2], v.shape[2]
        cfg = m.decode_config(B, Hv, Dk, Dv, q.device)._replace(**over)
    return m.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)


def check(names) -> list[str]:
    from linrnn_bench.kernels.gdn import DEVICE, head_mask, make_pools, make_step_inputs, rel
    from linrnn_kernels.gdn import naive

    bad = []
    for name in names:
        cases = [(0.0, 64, torch.bfloat16), (0.0, 8, torch.float32), (0.5, 64, torch.float32), (1.0, 8, torch.bfloat16)]
        for f, B, dtype in cases:
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, dtype=dtype, seed=B + 3)
            slots = B + 3
            f32, bf, isb, loc = make_pools(head_mask(f, seed=B), slots)
            idx = (torch.randperm(slots - 1, device=DEVICE)[:B] + 1).to(torch.int32)
            dead = sorted(set(range(slots)) - set(idx.tolist()))
            f32[dead], bf[dead] = float("nan"), float("nan")
            fr, br, fm, bm = f32.clone(), bf.clone(), f32.clone(), bf.clone()
            o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, fr, br, isb, loc, idx)
            o_main = call("main", q, k, v, a, b, A_log, dt_bias, fm, bm, isb, loc, idx)
            o = call(name, q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx)
            live = idx.long()
            e = (rel(o, o_ref), rel(f32[live], fr[live]) if f32.shape[1] else 0.0,
                 rel(bf[live], br[live]) if bf.shape[1] else 0.0)
            untouched = bool(torch.isnan(f32[dead]).all() and torch.isnan(bf[dead].float()).all())
            f32_same = torch.equal(f32.view(torch.int32), fm.view(torch.int32))
            ov = torch.int16 if o.dtype == torch.bfloat16 else torch.int32
            same = (torch.equal(o.view(ov), o_main.view(ov)) and f32_same
                    and torch.equal(bf.view(torch.int16), bm.view(torch.int16)))
            tol_o = 1e-5 if dtype == torch.float32 and f == 1.0 else 1e-2
            # with main's tile shapes every output and state byte equals main's (the same tile code)
            main_tiles = not {"bv", "num_warps"} & set(VARIANTS[name][1] or {})
            ok = (e[0] <= tol_o and e[1] <= 1e-5 and e[2] <= 1e-2 and untouched and (f32_same or not main_tiles)
                  and (same or not main_tiles))
            print(f"{'ok' if ok else 'FAIL'} {name} f32={f:.0%} B={B} act={str(dtype)[6:]}: vs naive o/f32/bf16 "
                  f"{e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e} untouched={untouched}; f32 partition == main: {f32_same}; "
                  f"all == main: {same}", flush=True)
            if not ok:
                bad.append(name)
    return bad


def bench(names, batches, fractions, iters, out) -> list[dict]:
    from linrnn_bench.kernels.common import copy_bandwidth_gbs, time_graph
    from linrnn_bench.kernels.gdn import decode_bytes, head_mask, make_pools, make_step_inputs, rotation_sets

    copy = copy_bandwidth_gbs("cuda")
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for f in fractions:
        for B in batches:
            mask = head_mask(f)
            nbytes = decode_bytes(B, mask)
            sets, slots = rotation_sets(B, nbytes)
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
            f32, bf, isb, loc = make_pools(mask, slots)
            # capped registers only matter for bf16-only launches (a hybrid launch spills its f32 tiles); the
            # bf16 options leave an all-f32 launch's kernel unchanged
            run = [n for n in names if f == 0.0 or n in HYBRID_OK]
            run += [n + " queued" for n in ("main", "new") if n in names and f != 0.5]
            for _pass in range(2):  # better of two interleaved passes
                for name in run:
                    base = name.removesuffix(" queued")
                    fn = [lambda s=s, n=base: call(n, q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, s)
                          for s in sets]
                    try:
                        us = time_graph(fn, iters, queued=name != base) * 1e3
                    except Exception as e:  # noqa: BLE001 - a variant that does not run is reported
                        print(f"ERROR {name} B={B} f32={f}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    pct = 100 * nbytes / (us * 1e-6) / 1e9 / copy
                    row = next((r for r in rows if r["label"] == name and r["B"] == B and r["f"] == f), None)
                    if row is None:
                        rows.append(dict(label=name, B=B, f=f, us=us, pct=pct))
                    elif us < row["us"]:
                        row.update(us=us, pct=pct)
            for r in rows:
                if r["B"] == B and r["f"] == f:
                    print(f"f32={f:.0%} B={B} {r['label']:16s} {r['us']:7.1f} us {r['pct']:5.1f} %", flush=True)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "r5_sweep.json"), "w") as fh:
                json.dump(dict(copy_gbs=copy, rows=rows), fh, indent=1)
    return rows


def ncu_case(spec: str) -> None:
    """Three eager calls per (variant, f32 fraction, B) (the first compiles), for ncu -k regex:_gdn_decode_kernel."""
    from linrnn_bench.kernels.gdn import head_mask, make_pools, make_step_inputs

    for case in spec.split(";"):
        name, f, B = case.split(",")
        f, B = float(f), int(B)
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
        f32, bf, isb, loc = make_pools(head_mask(f), B + 1)
        idx = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
        for _ in range(3):
            call(name, q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx)
        torch.cuda.synchronize()
        print("ncu case", name, f, B, file=sys.stderr, flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="64,128,256,32")
    p.add_argument("--fractions", default="0.0,0.5,1.0")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--ncu-case", default="", help="'name,f,B;...': eager calls for Nsight Compute, nothing else")
    p.add_argument("--out", default="/tmp/out/r5")
    args = p.parse_args()
    if args.ncu_case:
        ncu_case(args.ncu_case)
        return
    names = [n for n in args.variants.split(",") if n]
    if not args.no_check:
        bad = set(check([n for n in names if n != "main"]))  # noqa: C401
        names = [n for n in names if n not in bad]
    bench(names, [int(x) for x in args.batches.split(",")], [float(x) for x in args.fractions.split(",")],
          args.iters, args.out)


if __name__ == "__main__":
    sys.exit(main())
