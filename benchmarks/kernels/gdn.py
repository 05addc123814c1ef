"""Gated-DeltaNet kernel benchmark (kernels/gdn/), Qwen3.5-35B-A3B shapes: Hk 16, Hv 32, Dk = Dv 128,
conv_dim 8192, bf16 activations (BENCH.md "Kernel benchmarks").

Decode (one GDN layer, one token per sequence, B in --batches): our fused decode kernel with all-f32
state, all-bf16 state and hybrid fractions of f32 heads (--hybrid), timed as CUDA-graph replays of
calls that rotate through disjoint state slots (>= 256 MB touched per replay, so the state never
sits in L2); GB/s of the bytes that must move (state read + write in each head's dtype, q/k/v/a/b
read, o written) and % of the copy bandwidth measured in the same run. Hybrid rows also show the
bytes-proportional prediction f * t_f32 + (1 - f) * t_bf16. Peer: fla-core's
fused_recurrent_gated_delta_rule on the same inputs (f32 state; fla takes grouped value heads
natively: q/k with Hk heads, v/g/beta with Hv heads, value head h reads key head h // (Hv/Hk), as
ours; gates, beta sigmoid and q/k L2 norm in-kernel), each batch size in a child process so that a
CUDA fault in fla is reported instead of ending the run.

Prefill (--prefill BxL): tokens/s of our chunked varlen prefill (per --precisions) vs fla's
chunk_gated_delta_rule (cu_seqlens varlen, same gates in-kernel), also in a child process; plus the
varlen conv kernel on its own.

Correctness first: decode and prefill are checked against the naive reference at these shapes and
nothing is timed if a check fails. fla is imported lazily (pip-installed, or --fla-path pointing at
an unpacked fla-core wheel; a stub stands in for einops, which fla imports but the timed paths never call).

    python -m linrnn_bench.kernels.gdn --out benchmarks/results/gdn [--sweep] [--fla-path DIR]
    (--prefill "" times decode only, --batches "" prefill only: each part fits a 10-minute slot)
    python -m linrnn_bench.kernels.gdn --resources      # no GPU needed: sm_90 registers / spills / smem

Writes <out>/gdn_kernels.{md,json} (gdn_decode / gdn_prefill when one part is skipped, *_sweep with
--sweep) and prints the tables.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import types

import torch

from linrnn_bench.kernels.common import copy_bandwidth_gbs, env_info, time_graph
from linrnn_kernels.gdn.layout import bf16_pool_shape

HK, HV, DK, DV, CONV_K = 16, 32, 128, 128, 4
C = 2 * HK * DK + HV * DV
ACT = torch.bfloat16
DEVICE = "cuda"
L2_ROTATE_BYTES = 256 << 20
# DecodeConfig tuples: (bv, num_warps[, load hint[, store hint[, maxnreg[, partition_major]]]]])
EF = "evict_first"
DECODE_SWEEP = [(16, 2), (32, 4), (64, 4), (16, 2, EF, EF), (32, 2, EF, EF), (32, 4, EF, EF), (64, 4, EF, EF),
                (64, 4, EF, ".cs"), (64, 4, ".cg", EF), (64, 4, EF, EF, 112), (64, 2, EF, EF), (128, 4, EF, EF)]
PREFILL_SWEEP = [{}, {"state_bv": 32}, {"state_bv": 64}, {"state_warps": 8}, {"state_stages": 3},
                 {"state_stages": 1}, {"wy_warps": 8}, {"output_bv": 32}, {"output_bv": 128, "output_warps": 8},
                 {"output_warps": 8}]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="benchmarks/results/gdn", help="output directory (<part>.md / .json)")
    p.add_argument("--batches", default="1,8,32,64,128,256")
    p.add_argument("--hybrid", default="0.3,0.5", help="fractions of f32 heads for the hybrid rows")
    p.add_argument("--prefill", default="1x8192,4x2048,64x512", help="BxL list for prefill")
    p.add_argument("--precisions", default="bf16,tf32", help="prefill matmul precision modes to time")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays (median)")
    p.add_argument("--sweep", action="store_true", help="also time decode / prefill launch configs")
    p.add_argument("--fla-path", default=None, help="directory holding an unpacked fla package (if not installed)")
    p.add_argument("--no-peer", action="store_true", help="skip fla")
    p.add_argument("--resources", action="store_true",
                   help="only compile for sm_90 (no GPU) and print registers / spills / smem per kernel")
    p.add_argument("--peer", default=None, help=argparse.SUPPRESS)  # child mode: decode:B | prefill:BxL


# ---------------------------------------------------------------------------- timing helpers


def time_eager(fn) -> float:
    """Median ms of fn() after warm-up (triton.testing.do_bench, L2 flushed before each call)."""
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")


def rel(out, ref) -> float:
    out, ref = out.float(), ref.float()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------- inputs


def head_mask(f32_fraction: float, seed: int = 0) -> list[bool]:
    """bf16 flag per value head with round(f * Hv) f32 heads at random positions."""
    n_f32 = round(f32_fraction * HV)
    g = torch.Generator().manual_seed(seed)
    f32_heads = set(torch.randperm(HV, generator=g)[:n_f32].tolist())
    return [h not in f32_heads for h in range(HV)]


def make_pools(mask: list[bool], slots: int, device=None):
    device = device or DEVICE
    nb = sum(mask)
    local, cf, cb = [], 0, 0
    for is_b in mask:
        local.append(cb if is_b else cf)
        cb, cf = cb + is_b, cf + (not is_b)
    f32 = 0.3 * torch.randn(slots, HV - nb, DK, DV, device=device)
    bf = (0.3 * torch.randn(bf16_pool_shape(slots, nb, DK, DV), device=device)).to(torch.bfloat16)
    return (f32, bf, torch.tensor(mask, dtype=torch.int32, device=device),
            torch.tensor(local, dtype=torch.int32, device=device))


def make_step_inputs(T: int, dtype=ACT, device=None, seed: int = 0):
    """q, k, v as views of a conv-output-like [T, C] tensor, a, b as views of a [T, 2 Hv] one; gates
    with realistic timescales (SPEC §3)."""
    device = device or DEVICE
    g = torch.Generator(device=device).manual_seed(seed)
    qkv = torch.randn(T, C, device=device, generator=g).to(dtype)
    ba = torch.randn(T, 2 * HV, device=device, generator=g).to(dtype)
    q = qkv[:, :HK * DK].view(T, HK, DK)
    k = qkv[:, HK * DK:2 * HK * DK].view(T, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(T, HV, DV)
    A_log = torch.empty(HV, device=device).uniform_(1, 16).log()
    dt = torch.exp(torch.empty(HV, device=device).uniform_(math.log(1e-3), math.log(1e-1)))
    dt_bias = dt + torch.log(-torch.expm1(-dt))
    return q, k, v, ba[:, HV:], ba[:, :HV], A_log, dt_bias


def decode_bytes(B: int, mask: list[bool]) -> int:
    nb = sum(mask)
    state = B * ((HV - nb) * DK * DV * 4 + nb * DK * DV * 2) * 2
    return state + B * (C + 2 * HV) * ACT.itemsize + B * HV * DV * ACT.itemsize


def rotation_sets(B: int, state_bytes_per_call: int, device=None):
    """Disjoint slot-index sets so one graph replay touches >= L2_ROTATE_BYTES of state."""
    device = device or DEVICE
    R = max(2, min(64, math.ceil(L2_ROTATE_BYTES / max(state_bytes_per_call, 1))))
    perm = torch.randperm(R * B, device=device).to(torch.int32) + 1
    return [perm[r * B:(r + 1) * B].contiguous() for r in range(R)], R * B + 1


# ---------------------------------------------------------------------------- correctness gates


def check_decode() -> list[str]:
    from linrnn_kernels.gdn import decode, naive

    errors = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1e-2)):
        for B in (1, 3, 64):
            mask = head_mask(0.5)
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, dtype)
            f32, bf, isb, loc = make_pools(mask, B + 2)
            idx = (torch.randperm(B + 1, device=DEVICE)[:B] + 1).to(torch.int32)
            rf, rb = f32.clone(), bf.clone()
            o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, rf, rb, isb, loc, idx)
            o = decode.gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx)
            errs = (rel(o, o_ref), rel(f32, rf), rel(bf, rb))
            if not (errs[0] <= tol and errs[1] <= 1e-5 and errs[2] <= 1e-2):
                errors.append(f"decode {dtype} B={B}: rel err o/f32/bf16 = {errs}")
    return errors


def check_prefill(precisions) -> list[str]:
    from linrnn_kernels.gdn import naive, prefill

    errors = []
    lens = [1, 63, 64, 65, 300]
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    cases = [(torch.float32, "ieee", 1e-5)] + [(ACT, p, 1e-2) for p in precisions]
    for dtype, prec, tol in cases:
        mask = head_mask(0.5)
        q, k, v, a, b, A_log, dt_bias = make_step_inputs(sum(lens), dtype)
        f32, bf, isb, loc = make_pools(mask, len(lens) + 1)
        idx = torch.arange(1, len(lens) + 1, dtype=torch.int32, device=DEVICE)
        rf, rb = f32.clone(), bf.clone()
        o_ref = naive.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, rf, rb, isb, loc, idx)
        o = prefill.gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, f32, bf, isb, loc, idx, precision=prec)
        errs = (rel(o, o_ref), rel(f32, rf), rel(bf, rb))
        if not (errs[0] <= tol and errs[1] <= tol and errs[2] <= 1e-2):
            errors.append(f"prefill {dtype} precision={prec}: rel err o/f32/bf16 = {errs}")
    return errors


# ---------------------------------------------------------------------------- ours


def bench_decode(B: int, f32_fraction: float, iters: int, config=None) -> dict:
    from linrnn_kernels.gdn.conv import conv1d_decode
    from linrnn_kernels.gdn.decode import decode_config, gdn_decode

    mask = head_mask(f32_fraction)
    nbytes = decode_bytes(B, mask)
    sets, slots = rotation_sets(B, nbytes)
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
    f32, bf, isb, loc = make_pools(mask, slots)
    cfg = config or decode_config(B, HV, DK, DV, q.device)
    row = dict(B=B, f32_fraction=f32_fraction, config=list(cfg), rotations=len(sets), bytes=nbytes)
    if config is not None:  # a sweep config: same output as the default config on the same state
        f0, b0 = f32.clone(), bf.clone()
        ref = gdn_decode(q, k, v, a, b, A_log, dt_bias, f0, b0, isb, loc, sets[0])
        out = gdn_decode(q, k, v, a, b, A_log, dt_bias, f32.clone(), bf.clone(), isb, loc, sets[0], config=cfg)
        if not rel(out, ref) <= 1e-3:
            return dict(row, status=f"FAILED correctness vs default config (rel {rel(out, ref):.2e}): not timed")
    ms = time_graph([lambda s=s: gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, s, config=cfg)
                     for s in sets], iters)
    row.update(us=ms * 1e3, gbs=nbytes / (ms * 1e-3) / 1e9)
    if f32_fraction == 1.0 and config is None:  # the companion conv kernel, same rotation
        x = torch.randn(B, C, device=DEVICE).to(ACT)
        w = torch.randn(C, CONV_K, device=DEVICE).to(ACT)
        cst = torch.randn(slots, CONV_K - 1, C, device=DEVICE).to(ACT)
        cms = time_graph([lambda s=s: conv1d_decode(x, w, cst, s) for s in sets], iters)
        row["conv_us"] = cms * 1e3
        row["conv_gbs"] = (B * C * ACT.itemsize * (2 * (CONV_K - 1) + 2) + C * CONV_K * 2) / (cms * 1e-3) / 1e9
    return row


def parse_shape(s: str) -> tuple[int, int]:
    B, L = s.lower().split("x")
    return int(B), int(L)


def bench_prefill(B: int, L: int, precision: str, config=None) -> dict:
    from linrnn_kernels.gdn.conv import conv1d_varlen
    from linrnn_kernels.gdn.prefill import gdn_prefill

    T = B * L
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(T)
    f32, bf, isb, loc = make_pools([False] * HV, B + 1)
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE)
    row = dict(shape=f"{B}x{L}", tokens=T, precision=precision, config=config or {})

    def run(cfg=None):
        return gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, f32, bf, isb, loc, idx, precision=precision, config=cfg)

    if config:
        saved = f32.clone()
        ref = run()
        f32.copy_(saved)
        out = run(config)
        f32.copy_(saved)
        if not rel(out, ref) <= 1e-2:
            return dict(row, status=f"FAILED correctness vs default config (rel {rel(out, ref):.2e}): not timed")
    ms = time_eager(lambda: run(config))
    row.update(ms=ms, tok_s=T / (ms * 1e-3))
    if not config and precision == "bf16":
        x = torch.randn(T, C, device=DEVICE).to(ACT)
        w = torch.randn(C, CONV_K, device=DEVICE).to(ACT)
        cst = torch.randn(B + 1, CONV_K - 1, C, device=DEVICE).to(ACT)
        cms = time_eager(lambda: conv1d_varlen(x, w, cst, cu, idx))
        row["conv_ms"], row["conv_tok_s"] = cms, T / (cms * 1e-3)
    return row


# ---------------------------------------------------------------------------- fla peer (child process)


def import_fla(fla_path: str | None):
    if fla_path:
        sys.path.insert(0, os.path.abspath(fla_path))
    try:
        import einops  # noqa: F401
    except ImportError:  # fla imports einops at module level; the forward paths timed here never call it
        stub = types.ModuleType("einops")

        def _unavailable(*a, **k):
            raise NotImplementedError("einops is stubbed in this benchmark")

        stub.rearrange = stub.reduce = stub.repeat = stub.einsum = stub.pack = stub.unpack = _unavailable
        sys.modules["einops"] = stub
    import fla
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule

    return fla.__version__, fused_recurrent_gated_delta_rule, chunk_gated_delta_rule


def peer_decode(B: int, iters: int, fla_path: str | None) -> dict:
    from linrnn_kernels.gdn.decode import gdn_decode

    version, fused_recurrent, _ = import_fla(fla_path)
    mask = [False] * HV
    nbytes = decode_bytes(B, mask)
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
    R = max(2, min(64, math.ceil(L2_ROTATE_BYTES / nbytes)))
    h0 = [0.3 * torch.randn(B, HV, DK, DV, device=DEVICE) for _ in range(R)]
    fq, fk, fv = q.unsqueeze(1).contiguous(), k.unsqueeze(1).contiguous(), v.unsqueeze(1).contiguous()
    fa, fb = a.unsqueeze(1).contiguous(), b.unsqueeze(1).contiguous()

    def call(h):
        return fused_recurrent(fq, fk, fv, g=fa, beta=fb, scale=DK ** -0.5, initial_state=h, output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias,
                               use_beta_sigmoid_in_kernel=True)

    # equivalence with ours on the same data
    o_fla, ht = call(h0[0])
    pool = torch.cat([torch.zeros(1, HV, DK, DV, device=DEVICE), h0[0]])
    empty = torch.empty(B + 1, 0, DK, DV, dtype=torch.bfloat16, device=DEVICE)
    o_ours = gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, empty, torch.zeros(HV, dtype=torch.int32, device=DEVICE),
                        torch.arange(HV, dtype=torch.int32, device=DEVICE),
                        torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE))
    res = dict(fla=version, rel_err_o=rel(o_fla[:, 0], o_ours), rel_err_state=rel(ht, pool[1:]), rotations=R)
    try:
        ms = time_graph([lambda h=h: call(h) for h in h0], iters)
        res["timing"] = "graph"
    except Exception as e:  # noqa: BLE001  (fla's wrapper may not be capturable)
        res["graph_error"] = f"{type(e).__name__}: {str(e)[:200]}"
        ms = time_eager(lambda: call(h0[0]))
        res["timing"] = "eager"
    torch.cuda.synchronize()
    res.update(us=ms * 1e3, gbs=nbytes / (ms * 1e-3) / 1e9)
    return res


def peer_prefill(B: int, L: int, fla_path: str | None) -> dict:
    from linrnn_kernels.gdn.prefill import gdn_prefill

    version, _, chunk = import_fla(fla_path)
    T = B * L
    q, k, v, a, b, A_log, dt_bias = make_step_inputs(T)
    h0 = 0.3 * torch.randn(B, HV, DK, DV, device=DEVICE)
    cu = torch.arange(0, T + 1, L, dtype=torch.int32, device=DEVICE)
    fq, fk, fv = q.unsqueeze(0).contiguous(), k.unsqueeze(0).contiguous(), v.unsqueeze(0).contiguous()
    fa, fb = a.unsqueeze(0).contiguous(), b.unsqueeze(0).contiguous()

    def call():
        return chunk(fq, fk, fv, g=fa, beta=fb, scale=DK ** -0.5, initial_state=h0, output_final_state=True,
                     use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, cu_seqlens=cu.long(),
                     use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias)

    o_fla, ht = call()
    pool = torch.cat([torch.zeros(1, HV, DK, DV, device=DEVICE), h0])
    empty = torch.empty(B + 1, 0, DK, DV, dtype=torch.bfloat16, device=DEVICE)
    o_ours = gdn_prefill(q, k, v, a, b, A_log, dt_bias, cu, pool, empty,
                         torch.zeros(HV, dtype=torch.int32, device=DEVICE),
                         torch.arange(HV, dtype=torch.int32, device=DEVICE),
                         torch.arange(1, B + 1, dtype=torch.int32, device=DEVICE))
    res = dict(fla=version, rel_err_o=rel(o_fla[0], o_ours), rel_err_state=rel(ht, pool[1:]))
    ms = time_eager(call)
    res.update(ms=ms, tok_s=T / (ms * 1e-3))
    return res


def run_peer(kind: str, arg: str, args) -> dict:
    """Run one peer measurement in a child process; a crash (e.g. an illegal memory access) is reported."""
    cmd = [sys.executable, os.path.abspath(__file__), "--peer", f"{kind}:{arg}", "--iters", str(args.iters)]
    if args.fla_path:
        cmd += ["--fla-path", args.fla_path]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return {"status": "error: timed out after 300 s"}
    for line in reversed(out.stdout.splitlines()):
        if line.startswith("PEER_JSON "):
            return json.loads(line[len("PEER_JSON "):])
    tail = (out.stderr.strip().splitlines() or ["(no stderr)"])[-1]
    return {"status": f"error (exit {out.returncode}): {tail[:300]}"}


# ---------------------------------------------------------------------------- resources (no GPU)


_DTYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i64"}


class _Capture:
    def __init__(self, fn, log):
        self.fn, self.log = fn, log

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append((self.fn, grid, a, kw))


def captured_launches(mod, names, call) -> list:
    """Run call() with the Triton kernels `names` of module mod replaced by recorders (no GPU needed): the
    (kernel, grid, args, kwargs) of every launch it makes."""
    log, saved = [], {n: getattr(mod, n) for n in names}
    for n in names:
        setattr(mod, n, _Capture(saved[n], log))
    try:
        call()
    finally:
        for n, f in saved.items():
            setattr(mod, n, f)
    return log


def compile_sm90(fn, args, kw):
    """triton.compile one captured launch for sm_90 as the JIT specializes it (tensors 16-byte aligned, ints
    equal to 1 constant, multiples of 16 marked divisible); no GPU needed. Call outside TRITON_INTERPRET."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kw = dict(kw)
    opts = {k: kw.pop(k) for k in ("num_warps", "num_stages", "maxnreg") if k in kw}
    opts = {k: v for k, v in opts.items() if v is not None}
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        if p.is_constexpr:
            sig[name], consts[(i,)] = "constexpr", kw[name]
            continue
        v = args[i] if i < len(args) else kw[name]
        if isinstance(v, torch.Tensor):
            sig[name], attrs[(i,)] = "*" + _DTYPES[v.dtype], [["tt.divisibility", 16]]
        elif v is None:
            sig[name], consts[(i,)] = "constexpr", None
        elif isinstance(v, int) and v == 1:
            sig[name], consts[(i,)] = "constexpr", 1
        elif isinstance(v, int):
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "fp32"
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options=opts), opts


def resources() -> None:
    """Compile every kernel / config for sm_90 with Triton's bundled ptxas and print registers, spills
    and shared memory (what bounds occupancy), without a GPU."""
    import re
    import tempfile

    os.environ.pop("TRITON_INTERPRET", None)
    from linrnn_kernels.gdn import conv, decode, prefill

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the ptxas triton compiles with (the plain bin/ptxas can be older than its PTX)

    def compile_and_report(label, fn, grid, args, kw):
        k, opts = compile_sm90(fn, args, kw)
        with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
            f.write(k.asm["ptx"])
        info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull], capture_output=True,
                              text=True).stderr
        os.unlink(f.name)
        regs = re.search(r"Used (\d+) registers", info)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
        print(f"{label:44s} {fn.__name__:28s} grid={str(grid):14s} warps={opts.get('num_warps', 4)} "
              f"regs={regs.group(1) if regs else '?'} spill st/ld={spill.groups() if spill else '?'} "
              f"smem={k.metadata.shared}", flush=True)

    cpu = dict(device="cpu")
    for B in (1, 64):
        for cfg in [None] + DECODE_SWEEP:
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, **cpu)
            f32, bf, isb, loc = make_pools(head_mask(0.5), B + 1, **cpu)
            idx = torch.arange(1, B + 1, dtype=torch.int32)
            for fn, grid, a_, kw in captured_launches(decode, ["_gdn_decode_kernel"], lambda: decode.gdn_decode(
                    q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, config=cfg)):
                compile_and_report(f"decode B={B} config={cfg}", fn, grid, a_, kw)
    T, lens = 200, [100, 100]
    cu = torch.tensor([0, 100, 200], dtype=torch.int32)
    for prec in ("bf16", "tf32", "tf32x3"):
        for cfg in PREFILL_SWEEP:
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(T, **cpu)
            f32, bf, isb, loc = make_pools(head_mask(0.5), 3, **cpu)
            idx = torch.tensor([1, 2], dtype=torch.int32)
            names = ["_chunk_wy_kernel", "_chunk_state_kernel", "_chunk_output_kernel"]
            for fn, grid, a_, kw in captured_launches(prefill, names, lambda: prefill.gdn_prefill(
                    q, k, v, a, b, A_log, dt_bias, cu, f32, bf, isb, loc, idx, precision=prec, config=cfg)):
                compile_and_report(f"prefill {prec} {cfg}", fn, grid, a_, kw)
    x = torch.randn(T, C).to(ACT)
    w = torch.randn(C, CONV_K).to(ACT)
    cst = torch.zeros(3, CONV_K - 1, C).to(ACT)
    names = ["_conv1d_decode_kernel", "_conv1d_varlen_kernel", "_conv_state_update_kernel"]
    for fn, grid, a_, kw in captured_launches(conv, names, lambda: (
            conv.conv1d_varlen(x, w, cst, cu, torch.tensor([1, 2], dtype=torch.int32)),
            conv.conv1d_decode(x[:2], w, cst, torch.tensor([1, 2], dtype=torch.int32)))):
        compile_and_report("conv", fn, grid, a_, kw)


# ---------------------------------------------------------------------------- reporting


def _f(x, fmt="{:.1f}"):
    return fmt.format(x) if isinstance(x, (int, float)) and math.isfinite(x) else "-"


def markdown(res: dict) -> str:
    info, copy = res["env"], res["copy_gbs"]
    hyb = res["hybrid_fractions"]
    L = [f"# GDN kernels: Qwen3.5-35B-A3B shapes (Hk {HK}, Hv {HV}, Dk {DK}, Dv {DV}), bf16 activations", "",
         f"{info.get('gpu', '?')} · torch {info['torch']} · triton {info.get('triton')} · "
         f"commit {info.get('commit', '?')[:12]} · {info['date']}", "",
         f"Copy bandwidth (same run): {copy:.0f} GB/s. Decode: median us per layer call (CUDA-graph replays, "
         f"state slots rotated so that >= {L2_ROTATE_BYTES >> 20} MB are touched per replay); GB/s of the bytes "
         "that must move; hybrid 'pred' = f * t_f32 + (1 - f) * t_bf16.", ""]
    if res.get("check_errors"):
        L += ["**Correctness check failed; nothing was timed:**", ""] + [f"- {e}" for e in res["check_errors"]]
        return "\n".join(L) + "\n"
    head = ["B", "f32 us", "f32 GB/s", "f32 % copy", "bf16 us", "bf16 % copy"]
    for f in hyb:
        head += [f"{f:.0%} f32 us", "pred us", "meas/pred"]
    head += ["fla us", "fla % copy", "ours vs fla", "fla vs ours err (o / state)", "conv us"]
    L += ["## Decode", "", "| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for r in res["decode"]:
        f32, b16 = r["modes"]["1.0"], r["modes"]["0.0"]
        cells = [str(r["B"]), _f(f32.get("us")), _f(f32.get("gbs"), "{:.0f}"),
                 _f(100 * f32["gbs"] / copy if "gbs" in f32 else None, "{:.0f} %"), _f(b16.get("us")),
                 _f(100 * b16["gbs"] / copy if "gbs" in b16 else None, "{:.0f} %")]
        for f in hyb:
            h = r["modes"][str(f)]
            pred = f * f32["us"] + (1 - f) * b16["us"] if "us" in f32 and "us" in b16 else None
            cells += [_f(h.get("us")), _f(pred), _f(h["us"] / pred if pred and "us" in h else None, "{:.2f}")]
        p = r.get("fla", {})
        if "us" in p:
            cells += [_f(p["us"]), _f(100 * p["gbs"] / copy, "{:.0f} %"), _f(p["us"] / f32["us"], "{:.2f}x"),
                      f"{p['rel_err_o']:.1e} / {p['rel_err_state']:.1e}"]
        else:
            cells += [p.get("status", "-"), "-", "-", "-"]
        cells.append(_f(f32.get("conv_us")))
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "## Prefill (chunked, varlen)", "",
          "| B x L | tokens | " + " | ".join(f"ours {p} tok/s" for p in res["precisions"])
          + " | fla tok/s | ours (bf16) vs fla | fla vs ours err (o / state) | conv tok/s |",
          "|---|---:|" + "---:|" * (len(res["precisions"]) + 4)]
    for r in res["prefill"]:
        cells = [r["shape"], str(r["tokens"])] + [_f(r["ours"][p].get("tok_s"), "{:.3g}") for p in res["precisions"]]
        p = r.get("fla", {})
        main = r["ours"].get(res["precisions"][0], {})
        if "tok_s" in p:
            cells += [_f(p["tok_s"], "{:.3g}"), _f(main.get("tok_s", 0) / p["tok_s"], "{:.2f}x"),
                      f"{p['rel_err_o']:.1e} / {p['rel_err_state']:.1e}"]
        else:
            cells += [p.get("status", "-"), "-", "-"]
        cells.append(_f(r.get("conv_tok_s"), "{:.3g}"))
        L.append("| " + " | ".join(cells) + " |")
    L += ["", "## Targets", ""] + [f"- {t}" for t in res["targets"]]
    if res.get("sweep"):
        L += ["", "## Sweep", "", "| kernel | case | config | time | note |", "|---|---|---|---:|---|"]
        for s in res["sweep"]:
            L.append(f"| {s['kernel']} | {s['case']} | {s['config']} | {s.get('time', '-')} | {s.get('status', '')} |")
    return "\n".join(L) + "\n"


def targets(res: dict) -> list[str]:
    out, copy = [], res["copy_gbs"]
    for r in res["decode"]:
        f32, b16 = r["modes"]["1.0"], r["modes"]["0.0"]
        if r["B"] >= 64 and "gbs" in f32:
            pct = 100 * f32["gbs"] / copy
            out.append(f"decode B={r['B']} f32 state: {pct:.0f} % of copy bandwidth (target >= 85 %): "
                       + ("PASS" if pct >= 85 else "MISS"))
            p = r.get("fla", {})
            if "us" in p:
                x = p["us"] / f32["us"]
                out.append(f"decode B={r['B']}: {x:.2f}x fla (target >= 1.2x): " + ("PASS" if x >= 1.2 else "MISS"))
        for f in res["hybrid_fractions"]:
            h = r["modes"][str(f)]
            if "us" in h and "us" in f32 and "us" in b16:
                ratio = h["us"] / (f * f32["us"] + (1 - f) * b16["us"])
                out.append(f"decode B={r['B']} hybrid {f:.0%} f32: {ratio:.2f} of the bytes-proportional prediction "
                           "(target within 10 %): " + ("PASS" if abs(ratio - 1) <= 0.10 else "MISS"))
    for r in res["prefill"]:
        p, main = r.get("fla", {}), r["ours"].get(res["precisions"][0], {})
        if "tok_s" in p and "tok_s" in main:
            x = main["tok_s"] / p["tok_s"]
            out.append(f"prefill {r['shape']}: {x:.2f}x fla (target >= 0.9x): " + ("PASS" if x >= 0.9 else "MISS"))
    return out


# ---------------------------------------------------------------------------- main


def run(args) -> int:
    if args.resources:
        resources()
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("the GDN kernel benchmark needs a CUDA GPU (or use --resources)")
    if args.peer:
        kind, arg = args.peer.split(":")
        res = peer_decode(int(arg), args.iters, args.fla_path) if kind == "decode" else \
            peer_prefill(*parse_shape(arg), args.fla_path)
        print("PEER_JSON " + json.dumps(res), flush=True)
        return 0

    batches = [int(x) for x in args.batches.split(",") if x]
    hyb = [float(x) for x in args.hybrid.split(",") if x]
    precisions = [p for p in args.precisions.split(",") if p]
    res = {"env": env_info(), "shapes": dict(Hk=HK, Hv=HV, Dk=DK, Dv=DV, conv_dim=C), "hybrid_fractions": hyb,
           "precisions": precisions, "decode": [], "prefill": [], "sweep": []}
    shapes = [x for x in args.prefill.split(",") if x]
    # check what is about to be timed (the f32 "ieee" prefill check compiles slowly: only when timing prefill)
    res["check_errors"] = (check_decode() if batches else []) + (check_prefill(precisions) if shapes else [])
    res["copy_gbs"] = copy_bandwidth_gbs(DEVICE)
    print(f"copy bandwidth {res['copy_gbs']:.0f} GB/s", flush=True)
    if not res["check_errors"]:
        for B in batches:
            row = {"B": B, "modes": {}}
            for f in [1.0, 0.0] + hyb:
                row["modes"][str(f)] = bench_decode(B, f, args.iters)
                print(f"decode B={B} f32={f:.0%}: {row['modes'][str(f)].get('us', 0):.1f} us", flush=True)
            if not args.no_peer:
                row["fla"] = run_peer("decode", str(B), args)
                print(f"  fla: {row['fla']}", flush=True)
            res["decode"].append(row)
            if args.sweep:
                for f, name in ((1.0, "f32"), (0.0, "bf16")):
                    for cfg in DECODE_SWEEP:
                        if DV % cfg[0]:
                            continue
                        s = bench_decode(B, f, args.iters, config=cfg)
                        pct = f" ({100 * s['gbs'] / res['copy_gbs']:.0f} % copy)" if "gbs" in s else ""
                        res["sweep"].append(dict(kernel="decode", case=f"B={B} {name}", config=str(cfg),
                                                 time=f"{s['us']:.1f} us{pct}" if "us" in s else "-",
                                                 status=s.get("status", "")))
                        print(f"  sweep B={B} {name} {cfg}: {res['sweep'][-1]['time']}", flush=True)
        for shape in shapes:
            B, L = parse_shape(shape)
            row = {"shape": shape, "tokens": B * L, "ours": {}}
            for p in precisions:
                r = bench_prefill(B, L, p)
                row["ours"][p] = r
                if "conv_tok_s" in r:
                    row["conv_tok_s"] = r["conv_tok_s"]
                print(f"prefill {shape} {p}: {r.get('tok_s', 0):.3g} tok/s", flush=True)
            if not args.no_peer:
                row["fla"] = run_peer("prefill", shape, args)
                print(f"  fla: {row['fla']}", flush=True)
            res["prefill"].append(row)
            if args.sweep:
                for cfg in PREFILL_SWEEP[1:]:
                    s = bench_prefill(B, L, precisions[0], config=cfg)
                    res["sweep"].append(dict(kernel=f"prefill {precisions[0]}", case=shape, config=json.dumps(cfg),
                                             time=f"{s['ms']:.3f} ms" if "ms" in s else "-",
                                             status=s.get("status", "")))
        res["targets"] = targets(res)
    md = markdown(res)
    print(md)
    os.makedirs(args.out, exist_ok=True)
    part = "gdn_kernels" if batches and shapes else "gdn_decode" if batches else "gdn_prefill"
    base = os.path.join(args.out, part + ("_sweep" if args.sweep else ""))
    with open(base + ".md", "w") as f:
        f.write(md)
    with open(base + ".json", "w") as f:
        json.dump(res, f, indent=1, default=str)
    print(f"wrote {base}.md and {base}.json")
    return 1 if res["check_errors"] else 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
