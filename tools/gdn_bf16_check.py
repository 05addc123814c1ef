"""GDN decode / prefill, blocked bf16 state layout (issue #15, bf16_round3): the kernels vs the naive reference and
vs the kernels before the layout change, on the GPU.

The kernels before (benchmarks/results/kernels/gdn-decode/bf16_round3/variants/*_before.py.txt) are placed beside
the current ones as linrnn_kernels.gdn.decode_main / prefill_main / common_main (tools/gpu_gdn_bf16.sh does it);
they read the bf16 partition as [Dk, Dv] per head, so they get the same states in that layout and their bf16
partition is converted back before comparing. For every decode config in --configs (DecodeConfig tuples, python
literal; None = decode_config's choice) at each fraction of f32 heads and B, and for prefill (default config)
at each fraction: (1) vs the naive reference on fresh inputs with the unused slots NaN-poisoned (they must stay
NaN), o / f32 / bf16 relative errors; (2) vs the old kernel with the same tile / hints on identical inputs:
outputs and both partitions bit for bit (only addresses changed), or the largest difference.
    python tools/gdn_bf16_check.py --configs "[None, (64, 4, 'evict_first', 'evict_first')]"
"""
from __future__ import annotations

import argparse
import ast

import torch

from linrnn_bench.kernels.gdn import DEVICE, head_mask, make_pools, make_step_inputs, rel


def as_old_layout(bf: torch.Tensor) -> torch.Tensor:
    """The blocked bf16 partition's states in the [Dk, Dv] memory order the old kernels read (shape kept, so the
    current check_pools accepts it: the old decode kernel imports it)."""
    from linrnn_kernels.gdn.layout import from_bf16_blocked

    return from_bf16_blocked(bf).contiguous().view(bf.shape)


def from_old_layout(bf_old: torch.Tensor) -> torch.Tensor:
    from linrnn_kernels.gdn.layout import to_bf16_blocked

    S, H, nb, dk, w = bf_old.shape
    return to_bf16_blocked(bf_old.view(S, H, dk, nb * w))


def compare(label, o, f32, bf, o_ref, f_ref, b_ref, o_old, f_old, b_old, live, dead, tol_f32=1e-5) -> None:
    e = (rel(o, o_ref), rel(f32[live], f_ref[live]) if f32.shape[1] else 0.0,
         rel(bf[live], b_ref[live]) if bf.shape[1] else 0.0)
    untouched = bool(torch.isnan(f32[dead]).all() and torch.isnan(bf[dead].float()).all())
    ok = e[0] <= 1e-2 and e[1] <= tol_f32 and e[2] <= 1e-2 and untouched
    same = (torch.equal(o.view(torch.int16), o_old.view(torch.int16))
            and torch.equal(f32.view(torch.int32), f_old.view(torch.int32))
            and torch.equal(bf.view(torch.int16), b_old.view(torch.int16)))
    diff = ""
    if not same:
        d_bf = (bf[live].float() - b_old[live].float()).abs().max().item() if bf.shape[1] else 0.0
        diff = (f" max |new - old|: o {(o.float() - o_old.float()).abs().max().item():.2e} bf16 {d_bf:.2e}"
                f" (rel o {rel(o, o_old):.1e}, bf16 {rel(bf[live], b_old[live]) if bf.shape[1] else 0:.1e})")
    print(f"{'ok' if ok else 'FAIL'} {label}: vs naive rel o/f32/bf16 {e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e}, dead slots "
          f"untouched={untouched}; == old kernel bit for bit: {same}{diff}", flush=True)


def poisoned_pools(f: float, B: int, slots: int):
    f32, bf, isb, loc = make_pools(head_mask(f, seed=B), slots)
    idx = (torch.randperm(slots - 1, device=DEVICE)[:B] + 1).to(torch.int32)
    dead = sorted(set(range(slots)) - set(idx.tolist()))
    f32[dead], bf[dead] = float("nan"), float("nan")
    return f32, bf, isb, loc, idx, dead


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--configs", default="[None]")
    p.add_argument("--fractions", default="0.0,0.5,1.0")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--prefill-lens", default="1,63,64,65,300,0,130")
    args = p.parse_args()
    from linrnn_kernels.gdn import decode, decode_main, naive, prefill, prefill_main

    fractions = [float(x) for x in args.fractions.split(",")]
    for cfg in ast.literal_eval(args.configs):
        for f in fractions:
            for B in [int(x) for x in args.batches.split(",")]:
                q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, seed=B + 1)
                f32, bf, isb, loc, idx, dead = poisoned_pools(f, B, B + 3)
                f_ref, b_ref, f_old, b_old = f32.clone(), bf.clone(), f32.clone(), as_old_layout(bf)
                o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_ref, b_ref, isb, loc, idx)
                old_cfg = tuple(cfg[:4]) if cfg else None
                o_old = decode_main.gdn_decode(q, k, v, a, b, A_log, dt_bias, f_old, b_old, isb, loc, idx,
                                               config=old_cfg)
                o = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)
                compare(f"decode {cfg} f32 heads {f:.0%} B={B}", o, f32, bf, o_ref, f_ref, b_ref, o_old, f_old,
                        from_old_layout(b_old), idx.long(), dead)
    lens = [int(x) for x in args.prefill_lens.split(",")]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    for f in fractions:
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(sum(lens), seed=7)
        f32, bf, isb, loc, idx, dead = poisoned_pools(f, len(lens), len(lens) + 3)
        f_ref, b_ref, f_old = f32.clone(), bf.clone(), f32.clone()
        b_old = as_old_layout(bf).view(*bf.shape[:2], bf.shape[3], bf.shape[2] * bf.shape[4])  # old: [Dk, Dv]
        o_ref = naive.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, f_ref, b_ref, isb, loc, idx)
        o_old = prefill_main.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, f_old, b_old, isb, loc, idx)
        o = prefill.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, f32, bf, isb, loc, idx)
        compare(f"prefill lens {lens} f32 heads {f:.0%}", o, f32, bf, o_ref, f_ref, b_ref, o_old, f_old,
                from_old_layout(b_old.view(bf.shape)), idx.long(), dead, tol_f32=1e-2)  # bf16 matmul mode


if __name__ == "__main__":
    main()
