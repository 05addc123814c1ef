"""Paged attention kernel benchmark (kernels/attention/), Qwen3.5-35B-A3B shapes (Hq 16, Hkv 2, D 256).

Decode: split-K paged decode attention at B x context, timed as CUDA-graph replays (the engine
replays decode in graphs, so launch overhead is not counted), KV rotated across copies so it does
not sit in L2; GB/s of the bytes that must move (K/V read, q read, o written) and % of the copy
bandwidth measured in the same run. Prefill: varlen causal paged attention vs
torch.nn.functional.scaled_dot_product_attention (is_causal, K/V expanded to 16 heads, contiguous)
on the same data. Every timed configuration is first checked against the naive reference (or SDPA
for the 8192-token prefill) and is not timed if it fails.

    python -m linrnn_bench.kernels.attention --out benchmarks/results/attention_kernels [--tune]
    python -m linrnn_bench.kernels.attention --resources   # no GPU needed: sm_90 regs/spills/smem

Writes <out>.md and <out>.json and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import torch

from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info, time_graph

HQ, HKV, D, BLOCK_SIZE = 16, 2, 256, 16
DTYPE = torch.bfloat16
DEVICE = "cuda"
L2_ROTATE_BYTES = 256 << 20  # rotate KV copies until this much is touched per graph replay

DECODE_TUNE = [(64, 4, 2), (64, 8, 2), (64, 4, 3), (32, 4, 2), (32, 4, 3), (32, 4, 4), (16, 4, 4), (128, 8, 2)]
PREFILL_TUNE = [(64, 32, 4, 3), (64, 32, 4, 2), (64, 64, 4, 2), (128, 32, 8, 3), (128, 64, 8, 2), (32, 32, 4, 3),
                (64, 16, 4, 4)]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="benchmarks/results/attention_kernels", help="output path prefix (.md, .json)")
    p.add_argument("--batches", default="1,8,32,64,128")
    p.add_argument("--contexts", default="256,2048,8192")
    p.add_argument("--prefill", default="1x8192,8x1024", help="BxL list for prefill")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--tune", action="store_true", help="also sweep launch configs / split counts")
    p.add_argument("--resources", action="store_true",
                   help="only compile for sm_90 (no GPU) and print registers / spills / smem per config")


# ---------------------------------------------------------------- timing helpers

def time_eager(fn, iters: int = 10) -> float:
    """Median ms of fn() (long kernels: launch overhead is negligible)."""
    import triton.testing
    return triton.testing.do_bench(fn, warmup=25, rep=max(100, iters * 10), return_mode="median")


def rel_err(out, ref) -> float:
    if torch.isnan(out).any():
        return float("nan")
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


# ---------------------------------------------------------------- decode

def make_decode_inputs(batch: int, ctx: int, width: int, rotations: int):
    """KV pages for `rotations` independent copies of a batch (shuffled blocks), one q, and one
    block table per copy. Every sequence has context `ctx`."""
    per_copy = batch * (ctx // BLOCK_SIZE)
    num_blocks = 1 + rotations * per_copy
    k_cache = torch.empty(num_blocks, BLOCK_SIZE, HKV, D, dtype=DTYPE, device=DEVICE).normal_()
    v_cache = torch.empty_like(k_cache).normal_()
    perm = torch.randperm(num_blocks - 1, device=DEVICE).int() + 1
    tables = []
    for r in range(rotations):
        t = torch.zeros(batch, width, dtype=torch.int32, device=DEVICE)
        t[:, : ctx // BLOCK_SIZE] = perm[r * per_copy:(r + 1) * per_copy].view(batch, -1)
        tables.append(t)
    q = torch.randn(batch, HQ, D, dtype=DTYPE, device=DEVICE)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEVICE)
    cu = torch.arange(batch + 1, dtype=torch.int32, device=DEVICE)
    return q, k_cache, v_cache, cu, seq_lens, tables


def bench_decode(batch, ctx, width, iters, config=None, num_splits=None, bw=None):
    from linrnn_kernels.attention import naive
    from linrnn_kernels.attention.common import default_decode_config, num_sms
    from linrnn_kernels.attention.decode import decode_attention, decode_num_splits

    kv_bytes = batch * ctx * HKV * D * 2 * DTYPE.itemsize
    rotations = max(1, min(256, math.ceil(L2_ROTATE_BYTES / kv_bytes)))
    q, kc, vc, cu, lens, tables = make_decode_inputs(batch, ctx, width, rotations)
    scale = D ** -0.5
    cfg = config or default_decode_config(D, DTYPE)
    splits = num_splits or decode_num_splits(batch, HKV, width, BLOCK_SIZE, cfg.block_n, num_sms(q.device.index))
    row = dict(B=batch, ctx=ctx, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
               splits=splits, rotations=rotations)
    try:
        out = decode_attention(q, kc, vc, lens, tables[0], scale, config=cfg, num_splits=splits)
        err = rel_err(out, naive.paged_attention(q, kc, vc, cu, lens, tables[0], scale))
    except Exception as e:  # compile / resource failure of a tuning config
        return dict(row, status=f"error: {type(e).__name__}: {str(e)[:200]}")
    row["rel_err"] = err
    if not err <= 1e-2:
        return dict(row, status="FAILED correctness: not timed")
    outs = [torch.empty_like(q) for _ in range(rotations)]
    calls = [lambda t=t, o=o: decode_attention(q, kc, vc, lens, t, scale, config=cfg, num_splits=splits, out=o)
             for t, o in zip(tables, outs)]
    ms = time_graph(calls, iters)
    moved = kv_bytes + 2 * q.numel() * q.element_size()
    row.update(status="ok", us=ms * 1e3, MB=moved / 1e6, GBps=moved / (ms * 1e-3) / 1e9)
    if bw:
        row["pct_copy_bw"] = 100 * row["GBps"] / bw
    return row


# ---------------------------------------------------------------- prefill

def bench_prefill(batch, length, iters, config=None):
    import torch.nn.functional as F

    from linrnn_kernels.attention import naive
    from linrnn_kernels.attention.kv_write import write_kv
    from linrnn_kernels.attention.prefill import prefill_attention

    T = batch * length
    scale = D ** -0.5
    q = torch.randn(T, HQ, D, dtype=DTYPE, device=DEVICE)
    k = torch.randn(T, HKV, D, dtype=DTYPE, device=DEVICE)
    v = torch.randn(T, HKV, D, dtype=DTYPE, device=DEVICE)
    blocks = length // BLOCK_SIZE
    kc = torch.empty(1 + batch * blocks, BLOCK_SIZE, HKV, D, dtype=DTYPE, device=DEVICE)
    vc = torch.empty_like(kc)
    tables = (torch.randperm(batch * blocks, device=DEVICE).int() + 1).view(batch, blocks)
    pos = torch.arange(length, device=DEVICE)
    slots = (tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE).reshape(-1)
    cu = torch.arange(0, T + 1, length, dtype=torch.int32, device=DEVICE)
    lens = torch.full((batch,), length, dtype=torch.int32, device=DEVICE)
    args = (q, kc, vc, cu, lens, tables, scale)
    row = dict(shape=f"{batch}x{length}", block_m=None, block_n=None)
    try:
        write_kv(k, v, kc, vc, slots)
        out = prefill_attention(*args, config=config)
    except Exception as e:
        return dict(row, status=f"error: {type(e).__name__}: {str(e)[:200]}")
    from linrnn_kernels.attention.common import default_prefill_config
    cfg = config or default_prefill_config(D, DTYPE)
    row.update(block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def sdpa_inputs():
        qs = q.view(batch, length, HQ, D).transpose(1, 2)
        ks = k.view(batch, length, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
        vs = v.view(batch, length, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, dim=1)
        return qs.contiguous(), ks.contiguous(), vs.contiguous()

    qs, ks, vs = sdpa_inputs()
    sdpa = lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)  # noqa: E731
    ref_sdpa = sdpa().transpose(1, 2).reshape(T, HQ, D)
    row["rel_err_vs_sdpa"] = rel_err(out, ref_sdpa)
    if length <= 2048:  # the naive reference materializes [Hq, L, L] f32 scores per sequence
        row["rel_err_vs_naive"] = rel_err(out, naive.paged_attention(*args))
    if not (row["rel_err_vs_sdpa"] <= 1e-2 and row.get("rel_err_vs_naive", 0.0) <= 1e-2):
        return dict(row, status="FAILED correctness: not timed")
    flops = 4 * HQ * D * batch * length * (length + 1) / 2  # QK^T and PV over the causal triangle
    ms = time_eager(lambda: prefill_attention(*args, config=config, out=out), iters)
    ms_sdpa = time_eager(sdpa, iters)
    ms_write = time_eager(lambda: write_kv(k, v, kc, vc, slots), iters)
    row.update(status="ok", ms=ms, TFLOPs=flops / (ms * 1e-3) / 1e12, sdpa_ms=ms_sdpa,
               sdpa_TFLOPs=flops / (ms_sdpa * 1e-3) / 1e12, speed_vs_sdpa=ms_sdpa / ms, write_kv_us=ms_write * 1e3,
               tokens_per_s=T / (ms * 1e-3))
    return row


# ---------------------------------------------------------------- sm_90 resources (no GPU)

def compile_resources() -> list[dict]:
    """Compile each kernel/config for sm_90 with Triton's ptxas (no GPU needed); report registers,
    spill stack bytes and shared memory per program."""
    import re
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from linrnn_kernels.attention.decode import _decode_kernel, _merge_kernel
    from linrnn_kernels.attention.kv_write import _write_kv_kernel
    from linrnn_kernels.attention.prefill import _prefill_kernel

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")

    def build(fn, types, consts, num_warps, num_stages):
        sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
        # what Triton's launcher specializes at run time: 16-byte aligned pointers, strides % 16 == 0
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(fn.arg_names)
                 if n not in consts and (sig[n].startswith("*") or n.startswith("stride_")) and n != "stride_bt"}
        kernel = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=num_warps, num_stages=num_stages))
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(kernel.asm["cubin"])
            f.flush()
            res = subprocess.run([cuobjdump, "-res-usage", f.name], capture_output=True, text=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+)", res)
        return dict(regs=int(m.group(1)) if m else None, spill_stack_bytes=int(m.group(2)) if m else None,
                    smem_bytes=kernel.metadata.shared, cp_async="cp.async" in kernel.asm["ptx"],
                    wgmma="wgmma" in kernel.asm["ptx"])

    bf = "*bf16"
    rows = []
    for bm, bn, w, st in PREFILL_TUNE:
        types = dict(q_ptr=bf, k_cache=bf, v_cache=bf, o_ptr=bf, cu_seqlens="*i32", seq_lens="*i32",
                     block_tables="*i32", qk_scale="fp32")
        consts = dict(G=8, G_PAD=8, D=D, BS=BLOCK_SIZE, BLOCK_Q=bm // 8, BLOCK_N=bn, DOT_PRECISION="tf32",
                      DOT_UPCAST=False)
        rows.append(dict(kernel="prefill", block_m=bm, block_n=bn, num_warps=w, num_stages=st,
                         **build(_prefill_kernel, types, consts, w, st)))
    for bn, w, st in DECODE_TUNE:
        types = dict(q_ptr=bf, k_cache=bf, v_cache=bf, o_ptr=bf, part_o="*fp32", part_lse="*fp32",
                     seq_lens="*i32", block_tables="*i32", qk_scale="fp32")
        consts = dict(HQ=HQ, G=8, G_PAD=16, D=D, BS=BLOCK_SIZE, BLOCK_N=bn, NUM_SPLITS=8, DOT_PRECISION="tf32",
                      DOT_UPCAST=False)
        rows.append(dict(kernel="decode", block_n=bn, num_warps=w, num_stages=st,
                         **build(_decode_kernel, types, consts, w, st)))
    rows.append(dict(kernel="merge", **build(_merge_kernel, dict(part_o="*fp32", part_lse="*fp32", o_ptr=bf,
                                                                 seq_lens="*i32"),
                                             dict(HQ=HQ, D=D, BLOCK_D=64, BLOCK_N=64, NUM_SPLITS=128), 4, 1)))
    rows.append(dict(kernel="write_kv", **build(_write_kv_kernel, dict(k=bf, v=bf, k_cache=bf, v_cache=bf,
                                                                       slot_mapping="*i64"),
                                                dict(H=HKV, H_PAD=HKV, D=D, BS=BLOCK_SIZE), 2, 1)))
    return rows


# ---------------------------------------------------------------- report

def md_table(rows, cols) -> str:
    def fmt(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:.0f}"
        return "" if x is None else str(x)
    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---:" for _ in cols) + "|"]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def run(args) -> int:
    if args.resources:
        os.environ.pop("TRITON_INTERPRET", None)  # before the kernels are imported (jit reads it then)
        rows = compile_resources()
        print(md_table(rows, ["kernel", "block_m", "block_n", "num_warps", "num_stages", "regs",
                              "spill_stack_bytes", "smem_bytes", "cp_async", "wgmma"]))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("the attention benchmark needs a CUDA GPU (use --resources for a compile-only report)")
    from linrnn_kernels.attention.common import LaunchConfig

    torch.manual_seed(0)
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    width = max(contexts) // BLOCK_SIZE  # one static block-table width, as in CUDA-graph decode
    env = env_info()
    bw = copy_bandwidth_gbs(DEVICE)
    print(f"{env['gpu']}: copy bandwidth {bw:.0f} GB/s")

    decode = []
    for b in batches:
        for c in contexts:
            decode.append(bench_decode(b, c, width, args.iters, bw=bw))
            print(decode[-1], flush=True)
            torch.cuda.empty_cache()
    prefill = []
    for shape in args.prefill.split(","):
        b, L = (int(x) for x in shape.split("x"))
        prefill.append(bench_prefill(b, L, args.iters))
        print(prefill[-1], flush=True)

    tune_decode, tune_prefill = [], []
    if args.tune:
        # tune where it matters: a few batch sizes at the two longest contexts
        for b in [b for b in batches if b in (1, 8, 64)] or batches[:3]:
            for c in contexts[-2:]:
                for bn, w, st in DECODE_TUNE:
                    tune_decode.append(bench_decode(b, c, width, args.iters, LaunchConfig(bn, w, st), bw=bw))
                    print(tune_decode[-1], flush=True)
                base = tune_decode[-len(DECODE_TUNE)]["splits"]
                for s in sorted({max(1, base // 4), max(1, base // 2), min(256, base * 2)} - {base}):
                    tune_decode.append(bench_decode(b, c, width, args.iters, num_splits=s, bw=bw))
                    print(tune_decode[-1], flush=True)
                torch.cuda.empty_cache()
        for shape in args.prefill.split(","):
            b, L = (int(x) for x in shape.split("x"))
            for bm, bn, w, st in PREFILL_TUNE:
                tune_prefill.append(bench_prefill(b, L, args.iters, LaunchConfig(bn, w, st, bm)))
                print(tune_prefill[-1], flush=True)

    dcols = ["B", "ctx", "splits", "block_n", "num_warps", "num_stages", "status", "rel_err", "us", "MB", "GBps",
             "pct_copy_bw"]
    pcols = ["shape", "block_m", "block_n", "num_warps", "num_stages", "status", "rel_err_vs_sdpa",
             "rel_err_vs_naive", "ms", "TFLOPs", "sdpa_ms", "sdpa_TFLOPs", "speed_vs_sdpa", "write_kv_us"]
    md = [f"# Paged attention kernels, Qwen3.5-35B-A3B shapes (Hq {HQ}, Hkv {HKV}, D {D}, block {BLOCK_SIZE}, bf16)",
          "", f"{env['gpu']}, torch {env['torch']}, triton {env['triton']}, commit {env['commit']}, {env['date']}",
          f"`{env['command']}`", "", f"Copy bandwidth (read+write): {bw:.0f} GB/s", "",
          "## Decode (CUDA-graph replay, KV rotated out of L2; bytes = K/V read + q + o)", "",
          md_table(decode, dcols), "",
          "## Prefill (causal; ours paged, SDPA contiguous with K/V expanded to 16 heads)", "",
          md_table(prefill, pcols), ""]
    if args.tune:
        md += ["## Tuning sweep: decode", "", md_table(tune_decode, dcols), "",
               "## Tuning sweep: prefill", "", md_table(tune_prefill, pcols), ""]
    text = "\n".join(md)
    print(text)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".md", "w") as f:
        f.write(text)
    with open(args.out + ".json", "w") as f:
        json.dump(dict(env=env, copy_bandwidth_GBps=bw, decode=decode, prefill=prefill, tune_decode=tune_decode,
                       tune_prefill=tune_prefill, shapes=dict(Hq=HQ, Hkv=HKV, D=D, block_size=BLOCK_SIZE,
                                                              dtype=str(DTYPE), table_width=width)), f, indent=1)
    failed = [r for r in decode + prefill if r.get("status") != "ok"]
    return 1 if failed else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
