"""Decode throughput of the engine at a few batch sizes: ms per step and tokens/s, with the
memory-traffic floor of BENCH.md beside it.

    python examples/decode_throughput.py --model qwen35moe-nvfp4 --load-format dummy --batch 1,32,128

For each batch size B: B requests with random prompts of --prompt-len tokens are added; once all of
them are decoding, --warmup steps run untimed and --steps steps are timed (wall clock around
LLMEngine.step(), host overhead included: the number a user sees). Greedy, ignore_eos.

Floor (BENCH.md): bytes(B, L) = non-expert weights + experts touched (E * (1 - (1 - k/E)^B) per MoE
layer) + recurrent/conv state read + write + KV read, over the copy bandwidth measured in this run
(linrnn_bench.floor, shared with `linrnn-serve bench batched`, the full llama-batched-bench-style
benchmark with tables, plots and several configurations per run).
--json PATH also writes the rows as JSON (with GPU name, versions and the command line).
"""
from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import time

import torch

from linrnn_bench.floor import ModelBytes, copy_bandwidth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen35moe-nvfp4", help="preset name or checkpoint directory")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--batch", default="1,32,128", help="comma-separated batch sizes")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=64, help="timed decode steps per batch size")
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--ssm-bf16-tau", type=float, default=float("inf"))
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.sampling_params import SamplingParams

    batches = [int(b) for b in args.batch.split(",")]
    need_len = args.prompt_len + args.warmup + args.steps + 8
    eng = LLMEngine(EngineConfig(
        model=args.model, load_format=args.load_format, dtype=args.dtype, max_num_seqs=max(batches),
        max_num_batched_tokens=max(2048, max(batches)), max_model_len=args.max_model_len or max(need_len, 512),
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        ssm_bf16_tau=args.ssm_bf16_tau))
    cuda = eng.device.type == "cuda"
    bw = copy_bandwidth(eng.device)
    model_bytes = ModelBytes.from_engine(eng)
    rng = random.Random(0)
    V = eng.model_config.vocab_size
    rows = []
    for B in batches:
        p = SamplingParams(temperature=0.0, max_tokens=args.warmup + args.steps + 4, ignore_eos=True)
        for i in range(B):
            eng.add_request(f"b{B}-{i}", [rng.randrange(V) for _ in range(args.prompt_len)], p)
        t0 = time.perf_counter()
        while eng.scheduler.waiting or any(not s.decode_ready for s in eng.scheduler.running):
            eng.step()  # prefill (chunked) until every sequence decodes
        t_prefill = time.perf_counter() - t0
        for _ in range(args.warmup):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            eng.step()
        if cuda:
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t0) / args.steps
        for i in range(B):
            eng.abort(f"b{B}-{i}")
        eng.check_integrity()
        ctx = args.prompt_len + args.warmup + args.steps // 2
        floor = model_bytes.floor_ms(B, ctx, bw) / 1e3
        rows.append({"batch": B, "ms_per_step": dt * 1e3, "tokens_per_s": B / dt, "prefill_s": t_prefill,
                     "floor_ms": floor * 1e3, "pct_of_floor": 100 * floor / dt, "context": ctx})
        print(f"B={B:4d}  {dt * 1e3:8.2f} ms/step  {B / dt:9.1f} tok/s  floor {floor * 1e3:6.2f} ms "
              f"({100 * floor / dt:5.1f}% of floor)  [prefill of {B}x{args.prompt_len} took {t_prefill:.2f} s]",
              flush=True)
    print()
    print(f"model {eng.model_name} ({args.load_format}), {eng.dtype}, CUDA graphs "
          f"{'on' if eng.runner.use_graphs else 'off'}, state f32 fraction {eng.caches.state.f32_fraction():.2f}, "
          f"copy bandwidth {bw / 1e12:.2f} TB/s")
    print("| B | ms/step | tok/s | floor ms/step | % of floor |")
    print("|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['batch']} | {r['ms_per_step']:.2f} | {r['tokens_per_s']:.1f} | {r['floor_ms']:.2f} | "
              f"{r['pct_of_floor']:.1f} |")
    if args.json:
        meta = {"argv": sys.argv, "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if cuda else None,
                "copy_bandwidth_Bps": bw, "graphs": eng.runner.use_graphs}
        try:
            import triton

            meta["triton"] = triton.__version__
        except ImportError:
            pass
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
