"""The MoE layer benchmark (benchmarks/kernels/moe.py) with an extra variant `nvfp4/wgmma-old`: the prefill wgmma path
as another commit had it (its kernels/moe/nvfp4_wgmma.py, experts.py and, if there, align.py, from OLD_DIR), so the old and the new kernel
are timed in one process on the same weights, inputs and reference.

    OLD_DIR=/path/with/kernels/moe python tools/gpu_wgmma_overlay.py --batch-sizes 512,2048 \
        --variants nvfp4/wgmma-old,nvfp4/wgmma --out $OUT/moe
tools/gpu_moe_prefill.sh (OVERLAY=1) writes OLD_DIR from `git show main:...` on this machine and copies it over.
"""
from __future__ import annotations

import importlib.util
import os
import sys


def _load(name: str, path: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    from linrnn_bench.kernels import moe

    old = os.environ["OLD_DIR"]
    old_wgmma = _load("linrnn_kernels.moe.nvfp4_wgmma_old", os.path.join(old, "kernels/moe/nvfp4_wgmma.py"))
    old_experts = _load("linrnn_kernels.moe.experts_old", os.path.join(old, "kernels/moe/experts.py"))
    old_experts.nvfp4_wgmma = old_wgmma  # its moe_experts_wgmma launches the old kernel
    if os.path.exists(os.path.join(old, "kernels/moe/align.py")):  # and aligns with the old alignment
        old_align = _load("linrnn_kernels.moe.align_old", os.path.join(old, "kernels/moe/align.py"))
        old_experts.moe_align_block_size = old_align.moe_align_block_size

    def old_path(logits, x, top_k, w13, w2):
        topw, ids = moe.router.route(logits, top_k, True)
        a, b = moe.with_packed(w13, w2)
        return old_experts.moe_experts_wgmma(x, topw.to(x.dtype), ids, a.packed, b.packed)

    moe.VARIANTS["nvfp4/wgmma-old"] = ("nvfp4", old_path)
    return moe.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
