"""Old tree vs new tree, bit for bit (round 4 of the small-batch decode work; runs on the GPU machine).

  python3 tools/gpu_small_r4_bits.py save OUT.pt      # on the old tree: the outputs below, fixed seeds
  python3 tools/gpu_small_r4_bits.py compare OUT.pt   # on the new tree: the same outputs, torch.equal per case

Cases (35B-A3B shapes, bf16): the skinny GEMM with the residual + row-norm epilogue (out_proj, N 2048, K 4096,
M 1 / 2 / 4 / 8) and with the shared expert's gate_add over the routed partials + residual + norm (N 2048, K 512,
M 1 / 8); the decode MoE chain as the layer runs it (fused router with the shared gate_up, then the routed
experts on repacked NVFP4 weights, uncombined partials) at M 1 / 2 / 8. Prints one line per case.
"""
from __future__ import annotations

import sys

import torch

import linrnn_kernels.moe as moe_ops
from linrnn_kernels.gemv import config as gcfg
from linrnn_kernels.gemv import skinny
from linrnn_kernels.moe import nvfp4_layout as lay
from linrnn_kernels.quant import WeightTensor, nvfp4


def dense(n, k, g):
    return WeightTensor("dense", (torch.randn(n, k, generator=g, device="cuda") / k ** 0.5).bfloat16())


def experts_nvfp4(E, H, I, g):
    out = []
    for n, k, parts, gated in ((2 * I, H, 2, True), (H, I, 1, False)):
        W = torch.randn(E, n, k, generator=g, device="cuda") * 0.02
        pk, sb, rs = [], [], []
        for Wp in W.chunk(parts, dim=-2):
            p_, s_, g_ = nvfp4.quantize(Wp)
            pk.append(p_), sb.append(s_), rs.append(g_[..., None].expand(*Wp.shape[:-1]))
        data, bs = torch.cat(pk, -2).contiguous(), torch.cat(sb, -2).contiguous()
        row = torch.cat(rs, -1).float().contiguous()
        out.append(WeightTensor("nvfp4", data, bs, row, lay.pack(data, bs, row, gated)))
    return out


def outputs() -> dict:
    g = torch.Generator(device="cuda").manual_seed(1234)
    res = {}
    w_out = dense(2048, 4096, g)
    nw = (0.1 * torch.randn(2048, generator=g, device="cuda")).bfloat16()
    for M in (1, 2, 4, 8):
        x = torch.randn(M, 4096, generator=g, device="cuda").bfloat16()
        r = torch.randn(M, 2048, generator=g, device="cuda").bfloat16()
        cfg = gcfg.skinny_config(M, 2048, 4096, "dense", x.device)
        res[f"out_proj+res+norm M={M}"] = skinny.skinny_linear(x, w_out, cfg, residual=r, norm_w=nw)
    w_down = dense(2048, 512, g)
    for M in (1, 8):
        h = torch.randn(M, 512, generator=g, device="cuda").bfloat16()
        parts = torch.randn(2, M * 8, 2048, generator=g, device="cuda") * 0.05
        gl = torch.randn(M, 1, generator=g, device="cuda").bfloat16()
        r = torch.randn(M, 2048, generator=g, device="cuda").bfloat16()
        cfg = gcfg.skinny_config(M, 2048, 512, "dense", h.device, 0, "gate_add")
        res[f"shared.down gate_add(parts)+res+norm M={M}"] = skinny.skinny_linear(
            h, w_down, cfg, epilogue="gate_add", addend_parts=(parts, 8), gate_logit=gl, residual=r, norm_w=nw)
    E, k, H, I = 256, 8, 2048, 512
    w13, w2 = experts_nvfp4(E, H, I, g)
    gate_w = dense(E + 1, H, g)
    shared13 = dense(2 * I, H, g)
    for M in (1, 2, 8):
        x = torch.randn(M, H, generator=g, device="cuda").bfloat16()
        logits, tw, ids, alignment, hs = moe_ops.route_align(x, gate_w, E, k, True, shared13, (w13, w2))
        y = moe_ops.moe_experts(x, tw, ids, w13, w2, alignment=alignment, combine=False)
        part = y.part if hasattr(y, "part") else y
        res[f"moe router (logits, weights, ids, shared h) M={M}"] = (logits, tw, ids, hs)
        res[f"moe experts partials M={M}"] = part
    torch.cuda.synchronize()
    return res


def main() -> int:
    mode, path = sys.argv[1], sys.argv[2]
    got = outputs()
    if mode == "save":
        torch.save({kk: tuple(t.cpu() for t in (v if isinstance(v, tuple) else (v,))) for kk, v in got.items()}, path)
        print(f"saved {len(got)} cases")
        return 0
    ref = torch.load(path)
    bad = 0
    for kk, v in got.items():
        v = v if isinstance(v, tuple) else (v,)
        same = len(v) == len(ref[kk]) and all(torch.equal(a.cpu(), b) for a, b in zip(v, ref[kk]))
        bad += not same
        print(f"| {kk} | {'bit-identical' if same else 'DIFFERS'} |")
    print(f"{len(got) - bad} / {len(got)} cases bit-identical old vs new")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
