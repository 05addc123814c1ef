"""One table from tools/gpu_tp.sh's results: per tensor-parallel `bench batched` row, S_TG, the
communication time per decode step (share of the eager step), the mean collective size, and the
engine's all-reduce bus bandwidth beside the NCCL probe's bus bandwidth at the nearest message size
(tools/nccl_probe.py, the same 2 GPUs).

    python -m tools.tp_comm_summary BATCHED_JSON NCCL_PROBE_JSON
"""
from __future__ import annotations

import json
import sys


def main(argv=None) -> int:
    a = sys.argv[1:] if argv is None else argv
    with open(a[0]) as f:
        batched = json.load(f)
    probe = []
    try:
        with open(a[1]) as f:
            probe = json.load(f).get("all_reduce", [])
    except (OSError, ValueError):
        pass
    print("| config | B | S_TG tok/s | ms/step | comm ms/step (eager) | comm share | mean collective KB | "
          "engine all-reduce busbw GB/s | NCCL probe busbw GB/s (at bytes) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for c in batched.get("configs", []):
        for r in c.get("rows", []):
            if "comm_ms_per_step" not in r:
                print(f"| {c['label']} | {r['B']} | {r['S_TG']:.1f} | {r['ms_per_step']:.3f} | - | - | - | - | - |")
                continue
            size = r["comm_bytes_per_step"] / max(r["comm_calls_per_step"], 1)
            near = min(probe, key=lambda p: abs(p["bytes"] - size)) if probe else None
            ref = f"{near['busbw_GBs']:.1f} ({near['bytes']})" if near else "-"
            print(f"| {c['label']} | {r['B']} | {r['S_TG']:.1f} | {r['ms_per_step']:.3f} | "
                  f"{r['comm_ms_per_step']:.3f} | {r['comm_ms_per_step'] / r['comm_eager_ms_per_step']:.0%} | "
                  f"{size / 1e3:.1f} | {r['allreduce_busbw_GBs']:.2f} | {ref} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
