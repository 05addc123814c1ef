"""Eager GDN decode calls for Nsight Compute (issue #15 item 4): old vs new kernel, all-f32 / all-bf16,
B = 128, 35B-A3B heads. Run under `ncu -k regex:_gdn_decode_kernel`; each case is one launch after a warm-up."""
import importlib
import sys

import torch

from linrnn_bench.kernels.gdn import head_mask, make_pools, make_step_inputs

B = 128
EF = "evict_first"
for mod, f, cfg in [("decode_main", 1.0, (64, 4, EF, EF)), ("decode_main", 0.0, (64, 4, EF, EF)),
                    ("decode", 0.0, (64, 4, EF, EF, None, 1, 4)), ("decode_noremat", 0.0, (64, 4, EF, EF, None, 1, 4)),
                    ("decode", 0.0, (128, 8, EF, EF, None, 1, 8))]:
    fn = importlib.import_module(f"linrnn_kernels.gdn.{mod}").gdn_decode
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
    f32, bf, isb, loc = make_pools(head_mask(f), B + 1)
    idx = torch.arange(1, B + 1, dtype=torch.int32, device="cuda")
    for _ in range(2):
        fn(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)
    torch.cuda.synchronize()
    print(mod, f, cfg, file=sys.stderr, flush=True)
