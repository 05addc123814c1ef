"""GDN decode, bf16 state partition round 4 (issue #15 item 4): a variant of the decode kernel with per-partition
launch shapes, swept on the GPU against the current kernel (kernels/gdn/decode.py) in one run.

The variant kernel reuses decode.py's tile code (`_head_update`, `_natural_head`) and only changes how programs
map to tiles, per partition:
  bv      the partition's tile width ([Dk, bv]; the bf16 partition's blocked layout makes [Dk, 128] the whole head,
          one contiguous 32 KB run)
  tpp     consecutive tiles per program (2: a whole bf16 head, 4: two heads; contiguous in the bf16 pool)
  stages  0: the tpp tiles unrolled (static_range); S >= 1: a tl.range loop with num_stages=S (Triton pipelines
          the next tile's loads through shared memory)
  parts   which partitions the compiled kernel holds (registers are the max over the branches it holds)
A hybrid state can run as one partition-major launch (both partitions share num_warps / maxnreg) or as two
launches ("split": each partition compiled for its dtype with its own num_warps / maxnreg).

  python tools/gdn_r4_sweep.py --resources           # sm_90 registers / spills per variant, no GPU
  python tools/gdn_r4_sweep.py --out DIR             # check vs the naive reference, then time (GPU)
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
import triton
import triton.language as tl

from linrnn_kernels.gdn.common import check_pools, check_qkv, gates, rows_view, state_tile_base, state_tile_offsets
from linrnn_kernels.gdn.decode import _head_update, _hints, _natural_head, decode_config, gdn_decode
from linrnn_kernels.gdn.layout import bf16_block

try:  # programmatic dependent launch (triton >= 3.4)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def _add2(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _add3(a0, a1, a2, b0, b1, b2):
    return a0 + b0, a1 + b1, a2 + b2


@triton.jit
def _head_update_pdl(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_hk, i_v,
                     stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_a_tok, stride_b_tok, scale,
                     HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BLOCK: tl.constexpr,
                     LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr,
                     STORE_CACHE: tl.constexpr):
    """decode._head_update with the state tile loaded before gdc_wait (the state does not come from the kernel
    before; q / k / v / gates do)."""
    o_k = tl.arange(0, DK)
    o_v = i_v * BV + tl.arange(0, BV)
    offs = state_tile_offsets(i_v, BV, DK, DV, BLOCK)
    if BLOCK != 0:
        base = base + state_tile_base(i_v, BV, DK, BLOCK)
    ptrs = tl.max_contiguous(pool + base + offs, [1, 4])
    s = tl.load(ptrs, eviction_policy=LOAD_EVICT, cache_modifier=LOAD_CACHE).to(tl.float32)
    gdc_wait()
    b_q = tl.load(q + i_b * stride_q_tok + i_hk * stride_q_head + o_k).to(tl.float32)
    b_k = tl.load(k + i_b * stride_k_tok + i_hk * stride_k_head + o_k).to(tl.float32)
    b_v = tl.load(v + i_b * stride_v_tok + i_h * stride_v_head + o_v).to(tl.float32)
    g, beta = gates(tl.load(a + i_b * stride_a_tok + i_h), tl.load(b + i_b * stride_b_tok + i_h),
                    tl.load(A_log + i_h).to(tl.float32), tl.load(dt_bias + i_h).to(tl.float32))
    decay = tl.exp(g)
    qq, kk, kq = tl.reduce((b_q * b_q, b_k * b_k, b_q * b_k), 0, _add3)
    r_q = tl.rsqrt(qq + 1e-6) * scale
    r_k = tl.rsqrt(kk + 1e-6)
    sk, sq = tl.reduce((s * b_k[:, None], s * b_q[:, None]), 0, _add2)
    u = beta * (b_v - decay * r_k * sk)
    b_o = decay * r_q * sq + (kq * r_k * r_q) * u
    s = s * decay + (b_k * r_k)[:, None] * u[None, :]
    tl.store(o + (i_b * HV + i_h) * DV + o_v, b_o.to(o.dtype.element_ty))
    tl.store(ptrs, s.to(pool.dtype.element_ty), eviction_policy=STORE_EVICT, cache_modifier=STORE_CACHE)


@triton.jit
def _tile_program(pp, n_heads, stride_slot, pool, IS_BF16: tl.constexpr, q, k, v, a, b, A_log, dt_bias, o,
                  head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                  stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV: tl.constexpr,
                  GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BF16_BLOCK: tl.constexpr,
                  LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr, STORE_EVICT: tl.constexpr,
                  STORE_CACHE: tl.constexpr, PDL: tl.constexpr):
    NV: tl.constexpr = DV // BV
    i_v = pp % NV
    r = pp // NV
    j = r % n_heads
    i_b = (r // n_heads).to(tl.int64)
    base = tl.load(state_indices + i_b).to(tl.int64) * stride_slot + j.to(tl.int64) * (DK * DV)
    i_h = _natural_head(head_is_bf16, head_local, j, IS_BF16, HV)
    if PDL:
        _head_update_pdl(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_h // GROUP, i_v,
                         stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                         stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, BF16_BLOCK if IS_BF16 else 0, LOAD_EVICT,
                         LOAD_CACHE, STORE_EVICT, STORE_CACHE)
    else:
        _head_update(q, k, v, a, b, A_log, dt_bias, pool, base, o, i_b, i_h, i_h // GROUP, i_v,
                     stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_a_tok, stride_b_tok, scale, HV, DK, DV, BV, BF16_BLOCK if IS_BF16 else 0, LOAD_EVICT,
                     LOAD_CACHE, STORE_EVICT, STORE_CACHE)


@triton.jit
def _partition(p, n_heads, stride_slot, pool, IS_BF16: tl.constexpr, q, k, v, a, b, A_log, dt_bias, o,
               head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
               stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV: tl.constexpr, GROUP: tl.constexpr,
               DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, TPP: tl.constexpr, STAGES: tl.constexpr,
               BF16_BLOCK: tl.constexpr, LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr,
               STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr, PDL: tl.constexpr):
    if STAGES == 0:
        for t in tl.static_range(TPP):
            _tile_program(p * TPP + t, n_heads, stride_slot, pool, IS_BF16, q, k, v, a, b, A_log, dt_bias, o,
                          head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                          stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP,
                          DK, DV, BV, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, PDL)
    else:
        for t in tl.range(0, TPP, num_stages=STAGES):
            _tile_program(p * TPP + t, n_heads, stride_slot, pool, IS_BF16, q, k, v, a, b, A_log, dt_bias, o,
                          head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                          stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP,
                          DK, DV, BV, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, PDL)


@triton.jit
def _r4_kernel(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
               stride_q_tok, stride_q_head, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
               stride_a_tok, stride_b_tok, stride_f32_slot, stride_bf16_slot,
               n_f32_heads, n_bf16_heads, n_f32_programs, first_program, scale,
               HV: tl.constexpr, GROUP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BF16_BLOCK: tl.constexpr,
               PARTS: tl.constexpr, BV_F: tl.constexpr, BV_B: tl.constexpr, TPP_B: tl.constexpr,
               STAGES_B: tl.constexpr, LOAD_EVICT: tl.constexpr, LOAD_CACHE: tl.constexpr,
               STORE_EVICT: tl.constexpr, STORE_CACHE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # the next kernel may launch now; it waits for this one before reading o
        gdc_launch_dependents()
    pid = tl.program_id(0) + first_program
    if PARTS == 1:
        _partition(pid, n_f32_heads, stride_f32_slot, ssm_f32, False, q, k, v, a, b, A_log, dt_bias, o,
                   head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok, stride_k_head,
                   stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP, DK, DV, BV_F, 1, 0,
                   BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, PDL)
    elif PARTS == 2:
        _partition(pid - n_f32_programs, n_bf16_heads, stride_bf16_slot, ssm_bf16, True, q, k, v, a, b, A_log,
                   dt_bias, o, head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                   stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP, DK, DV,
                   BV_B, TPP_B, STAGES_B, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, PDL)
    else:
        if pid < n_f32_programs:
            _partition(pid, n_f32_heads, stride_f32_slot, ssm_f32, False, q, k, v, a, b, A_log, dt_bias, o,
                       head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head, stride_k_tok,
                       stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale, HV, GROUP, DK, DV,
                       BV_F, 1, 0, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT, STORE_CACHE, PDL)
        else:
            _partition(pid - n_f32_programs, n_bf16_heads, stride_bf16_slot, ssm_bf16, True, q, k, v, a, b, A_log,
                       dt_bias, o, head_is_bf16, head_local, state_indices, stride_q_tok, stride_q_head,
                       stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, stride_a_tok, stride_b_tok, scale,
                       HV, GROUP, DK, DV, BV_B, TPP_B, STAGES_B, BF16_BLOCK, LOAD_EVICT, LOAD_CACHE, STORE_EVICT,
                       STORE_CACHE, PDL)


# a variant: bf16 partition's (bv, tpp, stages, num_warps, maxnreg, load hint), and split (two launches)
VARIANTS = {
    "pm 64x4": dict(bv=64, tpp=1, stages=0, warps=4),
    "pm 64x4 r96": dict(bv=64, tpp=1, stages=0, warps=4, maxnreg=96),
    "pm 64x4 r80": dict(bv=64, tpp=1, stages=0, warps=4, maxnreg=80),
    "pm 64x8": dict(bv=64, tpp=1, stages=0, warps=8),
    "pm 128x8 r128": dict(bv=128, tpp=1, stages=0, warps=8, maxnreg=128),
    "pm 64x8 r64": dict(bv=64, tpp=1, stages=0, warps=8, maxnreg=64),
    "pm 64x8 r80": dict(bv=64, tpp=1, stages=0, warps=8, maxnreg=80),
    "pm 64x4 t2": dict(bv=64, tpp=2, stages=0, warps=4),
    "pm 64x4 t4": dict(bv=64, tpp=4, stages=0, warps=4),
    "pm 64x4 pdl": dict(bv=64, tpp=1, stages=0, warps=4, pdl=True),
}


def r4_decode(q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, var: dict,
              split: bool = False, compile_only=None):
    """decode.gdn_decode with the variant's bf16 partition launch. f32 tiles: decode_config's (bv, warps, hints).
    split: one launch per partition; else one partition-major launch (the f32 programs share warps / maxnreg)."""
    B, Hk, Hv, Dk, Dv = check_qkv(q, k, v, a, b, A_log, dt_bias)
    check_pools(ssm_f32, ssm_bf16, head_is_bf16, head_local, Hv, Dk, Dv)
    q, k, v, a, b = (rows_view(t) for t in (q, k, v, a, b))
    o = torch.empty(B, Hv, Dv, dtype=v.dtype, device=v.device)
    f_cfg = decode_config(B, Hv, Dk, Dv, q.device)
    nf, nb = ssm_f32.shape[1], ssm_bf16.shape[1]
    bv_b = min(var["bv"], Dv)
    n_f = B * nf * (Dv // f_cfg.bv)
    n_b_tiles = B * nb * (Dv // bv_b)
    tpp = var.get("tpp", 1)
    if n_b_tiles % tpp:
        raise ValueError(f"{n_b_tiles} bf16 tiles do not split into programs of {tpp}")
    n_b = n_b_tiles // tpp
    hint = dict(**_hints("LOAD", var.get("load", f_cfg.load)), **_hints("STORE", var.get("store", f_cfg.store)))
    args = (q, k, v, a, b, A_log, dt_bias, ssm_f32, ssm_bf16, head_is_bf16, head_local, state_indices, o,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            a.stride(0), b.stride(0), ssm_f32.stride(0), ssm_bf16.stride(0), nf, nb, n_f)
    const = dict(HV=Hv, GROUP=Hv // Hk, DK=Dk, DV=Dv, BF16_BLOCK=bf16_block(Dv), BV_F=f_cfg.bv, BV_B=bv_b,
                 TPP_B=tpp, STAGES_B=var.get("stages", 0), PDL=bool(var.get("pdl")))
    if var.get("pdl"):
        const["launch_pdl"] = True
    f_launch = dict(num_warps=f_cfg.num_warps, **hint)
    b_launch = dict(num_warps=var["warps"], maxnreg=var.get("maxnreg"), **hint)
    launches = []
    if nf and nb and not split:
        launches.append(((n_f + n_b,), 0, 3, f_launch if var["warps"] == f_cfg.num_warps and not var.get("maxnreg")
                         else b_launch))
    else:
        if nf:
            launches.append(((n_f,), 0, 1, f_launch))
        if nb:
            launches.append(((n_b,), n_f, 2, b_launch))
    for grid, first, parts, kw in launches:
        kw = {key: val for key, val in kw.items() if val is not None}
        if compile_only is not None:
            compile_only.append((grid, args + (first, Dk ** -0.5), dict(const, PARTS=parts, **kw)))
        else:
            _r4_kernel[grid](*args, first, Dk ** -0.5, PARTS=parts, **const, **kw)
    return o


# ---------------------------------------------------------------------------- no GPU: registers


def resources(names) -> None:
    import re

    os.environ.pop("TRITON_INTERPRET", None)
    from triton.backends.nvidia.compiler import get_ptxas

    from linrnn_bench.kernels.gdn import compile_sm90, head_mask, make_pools, make_step_inputs

    ptxas = get_ptxas(90).path
    for name in names:
        var = VARIANTS[name]
        for f in (0.0, 0.5):
            for split in ((False, True) if f == 0.5 else (False,)):
                q, k, v, a, b, A_log, dt_bias = make_step_inputs(64, device="cpu")
                f32, bf, isb, loc = make_pools(head_mask(f), 65, device="cpu")
                idx = torch.arange(1, 65, dtype=torch.int32)
                launches = []
                r4_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, var, split, compile_only=launches)
                for grid, args, kw in launches:
                    kern, _ = compile_sm90(_r4_kernel, args, kw)
                    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as fh:
                        fh.write(kern.asm["ptx"])
                    info = subprocess.run([ptxas, "-v", "--gpu-name=sm_90a", fh.name, "-o", os.devnull],
                                          capture_output=True, text=True).stderr
                    os.unlink(fh.name)
                    regs = re.search(r"Used (\d+) registers", info)
                    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", info)
                    print(f"{name:18s} f32={f:.0%} split={split!s:5s} PARTS={kw['PARTS']} warps={kw['num_warps']} "
                          f"regs={regs.group(1) if regs else '?'} spill={spill.groups() if spill else '?'} "
                          f"smem={kern.metadata.shared}", flush=True)


# ---------------------------------------------------------------------------- GPU: check and time


def check(names, batches=(1, 8, 64)) -> list[str]:
    """Every variant vs the naive reference (fresh inputs, unused slots NaN-poisoned and untouched), and vs the
    current kernel: bit for bit where the bf16 tile is the same ([Dk, 64] on 4 warps)."""
    from linrnn_bench.kernels.gdn import DEVICE, head_mask, make_pools, make_step_inputs, rel
    from linrnn_kernels.gdn import naive

    bad = []
    for name in names:
        var = VARIANTS[name]
        for f in (0.0, 0.5, 1.0) if var.get("pdl") else (0.0, 0.5):
            for split in ((False, True) if f == 0.5 else (False,)):
                for B in batches:
                    q, k, v, a, b, A_log, dt_bias = make_step_inputs(B, seed=B + 3)
                    slots = B + 3
                    f32, bf, isb, loc = make_pools(head_mask(f, seed=B), slots)
                    idx = (torch.randperm(slots - 1, device=DEVICE)[:B] + 1).to(torch.int32)
                    dead = sorted(set(range(slots)) - set(idx.tolist()))
                    f32[dead], bf[dead] = float("nan"), float("nan")
                    fr, br, fc, bc = f32.clone(), bf.clone(), f32.clone(), bf.clone()
                    o_ref = naive.gdn_decode(q, k, v, a, b, A_log, dt_bias, fr, br, isb, loc, idx)
                    o_cur = gdn_decode(q, k, v, a, b, A_log, dt_bias, fc, bc, isb, loc, idx)
                    o = r4_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, idx, var, split)
                    live = idx.long()
                    e = (rel(o, o_ref), rel(f32[live], fr[live]) if f32.shape[1] else 0.0,
                         rel(bf[live], br[live]) if bf.shape[1] else 0.0)
                    untouched = bool(torch.isnan(f32[dead]).all() and torch.isnan(bf[dead].float()).all())
                    same = (torch.equal(o.view(torch.int16), o_cur.view(torch.int16))
                            and torch.equal(f32.view(torch.int32), fc.view(torch.int32))
                            and torch.equal(bf.view(torch.int16), bc.view(torch.int16)))
                    ok = e[0] <= 1e-2 and e[1] <= 1e-5 and e[2] <= 1e-2 and untouched
                    line = (f"{'ok' if ok else 'FAIL'} {name} f32={f:.0%} split={split} B={B}: vs naive "
                            f"{e[0]:.1e}/{e[1]:.1e}/{e[2]:.1e} untouched={untouched}; == current kernel: {same}")
                    print(line, flush=True)
                    if not ok:
                        bad.append(name)
    return bad


def bench(names, batches, fractions, iters, out) -> list[dict]:
    from linrnn_bench.kernels.common import copy_bandwidth_gbs, time_graph
    from linrnn_bench.kernels.gdn import (DEVICE, DK, DV, HV, L2_ROTATE_BYTES, decode_bytes, head_mask, make_pools,
                                          make_step_inputs, rotation_sets)

    copy = copy_bandwidth_gbs(DEVICE)
    print(f"copy bandwidth {copy:.0f} GB/s", flush=True)
    rows = []
    for f in fractions:
        for B in batches:
            mask = head_mask(f)
            nbytes = decode_bytes(B, mask)
            sets, slots = rotation_sets(B, nbytes)
            # "R8": 8 layer calls per graph instead of len(sets) (2 at B >= 64): how much of a call's time is the
            # graph launch, which the engine's step graph amortizes over every layer
            sets8, slots8 = rotation_sets(B, L2_ROTATE_BYTES // 8)
            q, k, v, a, b, A_log, dt_bias = make_step_inputs(B)
            f32, bf, isb, loc = make_pools(mask, max(slots, slots8))
            cands = [("current", None, False, sets), ("current R8", None, False, sets8)]
            for n in names:
                var = VARIANTS[n]
                if f == 1.0 and not var.get("pdl"):
                    continue
                cands.append((n, var, False, sets))
                if 0.0 < f < 1.0:
                    cands.append((n + " split", var, True, sets))
                if var.get("pdl"):
                    cands.append((n + " R8", var, False, sets8))
            for _pass in range(2):  # better of two interleaved passes
                for label, var, split, rot in cands:
                    if var and B * sum(mask) * (DV // min(var["bv"], DV)) % var.get("tpp", 1):
                        continue
                    if var is None:
                        fn = [lambda s=s: gdn_decode(q, k, v, a, b, A_log, dt_bias, f32, bf, isb, loc, s)
                              for s in rot]
                    else:
                        fn = [lambda s=s, var=var, split=split: r4_decode(q, k, v, a, b, A_log, dt_bias, f32, bf,
                                                                          isb, loc, s, var, split) for s in rot]
                    try:
                        us = time_graph(fn, iters) * 1e3
                    except Exception as e:  # noqa: BLE001 - a variant that does not compile is reported
                        print(f"ERROR {label} B={B} f32={f}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                        continue
                    pct = 100 * nbytes / (us * 1e-6) / 1e9 / copy
                    row = next((r for r in rows if r["label"] == label and r["B"] == B and r["f"] == f), None)
                    if row is None:
                        rows.append(row := dict(label=label, B=B, f=f, us=us, pct=pct))
                    elif us < row["us"]:
                        row.update(us=us, pct=pct)
            for r in rows:
                if r["B"] == B and r["f"] == f:
                    print(f"f32={f:.0%} B={B} {r['label']:24s} {r['us']:7.1f} us {r['pct']:5.1f} %", flush=True)
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "r4_sweep.json"), "w") as fh:
                json.dump(dict(copy_gbs=copy, rows=rows, shapes=dict(HV=HV, DK=DK, DV=DV)), fh, indent=1)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--batches", default="64,128,256,32")
    p.add_argument("--check-batches", default="64,32")
    p.add_argument("--fractions", default="0.0,0.5,1.0")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--resources", action="store_true")
    p.add_argument("--no-check", action="store_true")
    p.add_argument("--out", default="/tmp/out/r4")
    args = p.parse_args()
    names = [n for n in args.variants.split(",") if n]
    if args.resources:
        resources(names)
        return
    if not args.no_check:
        bad = set(check(names, [int(x) for x in args.check_batches.split(",")]))
        names = [n for n in names if n not in bad]
    bench(names, [int(x) for x in args.batches.split(",")], [float(x) for x in args.fractions.split(",")],
          args.iters, args.out)


if __name__ == "__main__":
    sys.exit(main())
