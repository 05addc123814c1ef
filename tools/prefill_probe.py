"""Where a prefill forward's time goes on the GPU (35B-A3B NVFP4 dummy): eager forward wall vs host
launch time vs kernel time, kernel time per component against its physical floor, top kernels / host ops,
a CUDA-graph replay of the same forward, optionally one MoE layer per expert path and a whole engine
prefill step. Prints short tables; `--json` writes them.

    python3 tools/prefill_probe.py [--tokens 128,512] [--prompt-len 0] [--moe-paths] [--json out.json]
    python3 tools/prefill_probe.py --tokens 2048,8192 --prompt-len 128      # #14's c = 64 wave: 64 x 128
    python3 tools/prefill_probe.py --shapes 64x128,16x129@3072              # + #16's prefix-cache burst

A forward of T tokens is T / prompt_len fresh prompts (prompt_len 0: one prompt of T tokens). `--shapes`
lists forwards as NxL[@C]: N sequences of L new tokens each after C tokens already in the caches (a
continuation: the GDN kernels start from the pooled state, attention reads C tokens of paged KV context;
the cached KV / state hold whatever earlier forwards left, which does not change the kernels' time).
Components are attributed by kernel name (COMPONENTS); each one's floor is max(FLOPs / bf16 dense peak,
bytes / copy bandwidth measured in the same run), from the model's shapes (`floors`):
  dense GEMMs  every non-expert projection (GDN in/out, attention qkv/o, router, shared expert; lm_head on
               the sequences' last rows): 2 T in out FLOPs; weights + activations read/written
  MoE          routed experts: 2 T k (2 I H + I H) FLOPs; every expert's stored bytes (all are touched)
  GDN chunk    the chunk form's matmuls per (64-token chunk, value head): 5 x 64 x 64 x Dk and
               3 x 64 x Dk x Dv MACs; q/k/v/o bytes + the state read and written once per sequence
  conv, norms, attention: bytes (activations read + written once; attention also its causal FLOPs)
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import time

import torch

PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12}  # dense bf16 tensor-core peak (SXM)

# kernel-name pattern -> component (first match wins)
COMPONENTS = [
    # (not bare "align": cuBLAS / cutlass kernel names carry "align1" / "align8")
    ("moe", r"moe|nvfp4|wgmma|_route|router|_align_kernel|pair_blocks|silu_mul_reduce|sum_reduce|quant_rows|dequant"),
    ("gdn_chunk", r"_chunk_(wy|state|output)"),
    ("conv", r"conv1d|conv_state"),
    ("attention", r"_prefill_kernel|_write_kv|qk_norm_rope|_merge_kernel"),
    ("norm", r"rmsnorm|_silu_mul_kernel"),
    ("dense_gemm", r"skinny|_prologue_kernel|nvjet|gemm|cutlass|xmma|cublas|sm90_"),
]


def component(name: str) -> str:
    for comp, pat in COMPONENTS:
        if re.search(pat, name, re.I):
            return comp
    return "other"


def _med(fn, reps=10):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def floors(model, T: int, nseq: int, bw: float, peak: float, context: int = 0) -> dict:
    """Per component (FLOPs, bytes, floor ms) for a prefill forward of T tokens in nseq equal prompts, each
    after `context` cached tokens (attention: the context's K/V read and its FLOPs)."""
    cfg = model.cfg
    H, e = cfg.hidden_size, 2  # bf16 activations
    out = {}

    def put(comp, flops, nbytes):
        out[comp] = {"GFLOP": flops / 1e9, "MB": nbytes / 1e6, "floor_ms": 1e3 * max(flops / peak, nbytes / bw)}

    # dense projections: 2-D stored weights that are neither the embedding nor routed experts
    fl = by = 0
    for n, p in model.named_parameters():
        if p.dim() != 2 or n.startswith("embed_tokens") or ".experts." in n or "conv1d" in n:
            continue
        rows = nseq if n.startswith("lm_head") else T
        fl += 2 * rows * p.shape[0] * p.shape[1]
        by += p.numel() * p.element_size() + rows * (p.shape[0] + p.shape[1]) * e
    put("dense_gemm", fl, by)
    # routed experts: all touched at these T
    n_moe = sum(cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers))
    I, k = cfg.moe_intermediate_size, cfg.num_experts_per_tok
    exp_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if ".experts." in n)
    exp_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if ".experts." in n)
    put("moe", n_moe * 2 * T * k * 3 * I * H, exp_bytes + n_moe * T * (2 * H * e + k * 4))
    # GDN chunk form
    n_gdn = len(cfg.gdn_layers)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    chunks = nseq * -(-T // nseq // 64)
    macs = chunks * hv * (5 * 64 * 64 * dk + 3 * 64 * dk * dv)
    io = T * (2 * cfg.key_dim + 2 * cfg.value_dim + 2 * hv) * e + nseq * hv * dk * dv * 4 * 2
    put("gdn_chunk", n_gdn * 2 * macs, n_gdn * io)
    put("conv", 0, n_gdn * T * cfg.conv_dim * e * 2)
    # attention: causal within each prompt
    n_att = len(cfg.attn_layers)
    L = T // nseq
    att_fl = n_att * nseq * 2 * 2 * (L * context + L * (L + 1) / 2) * cfg.num_attention_heads * cfg.head_dim
    att_by = n_att * (T * (2 * cfg.num_attention_heads + 4 * cfg.num_key_value_heads)
                      + nseq * context * 2 * cfg.num_key_value_heads) * cfg.head_dim * e
    put("attention", att_fl, att_by)
    # norms: two fused residual-add norms per layer (x, residual in; x, residual out) + the GDN gated norm
    put("norm", 0, cfg.num_hidden_layers * 2 * T * H * e * 4 + n_gdn * T * cfg.value_dim * e * 3)
    return out


def parse_shapes(spec: str) -> list[tuple[int, int, int]]:
    """'64x128,16x129@3072' -> [(64, 128, 0), (16, 129, 3072)]: (sequences, new tokens each, cached context)."""
    out = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)x(\d+)(?:@(\d+))?", item.strip())
        if not m:
            raise SystemExit(f"--shapes item {item!r} is not NxL or NxL@C")
        out.append((int(m[1]), int(m[2]), int(m[3] or 0)))
    return out


def profile_forward(fwd):
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fwd()
        torch.cuda.synchronize()
    ev = prof.key_averages()
    kern = sorted([e for e in ev if e.device_type.name == "CUDA"], key=lambda e: -e.self_device_time_total)
    cpu = sorted([e for e in ev if e.device_type.name == "CPU"], key=lambda e: -e.self_cpu_time_total)
    return kern, cpu


def shape_key(nseq: int, L: int, ctx: int) -> str:
    return f"{nseq}x{L}@{ctx}" if ctx else f"T{nseq * L}"


def probe_shape(model, caches, shape: tuple[int, int, int], bw: float, peak: float, graph: bool = True) -> dict:
    """One prefill forward of `shape` (nseq, L, ctx): eager wall / host launch / kernel ms, kernel ms per
    component with its floor, top kernels and host ops, and (graph) a CUDA-graph replay of it."""
    from linrnn_serve.runner.inputs import SeqWork, build_forward_batch
    nseq, L, ctx = shape
    T, nblk = nseq * L, -(-(ctx + L) // 16)
    work = [SeqWork(list(range(1000 + s, 1000 + s + L)), ctx, 1 + s, list(range(1 + s * nblk, 1 + (s + 1) * nblk)))
            for s in range(nseq)]
    batch = build_forward_batch(work, 16, "cuda")
    fwd = lambda: model(batch, caches)  # noqa: E731
    with torch.inference_mode():
        for _ in range(3):
            fwd()
        wall = _med(fwd)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fwd()
        host = 1e3 * (time.perf_counter() - t0)
        torch.cuda.synchronize()
        kern, cpu = profile_forward(fwd)
        ktot = sum(e.self_device_time_total for e in kern) / 1e3
        nk = sum(e.count for e in kern)
        row = {"T": T, "prompts": nseq, "prompt_len": L, "context": ctx, "wall_ms": wall, "host_launch_ms": host,
               "kernel_ms": ktot, "kernels": nk, "tok_per_s": T / wall * 1e3}
        if graph:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    fwd()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    fwd()
                row["graph_ms"] = _med(g.replay)
                del g
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
    comp = {}
    for e in kern:
        c = comp.setdefault(component(e.key), {"ms": 0.0, "calls": 0})
        c["ms"] += e.self_device_time_total / 1e3
        c["calls"] += e.count
    fl = floors(model, T, nseq, bw, peak, ctx)
    for name, c in comp.items():
        c.update(fl.get(name, {}))
    row["components"] = comp
    row["floor_ms"] = sum(f["floor_ms"] for f in fl.values())
    row["top_kernels"] = [(e.key, e.count, e.self_device_time_total / 1e3) for e in kern[:40]]
    row["host_ops"] = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in cpu[:12]]
    return row


def print_row(row: dict, top: int = 24) -> None:
    """The tables of one probe_shape row: the summary line, components against floors, top kernels, host ops."""
    T, nseq, L, ctx, ktot = row["T"], row["prompts"], row["prompt_len"], row["context"], row["kernel_ms"]
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()
                      if not isinstance(v, (dict, list))}))
    print(f"\n| T = {T} ({nseq} x {L}{f' @ {ctx}' if ctx else ''}) component | calls | kernel ms | % | GFLOP | MB | "
          "floor ms | x floor |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, c in sorted(row["components"].items(), key=lambda kv: -kv[1]["ms"]):
        fcols = (f"{c['GFLOP']:.1f} | {c['MB']:.0f} | {c['floor_ms']:.3f} | {c['ms'] / max(c['floor_ms'], 1e-9):.1f}"
                 if "floor_ms" in c else "- | - | - | -")
        print(f"| {name} | {c['calls']} | {c['ms']:.3f} | {100 * c['ms'] / ktot:.1f} | {fcols} |")
    print(f"| total | {row['kernels']} | {ktot:.3f} | 100 | | | {row['floor_ms']:.3f} | {ktot / row['floor_ms']:.1f} |")
    if top:
        print("\n| kernel | component | calls | ms | us/call |")
        print("|---|---|---:|---:|---:|")
        for key, n, ms in row["top_kernels"][:top]:
            print(f"| {key[:64]} | {component(key)} | {n} | {ms:.3f} | {1e3 * ms / max(n, 1):.1f} |")
        print("\n| host op | calls | self cpu ms |")
        print("|---|---:|---:|")
        for key, n, ms in row["host_ops"]:
            print(f"| {key[:64]} | {n} | {ms:.3f} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen35moe-nvfp4")
    ap.add_argument("--tokens", default="128,512", help="tokens per forward (comma list)")
    ap.add_argument("--prompt-len", type=int, default=0, help="tokens per prompt (0: one prompt per forward)")
    ap.add_argument("--shapes", default=None,
                    help="forwards as NxL[@C] (N sequences of L new tokens after C cached ones); replaces --tokens")
    ap.add_argument("--moe-paths", action="store_true", help="also time one MoE layer per expert path")
    ap.add_argument("--engine-step", action="store_true", help="also time whole engine prefill steps (128 tokens)")
    ap.add_argument("--no-graph", action="store_true", help="skip the CUDA-graph replay of the forward")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from linrnn_bench.floor import copy_bandwidth
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.sampling_params import SamplingParams

    shapes = parse_shapes(args.shapes) if args.shapes else []
    if not shapes:
        for T in (int(t) for t in args.tokens.split(",")):
            L = args.prompt_len or T
            if T % L:
                raise SystemExit(f"--tokens {T} is not a multiple of --prompt-len {L}")
            shapes.append((T // L, L, 0))
    nseq_max = max(n for n, _, _ in shapes)
    eng = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 max_num_seqs=max(64, nseq_max), max_num_batched_tokens=max(2048, *(n * L for n, L, _ in shapes)),
                                 max_model_len=max(2048, *(L + c for _, L, c in shapes)),
                                 enforce_eager=not args.engine_step),
                    progress=False)
    model, caches = eng.model, eng.caches
    dev = torch.cuda.get_device_name(0)
    bw = copy_bandwidth("cuda")
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in dev), 989e12)
    out = {"device": dev, "copy_GBps": bw / 1e9, "peak_bf16_TFLOPs": peak / 1e12}
    print(f"device {dev}, copy bandwidth {bw / 1e9:.0f} GB/s, bf16 peak {peak / 1e12:.0f} TFLOP/s")
    for nseq, L, ctx in shapes:
        row = probe_shape(model, caches, (nseq, L, ctx), bw, peak, graph=not args.no_graph)
        print_row(row, top=24)
        if args.moe_paths:
            row["moe_layer_ms"] = moe_paths(model, row["T"])
        out[shape_key(nseq, L, ctx)] = row
        torch.cuda.empty_cache()
    if args.engine_step:  # a whole engine prefill step (scheduler + runner + sampling), one 128-token prompt
        p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
        steps = []
        for i in range(6):
            eng.add_request(f"probe{i}", list(range(2000 + i, 2128 + i)), p)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            eng.step()
            torch.cuda.synchronize()
            steps.append(1e3 * (time.perf_counter() - t0))
            eng.abort(f"probe{i}")
        out["engine_prefill_step_ms"] = steps
        print("engine prefill step ms (128 tokens):", [round(s, 2) for s in steps])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


def moe_paths(model, T: int) -> dict:
    """One MoE layer's routed experts at T tokens per expert path (CUDA-event medians)."""
    import linrnn_kernels.moe as moe_ops
    from linrnn_kernels.moe import dequant
    from linrnn_kernels.moe import experts as ex
    layer = next(m for m in model.modules() if isinstance(m, type(model.layers[0].mlp)))
    x = torch.randn(T, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
    w13, w2 = layer.experts.w13.weight_tensor(), layer.experts.w2.weight_tensor()
    logits = torch.randn(T, model.cfg.num_experts, device="cuda")
    tw, tid = moe_ops.route(logits, model.cfg.num_experts_per_tok, True)
    tw = tw.to(torch.bfloat16)
    paths = {"default": lambda: ex.moe_experts(x, tw, tid, w13, w2),
             "dequant": lambda: ex.moe_experts(x, tw, tid, dequant.dequantize(w13), dequant.dequantize(w2))}
    if w13.packed is not None:
        paths["mma"] = lambda: ex.moe_experts_mma(x, tw, tid, w13.packed, w2.packed)
    mt = {}
    with torch.inference_mode():
        for k, f in paths.items():
            f()
            mt[k] = _med(f, 20)
    print("moe layer ms", json.dumps({k: round(v, 3) for k, v in mt.items()}))
    return mt


if __name__ == "__main__":
    main()
