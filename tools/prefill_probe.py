"""Where a short prefill's time goes on the GPU (35B-A3B NVFP4 dummy): eager forward wall vs host
launch time vs kernel time, top kernels / host ops, a CUDA-graph replay of the same forward, one MoE
layer per expert path, and a whole engine prefill step. Prints short tables; `--json` writes them.

    python3 tools/prefill_probe.py [--tokens 128,512] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _med(fn, reps=10):
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen35moe-nvfp4")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.runner.inputs import SeqWork, build_forward_batch
    from linrnn_serve.sampling_params import SamplingParams
    import linrnn_kernels.moe as moe_ops
    from linrnn_kernels.moe import experts as ex

    eng = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                 max_num_seqs=64, max_num_batched_tokens=2048, max_model_len=2048), progress=False)
    model, caches, runner = eng.model, eng.caches, eng.runner
    out = {"device": torch.cuda.get_device_name(0)}
    print("device", out["device"])
    for T in (int(t) for t in args.tokens.split(",")):
        blocks = list(range(1, 1 + -(-T // 16)))
        batch = build_forward_batch([SeqWork(list(range(1000, 1000 + T)), 0, 1, blocks)], 16, "cuda")
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
            from torch.profiler import ProfilerActivity, profile
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fwd()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            kern = sorted([e for e in ev if e.device_type.name == "CUDA"], key=lambda e: -e.self_device_time_total)
            ktot = sum(e.self_device_time_total for e in kern) / 1e3
            nk = sum(e.count for e in kern)
            cpu = sorted([e for e in ev if e.device_type.name == "CPU"], key=lambda e: -e.self_cpu_time_total)
            row = {"T": T, "wall_ms": wall, "host_launch_ms": host, "kernel_ms": ktot, "kernels": nk}
            # graph replay of the same forward
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
            except Exception as e:  # noqa: BLE001
                row["graph_error"] = f"{type(e).__name__}: {e}"[:300]
                torch.cuda.synchronize()
        print(json.dumps(row))
        print("| kernel | calls | ms |")
        for e in kern[:14]:
            print(f"| {e.key[:70]} | {e.count} | {e.self_device_time_total / 1e3:.3f} |")
        print("| host op | calls | self cpu ms |")
        for e in cpu[:14]:
            print(f"| {e.key[:70]} | {e.count} | {e.self_cpu_time_total / 1e3:.3f} |")
        # one MoE layer's experts per path
        layer = next(m for m in model.modules() if isinstance(m, type(model.layers[0].mlp)))
        x = torch.randn(T, model.cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        w13, w2 = layer.experts.w13.weight_tensor(), layer.experts.w2.weight_tensor()
        logits = torch.randn(T, model.cfg.num_experts, device="cuda")
        tw, tid = moe_ops.route(logits, model.cfg.num_experts_per_tok, True)
        tw = tw.to(torch.bfloat16)
        paths = {"default": lambda: ex.moe_experts(x, tw, tid, w13, w2),
                 "asm": lambda: ex.moe_experts(x, tw, tid, w13, w2, nvfp4_path="asm")}
        if w13.packed is not None:
            paths["mma"] = lambda: ex.moe_experts_mma(x, tw, tid, w13.packed, w2.packed)
        from linrnn_kernels.moe import dequant
        paths["dequant"] = lambda: ex.moe_experts(x, tw, tid, dequant.dequantize(w13), dequant.dequantize(w2))
        mt = {}
        with torch.inference_mode():
            for k, f in paths.items():
                f()
                mt[k] = _med(f, 20)
        row["moe_layer_ms"] = mt
        print("moe layer ms", json.dumps({k: round(v, 3) for k, v in mt.items()}))
        out[f"T{T}"] = row
    # a whole engine prefill step (scheduler + runner + sampling), one 128-token prompt
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


if __name__ == "__main__":
    main()
