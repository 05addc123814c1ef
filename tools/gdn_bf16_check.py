"""GDN decode, bf16 partition (issue #15): kernel configs vs the naive reference and vs an old kernel, on the GPU.

For every config in --configs (DecodeConfig tuples, python literal; None = decode_config's choice) at each
fraction of f32 heads and B: (1) against the naive reference on fresh inputs with the unused slots
NaN-poisoned (they must stay NaN), o / f32 / bf16 relative errors; (2) against the old kernel
(linrnn_kernels.gdn.decode_main, e.g. a kernel kept under benchmarks/results/.../variants/ copied there) with
the same tile shape and hints on identical inputs: outputs and both partitions bit for bit, or the largest
difference where they differ.
    python tools/gdn_bf16_check.py --configs "[None, (64, 4, 'evict_first', 'evict_first')]"
"""
from __future__ import annotations

import argparse
import ast

import torch

from linrnn_bench.kernels.gdn import DEVICE, head_mask, make_pools, make_step_inputs, rel


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="[None]")
    p.add_argument("--fractions", default="0.0,0.5,1.0")
    p.add_argument("--batches", default="1,8,64,256")
    args = p.parse_args()
    from linrnn_kernels.gdn import decode, decode_main, naive

    for cfg in ast.literal_eval(args.configs):
        for f in [float(x) for x in args.fractions.split(",")]:
            for B in [int(x) for x in args.batches.split(",")]:
                q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, seed=B + 1)
                f32, bf, isb, loc = make_pools(head_mask(f, seed=B), B + 3)
                idx = (torch.randperm(B + 2, device=DEVICE)[:B] + 1).to(torch.int32)
                dead = sorted(set(range(B + 3)) - set(idx.tolist()))
                f32[dead], bf[dead] = float("nan"), float("nan")
                f_ref, b_ref, f_old, b_old = f32.clone(), bf.clone(), f32.clone(), bf.clone()
                o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_ref, b_ref, isb, loc, idx)
                old_cfg = tuple(cfg[:4]) if cfg else None
                o_old = decode_main.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_old, b_old, isb, loc, idx,
                                               config=old_cfg)
                o = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)
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
                    diff = (f" max |new - old|: o {(o.float() - o_old.float()).abs().max().item():.2e} bf16 {d_bf:.2e}"
                            f" (rel o {rel(o, o_old):.1e}, bf16 {rel(bf[live], b_old[live]) if bf.shape[1] else 0:.1e})")
                print(f"{'ok' if ok else 'FAIL'} {cfg} f32 heads {f:.0%} B={B}: vs naive rel o/f32/bf16 "
                      f"{e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e}, dead slots untouched={untouched}; "
                      f"== old kernel bit for bit: {same}{diff}", flush=True)


if __name__ == "__main__":
    main()
