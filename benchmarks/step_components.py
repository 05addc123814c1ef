"""Per-component table of a profiled decode step: measured ms per step, bytes-floor ms, efficiency.

Reads the batched.json of `bench batched --profile ...` (its profile kernel lists, model_bytes and copy
bandwidth) and groups the kernels of each profiled step by the bytes they must move (floor.py's parts):
  dense projections   skinny GEMM / cuBLAS / fused router kernels     floor: non-expert weights (lm_head incl.)
  routed experts      NVFP4 / grouped GEMMs, their reduces, alignment floor: experts touched
  GDN state           recurrent decode + causal conv                  floor: recurrent + conv state read + write
  attention           paged decode, merge, q/k norm + RoPE + KV write floor: KV cache read
  other               norms, elementwise, routing, sampling, copies   floor: ~0 (counted as 0)
The kernel list must be complete (`--profile-top` large enough); kernels past it land in "unlisted".

    python -m linrnn_bench.step_components path/to/batched.json [--out components.md]
"""
from __future__ import annotations

import argparse
import json
import re

COMPONENTS = [
    ("dense projections", r"skinny|nvjet|gemv|cutlass|splitKreduce|_router_kernel|gemm_kernel<|sm90_xmma|ampere_"),
    ("routed experts", r"nvfp4|_gemm_kernel|silu_mul_reduce|_sum_reduce|_align_kernel|dequant|grouped"),
    ("GDN state", r"_gdn_decode|_conv1d"),
    ("attention", r"_decode_kernel|_merge_kernel|_qk_norm_rope|_kv_write|write_kv|_paged"),
]
FLOOR_PART = {"dense projections": ("weights",), "routed experts": ("experts",), "GDN state": ("state", "conv"),
              "attention": ("kv",)}


def component(name: str) -> str:
    for comp, pat in COMPONENTS:
        if re.search(pat, name):
            return comp
    return "other"


def table(res: dict, prof: dict, context: float, bw_gbs: float) -> list[str]:
    from linrnn_bench.floor import ModelBytes

    mb = ModelBytes(**res["model_bytes"])
    parts = mb.step_bytes(prof["B"], context)
    steps = prof["steps"]
    ms: dict[str, float] = {}
    for r in prof["top"]:
        c = component(r["name"])
        ms[c] = ms.get(c, 0.0) + r["total_us"] / steps / 1e3
    listed = sum(ms.values())
    summed = prof.get("summed_ms_per_step", prof["busy_ms_per_step"])  # durations (overlap under PDL)
    if summed - listed > 1e-3:
        ms["unlisted"] = summed - listed
    lines = [f"B={prof['B']} (context {context:.0f}): kernel time {prof['busy_ms_per_step']:.3f} ms/step, wall "
             f"{prof['wall_ms_per_step']:.3f} ms/step, {prof.get('launches_per_step', 0):.0f} launches/step",
             "", "| component | measured ms/step | bytes-floor ms/step | efficiency |", "|---|---:|---:|---:|"]
    tot_floor = 0.0
    for comp in [c for c, _ in COMPONENTS] + ["other", "unlisted"]:
        if comp not in ms:
            continue
        floor = sum(parts[p] for p in FLOOR_PART.get(comp, ())) / (bw_gbs * 1e9) * 1e3
        tot_floor += floor
        eff = f"{100 * floor / ms[comp]:.0f} %" if floor else "-"
        lines.append(f"| {comp} | {ms[comp]:.3f} | {floor:.3f} | {eff} |")
    lines.append(f"| **step (kernels)** | {prof['busy_ms_per_step']:.3f} | {tot_floor:.3f} | "
                 f"{100 * tot_floor / prof['busy_ms_per_step']:.0f} % |")
    lines.append(f"| **step (wall)** | {prof['wall_ms_per_step']:.3f} | {tot_floor:.3f} | "
                 f"{100 * tot_floor / prof['wall_ms_per_step']:.0f} % |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("batched_json")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    d = json.load(open(args.batched_json))
    bw = d["copy_bandwidth_Bps"] / 1e9
    lines = []
    for res in d["configs"]:
        label = res.get("label", "")
        ctx = {r["B"]: r.get("floor_context", r["PP"] + r["TG"] / 2) for r in res.get("rows") or []}
        for prof in res.get("profile") or []:
            context = ctx.get(prof["B"], 192)
            lines += [f"## {label}", ""] + table(res, prof, context, bw) + [""]
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
