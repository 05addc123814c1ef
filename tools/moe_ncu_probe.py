"""Eager NVFP4 MoE expert calls for Nsight Compute (issue #13): the MMA kernel's gate_up and down launches at
35B-A3B shapes (realistic routing, PDL off), at the batch sizes of argv[1]. Run under
`ncu -k regex:_nvfp4_mma_kernel`; each batch size is two calls (4 launches: gate_up, down, gate_up, down), the
"ncu case B" line on stderr after them. Extra candidate keywords of moe_experts_mma as argv[2] (JSON)."""
import json
import os
import sys

import torch

os.environ["LINRNN_MMA_PDL"] = "0"

from linrnn_bench.kernels import moe as bench  # noqa: E402
from linrnn_kernels.moe import experts, router  # noqa: E402

shape = bench.QWEN35
E, k, H = shape["E"], shape["k"], shape["H"]
s = bench.make_set(shape, {"nvfp4"}, torch.device("cuda"), 0)
w13, w2 = bench.with_packed(s[("nvfp4", "w13")], s[("nvfp4", "w2")])
kw = json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
for B in map(int, sys.argv[1].split(",")):
    x = torch.randn(B, H, device="cuda").bfloat16()
    topw, ids = router.route(x.float() @ s["router"].t(), k, True, weight_dtype=x.dtype)
    experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, **kw)  # compile outside the profiled range
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for _ in range(2):
        experts.moe_experts_mma(x, topw, ids, w13.packed, w2.packed, **kw)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("ncu case", B, json.dumps(kw), file=sys.stderr, flush=True)
