"""Skinny GEMM (kernels/gemv/skinny.py) and the fused router (kernels/moe/router_fused.py) vs their naive
compositions, on fresh random inputs with NaN-poisoned outputs and scratch (interpreter on CPU, small
shapes); sm_90 compile checks outside the interpreter."""
from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest
import torch

from helpers import KERNEL_DEVICE, rel_fro
from linrnn_kernels.gemv import config as gcfg
from linrnn_kernels.gemv import naive, skinny
from linrnn_kernels.quant import WeightTensor

DEV = KERNEL_DEVICE


@pytest.fixture
def poison_empty(monkeypatch):
    real = torch.empty

    def empty(*args, **kw):
        t = real(*args, **kw)
        if t.is_floating_point():
            t.fill_(math.nan)
        return t

    monkeypatch.setattr(torch, "empty", empty)


def _weight(n, k, fmt, dtype):
    if fmt == "fp8":
        data = (torch.randn(n, k, device=DEV) * 0.5).to(torch.float8_e4m3fn)
        return WeightTensor("fp8", data, None, (0.02 + 0.01 * torch.rand(n, device=DEV)).float())
    return WeightTensor("dense", (torch.randn(n, k, device=DEV) / math.sqrt(k)).to(dtype))


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 2e-2


CONFIGS = [gcfg.SkinnyConfig(16, 32, 1, use_dot=False), gcfg.SkinnyConfig(16, 32, 3, use_dot=False),
           gcfg.SkinnyConfig(32, 64, 2, use_dot=True)]


@pytest.mark.parametrize("cfg", CONFIGS, ids=["fma", "fma-split3", "dot-split2"])
@pytest.mark.parametrize("M", [1, 3, 9])
@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_plain_projection(poison_empty, cfg, M, fmt):
    dtype = torch.bfloat16
    N, K = 72, 160  # ragged N tile and K split
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = _weight(N, K, fmt, dtype)
    y = skinny.skinny_linear(x, w, cfg)
    ref = naive.skinny_linear(x, w)
    assert y.shape == (M, N) and not torch.isnan(y).any()
    assert rel_fro(y, ref) <= _tol(dtype)
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))


@pytest.mark.parametrize("cfg", CONFIGS[1:], ids=["fma-split3", "dot-split2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_epilogue_and_row_norm(poison_empty, cfg, dtype):
    """Shared-expert gate_up (silu_mul), and a down projection with the gate_add epilogue, residual add
    and the next RMSNorm."""
    M, H, I = 3, 96, 64
    x = torch.randn(M, H, device=DEV).to(dtype)
    w13 = _weight(2 * I, H, "dense", dtype)
    y = skinny.skinny_linear(x, w13, cfg, epilogue="silu_mul")
    ref = naive.skinny_linear(x, w13, epilogue="silu_mul")
    assert y.shape == (M, I) and rel_fro(y, ref) <= _tol(dtype)

    w2 = _weight(H, I, "dense", dtype)
    add, res = torch.randn(M, H, device=DEV).to(dtype), torch.randn(M, H, device=DEV).to(dtype)
    logits = torch.randn(M, 9, device=DEV).to(dtype)
    nw = (0.1 * torch.randn(H, device=DEV)).to(dtype)
    kw = dict(epilogue="gate_add", addend=add, gate_logit=logits[:, 8:], residual=res, norm_w=nw, norm_eps=1e-6)
    normed, h = skinny.skinny_linear(ref, w2, cfg, **kw)
    rnormed, rh = naive.skinny_linear(ref, w2, **kw)
    assert rel_fro(h, rh) <= _tol(dtype) and rel_fro(normed, rnormed) <= _tol(dtype)
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))


@pytest.mark.parametrize("cfg", CONFIGS, ids=["fma", "fma-split3", "dot-split2"])
def test_gate_add_combines_expert_partials(poison_empty, cfg):
    """The shared expert's down projection with the routed experts' uncombined partials [S, M * k, H] (f32) in
    place of their sum: equals sum_reduce + the gate_add / residual / norm chain."""
    dtype, M, H, I, S, k = torch.bfloat16, 3, 96, 64, 3, 4
    h = torch.randn(M, I, device=DEV).to(dtype)
    w2 = _weight(H, I, "dense", dtype)
    part = torch.randn(S, M * k, H, device=DEV)
    res = torch.randn(M, H, device=DEV).to(dtype)
    logits = torch.randn(M, 9, device=DEV).to(dtype)
    nw = (0.1 * torch.randn(H, device=DEV)).to(dtype)
    kw = dict(epilogue="gate_add", gate_logit=logits[:, 8:], residual=res, norm_w=nw)
    normed, hh = skinny.skinny_linear(h, w2, cfg, addend_parts=(part, k), **kw)
    rnormed, rh = naive.skinny_linear(h, w2, addend_parts=(part, k), **kw)
    assert rel_fro(hh, rh) <= _tol(dtype) and rel_fro(normed, rnormed) <= _tol(dtype)
    # the addend is exactly what the experts' own combine makes
    from linrnn_kernels.gemv import combine
    assert torch.equal(combine(part, k, dtype), naive.combine_parts(part, k, dtype))
    with pytest.raises(ValueError, match="addend_parts"):
        skinny.skinny_linear(h, w2, cfg, addend_parts=(part[:, :-1], k), **kw)


@pytest.mark.parametrize("prologue", ["rmsnorm", "gated_norm", "sigmoid_gate"])
def test_prologues(poison_empty, prologue):
    dtype = torch.bfloat16
    M, K, N, head = 2, 128, 40, 32
    cfg = gcfg.SkinnyConfig(16, 64, 2, use_dot=False)
    x = torch.randn(M, K, device=DEV).to(dtype)
    proj = torch.randn(M, K + 5, device=DEV).to(dtype)
    gate = proj[:, 5:]  # a strided view, as the GDN z
    if prologue == "sigmoid_gate":  # attention: per-head [q | gate] interleave
        gate = torch.randn(M, K // head, 2 * head, device=DEV).to(dtype)[..., head:]
    pro_w = (1 + 0.1 * torch.randn(head if prologue == "gated_norm" else K, device=DEV)).to(dtype)
    w = _weight(N, K, "dense", dtype)
    kw = dict(prologue_kind=prologue, gate=gate, pro_w=pro_w, head=head, pro_eps=1e-6)
    res = torch.randn(M, N, device=DEV).to(dtype)
    y = skinny.skinny_linear(x, w, cfg, residual=res, **kw)
    ref = naive.skinny_linear(x, w, residual=res, **kw)
    assert rel_fro(y, ref) <= _tol(dtype)


@pytest.mark.parametrize("M,cfg", [(1, gcfg.SkinnyConfig(1, 128, 1, 8, 1, False)),
                                   (3, gcfg.SkinnyConfig(2, 64, 2, 4, 1, False)),
                                   (20, gcfg.SkinnyConfig(1, 64, 1, 4, 1, False))],
                         ids=["1row-longk-8warps", "2rows-split2", "1row-72tiles-2chunks"])
def test_narrow_tiles_gated_norm_and_row_norm(poison_empty, M, cfg):
    """The sweep's narrow / long FMA tiles (1-2 weight rows, a program's whole K slice in one tile) with the
    out projection's fusions: gated-norm prologue, residual add, next RMSNorm; 72 tiles at 20 rows take two
    chunks of the row-norm's sum of shares (2048 / 32 rows)."""
    dtype, K, N, head = torch.bfloat16, 128, 72, 32
    x = torch.randn(M, K, device=DEV).to(dtype)
    z = torch.randn(M, K + 3, device=DEV).to(dtype)[:, 3:]
    kw = dict(prologue_kind="gated_norm", gate=z, pro_w=(1 + 0.1 * torch.randn(head, device=DEV)).to(dtype),
              head=head, residual=torch.randn(M, N, device=DEV).to(dtype),
              norm_w=(0.1 * torch.randn(N, device=DEV)).to(dtype))
    w = _weight(N, K, "dense", dtype)
    normed, h = skinny.skinny_linear(x, w, cfg, **kw)
    rnormed, rh = naive.skinny_linear(x, w, **kw)
    assert rel_fro(h, rh) <= 2e-2 and rel_fro(normed, rnormed) <= 2e-2
    assert not torch.isnan(normed).any() and not torch.isnan(h).any()
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))


ONE_SHOT_FMA = gcfg.SkinnyConfig(8, 64, 0, 4, 1, False, one_shot=True)
ONE_SHOT_DOT = gcfg.SkinnyConfig(16, 64, 0, 4, 1, True, one_shot=True)


@pytest.mark.parametrize("M,prologue,cfg", [(1, "gated_norm", ONE_SHOT_FMA), (8, "gated_norm", ONE_SHOT_FMA),
                                            (3, "sigmoid_gate", gcfg.SkinnyConfig(16, 128, 0, 4, 1, False, one_shot=True)),
                                            (8, "gated_norm", ONE_SHOT_DOT), (5, "sigmoid_gate", ONE_SHOT_DOT),
                                            (8, "gated_norm", dataclasses.replace(ONE_SHOT_DOT, split_prologue=True)),
                                            (3, "sigmoid_gate", dataclasses.replace(ONE_SHOT_FMA, split_prologue=True)),
                                            (2, "gated_norm", gcfg.SkinnyConfig(16, 32, 2, split_prologue=True))],
                         ids=["fma-1row-split2", "fma-8rows-split2", "fma-3rows-nosplit", "dot-8rows", "dot-5rows",
                              "dot-8rows-split-prologue", "fma-3rows-split-prologue", "looped-split-prologue"])
def test_one_shot_out_projection(poison_empty, M, prologue, cfg):
    """One-shot tiles (a program's whole K slice loaded at once, no K loop) with the out projections' fusions:
    gated-norm / sigmoid-gate prologue (in the kernel, or in its own launch: split_prologue), residual add, next
    RMSNorm; bit-reproducible; tickets left at 0."""
    dtype, K, N, head = torch.bfloat16, 128, 40, 32
    x = torch.randn(M, K, device=DEV).to(dtype)
    if prologue == "gated_norm":
        gate = torch.randn(M, K + 3, device=DEV).to(dtype)[:, 3:]
        pro_w = (1 + 0.1 * torch.randn(head, device=DEV)).to(dtype)
    else:  # attention: per-head [q | gate] interleave
        gate = torch.randn(M, K // head, 2 * head, device=DEV).to(dtype)[..., head:]
        pro_w = None
    kw = dict(prologue_kind=prologue, gate=gate, pro_w=pro_w, head=head,
              residual=torch.randn(M, N, device=DEV).to(dtype), norm_w=(0.1 * torch.randn(N, device=DEV)).to(dtype))
    w = _weight(N, K, "dense", dtype)
    normed, h = skinny.skinny_linear(x, w, cfg, **kw)
    rnormed, rh = naive.skinny_linear(x, w, **kw)
    assert not torch.isnan(normed).any() and not torch.isnan(h).any()
    assert rel_fro(h, rh) <= 2e-2 and rel_fro(normed, rnormed) <= 2e-2
    again = skinny.skinny_linear(x, w, cfg, **kw)
    assert torch.equal(again[0], normed) and torch.equal(again[1], h)
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))


@pytest.mark.parametrize("cfg", [ONE_SHOT_FMA, ONE_SHOT_DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("fmt", ["dense", "fp8"])
def test_one_shot_ragged_k_and_silu_mul(poison_empty, cfg, fmt):
    """One-shot tiles with a ragged last K slice (K = 160: slices 64, 64, 32) and the silu_mul epilogue (the gate
    and up rows both loaded before the wait), f32 and bf16 activations."""
    for dtype in (torch.float32, torch.bfloat16):
        M, K, I = 3, 160, 24
        x = torch.randn(M, K, device=DEV).to(dtype)
        w = _weight(2 * I, K, fmt, dtype)
        for epi in ("none", "silu_mul"):
            y = skinny.skinny_linear(x, w, cfg, epilogue=epi)
            ref = naive.skinny_linear(x, w, epilogue=epi)
            assert not torch.isnan(y).any() and rel_fro(y, ref) <= _tol(dtype), (dtype, epi)


@pytest.mark.parametrize("cfg", CONFIGS, ids=["fma", "fma-split3", "dot-split2"])
def test_conv_epilogue(poison_empty, cfg):
    """GDN in_proj with the causal conv + SiLU of the first C columns in the epilogue, conv state shifted in
    place for the live slots (slot 0, the padded rows' dummy, shared by two rows here)."""
    dtype, M, K, N, C, KC = torch.bfloat16, 4, 64, 72, 40, 4
    x = torch.randn(M, K, device=DEV).to(dtype)
    w = _weight(N, K, "dense", dtype)
    cw = (0.5 * torch.randn(C, KC, device=DEV)).to(dtype)
    state = torch.randn(6, KC - 1, C, device=DEV).to(dtype)
    idx = torch.tensor([3, 0, 1, 0], dtype=torch.int32, device=DEV)
    ref_state = state.clone()
    y = skinny.skinny_linear(x, w, cfg, epilogue="conv", conv=(cw, state, idx))
    ref = naive.skinny_linear(x, w, epilogue="conv", conv=(cw, ref_state, idx))
    live = [0, 2]
    assert rel_fro(y[live], ref[live]) <= _tol(dtype)
    assert rel_fro(state[[3, 1]], ref_state[[3, 1]]) <= _tol(dtype)
    assert torch.equal(state[[2, 4, 5]], ref_state[[2, 4, 5]])  # untouched slots


def test_deterministic_across_calls():
    x = torch.randn(4, 256, device=DEV).to(torch.bfloat16)
    w = _weight(48, 256, "dense", torch.bfloat16)
    cfg = gcfg.SkinnyConfig(16, 32, 4, use_dot=False)
    a, b = skinny.skinny_linear(x, w, cfg), skinny.skinny_linear(x, w, cfg)
    assert torch.equal(a, b)


def test_rejects_bad_inputs():
    x = torch.randn(2, 64, device=DEV).to(torch.bfloat16)
    cfg = gcfg.SkinnyConfig(16, 32, 1)
    with pytest.raises(ValueError, match="expects"):
        skinny.skinny_linear(x, _weight(8, 32, "dense", torch.bfloat16), cfg)
    with pytest.raises(ValueError, match="up to 32 rows"):
        skinny.skinny_linear(torch.randn(33, 64, device=DEV).to(torch.bfloat16),
                             _weight(8, 64, "dense", torch.bfloat16), cfg)
    with pytest.raises(ValueError, match="multiples of head"):
        skinny.skinny_linear(x, _weight(8, 64, "dense", torch.bfloat16), cfg, prologue_kind="gated_norm", head=24,
                             gate=x, pro_w=x[0, :24])


def test_default_config_fills_the_gpu(monkeypatch):
    monkeypatch.delenv("LINRNN_SKINNY_TABLE", raising=False)
    for M, N, K in [(1, 2048, 4096), (8, 2048, 512), (32, 12352, 2048), (1, 257, 2048)]:
        c = gcfg.skinny_config(M, N, K, "dense", torch.device("cpu"))
        programs = -(-N // c.block_n) * c.split_k
        assert programs >= 132 or c.split_k * c.block_k >= K, (M, N, K, c)
        assert c.block_k % 8 == 0  # 16-byte bf16 loads


def test_switches(monkeypatch, tmp_path):
    monkeypatch.setenv("LINRNN_SKINNY_GEMM", "0")
    assert not gcfg.skinny_enabled(1, 2048, 4096, "dense")
    monkeypatch.setenv("LINRNN_SKINNY_GEMM", "1")
    assert gcfg.skinny_enabled(1, 2048, 4096, "dense") and not gcfg.skinny_enabled(33, 2048, 4096, "dense")
    assert not gcfg.skinny_enabled(1, 2048, 4096, "nvfp4")
    table = tmp_path / "t.json"
    table.write_text('{"2048,4096,dense": {"max_m": 4, "2": [64, 128, 4, 4, 2, 0]}}')
    monkeypatch.setenv("LINRNN_SKINNY_TABLE", str(table))
    assert gcfg.skinny_enabled(4, 2048, 4096, "dense") and not gcfg.skinny_enabled(8, 2048, 4096, "dense")
    assert gcfg.skinny_config(2, 2048, 4096, "dense", None) == gcfg.SkinnyConfig(64, 128, 4, 4, 2, False)
    # programmatic dependent launch: on by default where available (sm_90+), LINRNN_PDL=0 turns it off
    x = torch.empty(1, 8)
    monkeypatch.delenv("LINRNN_PDL", raising=False)
    assert gcfg.pdl_launch_kwargs(x) == {"PDL": False}  # a CPU tensor: not available
    monkeypatch.setattr(gcfg, "pdl_available", lambda device: True)
    assert gcfg.pdl_launch_kwargs(x) == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv("LINRNN_PDL", "0")
    assert gcfg.pdl_launch_kwargs(x) == {"PDL": False}


_SKINNY_SIGNATURE = r"""
def skinny_signature(fn, cex, act):
    # (signature, constexprs, attributes) of _skinny_gemm_kernel for triton.compile: activations and weights
    # of type `act`, f32 workspaces, widths and row strides multiples of 16 as in the model
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cex:
            sig[name], consts[(i,)] = "constexpr", cex[name]
        elif name in ("pro_eps", "norm_eps"):
            sig[name] = "fp32"
        elif name in ("M", "N", "K", "K_PER") or (name.startswith("s") and not name.endswith("_ptr")):
            sig[name] = "i32"
            if name != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            sig[name] = "*fp32" if name in ("ws_ptr", "rs_ptr", "sumsq_ptr") else "*i32" if name == "tick_ptr" else act
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs
"""

_COMPILE_PROBE = _SKINNY_SIGNATURE + r"""
import re, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linrnn_kernels.gemv import skinny
fn = skinny._skinny_gemm_kernel
for (pro, epi, res, norm, dot, split, bm, pdl, one) in [
        (0, 0, 0, 0, 0, 4, 1, 0, 0), (2, 0, 1, 1, 0, 2, 1, 1, 0), (0, 1, 0, 0, 1, 2, 16, 0, 0), (3, 2, 1, 1, 1, 1, 32, 1, 0),
        (2, 0, 1, 1, 0, 4, 8, 1, 1), (3, 0, 1, 1, 1, 8, 16, 1, 1)]:  # one-shot tiles (FMA at 8 rows, dot)
    cex = dict(PRO=pro, EPI=epi, HAS_RES=res, ROW_NORM=norm, HAS_SCALE=0, HEAD=128, SPLIT_MAX=split, USE_DOT=dot, RM=bm, KCP=4, KC=4, ADD_GROUP=8, ADD_SPLITS=2 if epi == 2 else 0,
               COMPUTE=tl.bfloat16, BLOCK_M=bm, BLOCK_N=(8 if one else 16) if dot or one else 32,
               BLOCK_K=(1024 if dot else 512) if one else 256 if bm == 1 else 128,
               BLOCK_R=1024, EVEN_K=1, PDL=pdl, ONE_SHOT=one)
    sig, consts, attrs = skinny_signature(fn, cex, "*bf16")
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    ptx = k.asm["ptx"]
    # 16-byte weight loads: vector loads with the evict-first hint, or 16-byte cp.async (pipelined dots)
    wide = len(re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint\.v4\.b32", ptx)) + \
        len(re.findall(r"cp\.async\.cg\.shared\.global [^;]*, 0x10", ptx))
    narrow = len(re.findall(r"ld\.global\.L1::evict_first\.L2::cache_hint\.(b16|b32|v2)", ptx))
    # PDL: the FMA tiles' first weight loads are issued before griddepcontrol.wait (they overlap the previous kernel)
    wait = ptx.find("griddepcontrol.wait")
    first_w = ptx.find("ld.global.L1::evict_first")
    early = wait > 0 and "griddepcontrol.launch_dependents" in ptx and ((dot == 1 and not one) or 0 <= first_w < wait)
    # one-shot tiles: every weight load before the wait
    all_early = wait > 0 and 0 <= ptx.rfind("ld.global.L1::evict_first") < wait
    print("VARIANT", pro, epi, dot, one, "v4loads", wide if not narrow else 0, "all_early", all_early, "gdc", early)
from linrnn_kernels.moe import router_fused
fn = router_fused._router_kernel
for dot, bm in [(0, 1), (1, 32)]:
    cex = dict(HAS_SHARED=dot == 0, TOP_K=8, RENORMALIZE=1, SPLIT_MAX=4, USE_DOT=dot, COMPUTE=tl.bfloat16, BLOCK_M=bm, BLOCK_N=16,
               BLOCK_K=256 if bm == 1 else 128, BLOCK_E=256, BLOCK_TOPK=8, BLOCK_M_ALIGN=16, BLOCK_P=max(16, bm * 8),
               BLOCK_B=32, EVEN_K=1, PDL=1, PAIR_BLOCKS=dot == 0, ROUTE_M=min(bm, 8), REPLICAS=4 if bm == 1 else 1,
               REG_ALIGN=dot == 0, LOGIT_KEYS=1)
    sig, consts, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in cex:
            sig[name], consts[(i,)] = "constexpr", cex[name]
        elif name in ("M", "NL", "K", "K_PER", "E", "max_blocks", "sx", "sw", "slg", "sw13", "sh", "NI", "n_tiles_r"):
            sig[name] = "i32"
        else:
            sig[name] = ("*fp32" if name in ("ws_ptr", "ws13_ptr") else
                         "*i32" if name in ("tick_ptr", "ids_ptr", "starts_ptr", "sorted_ptr", "expert_ids_ptr",
                                            "num_padded_ptr") else "*bf16")
            attrs[(i,)] = [["tt.divisibility", 16]]
    triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                   target=GPUTarget("cuda", 90, 32), options=dict(num_warps=4, num_stages=3))
    print("ROUTER", dot, bm)
from linrnn_kernels.norm import fused
fn = fused._qk_norm_rope_kernel
cex = dict(HALF=32, BLOCK=256, WRITE_KV=True, BS=16)
sig, consts = {}, {}
for i, name in enumerate(fn.arg_names):
    if name in cex:
        sig[name], consts[(i,)] = "constexpr", cex[name]
    elif name == "eps":
        sig[name] = "fp32"
    elif name.endswith("_ptr"):
        sig[name] = "*fp32" if name == "inv_ptr" else "*i64" if name in ("pos_ptr", "slot_ptr") else "*bf16"
    else:
        sig[name] = "i32"
triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
               options=dict(num_warps=1))
print("ROPE_KV")
print("COMPILED")
"""


def test_compiles_for_sm90_with_16_byte_weight_loads():
    """Compiled for sm_90 outside the interpreter (no GPU needed): every prologue / epilogue / dot
    variant compiles, weight loads are 16-byte vectors, and the PDL variants carry griddepcontrol (the FMA
    tiles issue their first weight loads before its wait); so do the fused router (routing + alignment in the finishing
    program, the shared expert's gate_up tiles) and q/k norm + RoPE with the KV-cache write."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE], capture_output=True, text=True, env=env,
                         timeout=600)
    assert "COMPILED" in out.stdout, out.stderr[-3000:]
    assert out.stdout.count("ROUTER") == 2 and "ROPE_KV" in out.stdout
    for line in out.stdout.splitlines():
        if line.startswith("VARIANT"):
            parts = line.split()
            assert int(parts[parts.index("v4loads") + 1]) > 0, line
            pro, epi, one = parts[1], parts[2], parts[4]
            pdl = parts[-1] == "True"
            assert pdl == (pro in ("2", "3")), line
            assert (parts[parts.index("all_early") + 1] == "True") == (one == "1"), line


# ---- fused router ------------------------------------------------------------------------------------

from linrnn_kernels.moe import naive as moe_naive  # noqa: E402
from linrnn_kernels.moe import router_fused  # noqa: E402


@pytest.mark.parametrize("M,E,top_k,extra,block_m,cfg", [
    (1, 24, 4, 1, 16, gcfg.SkinnyConfig(16, 32, 2)),
    (5, 24, 4, 1, 4, gcfg.SkinnyConfig(16, 64, 1)),
    (9, 40, 3, 0, 16, gcfg.SkinnyConfig(16, 32, 3, use_dot=True)),
    (32, 16, 8, 1, 16, gcfg.SkinnyConfig(16, 64, 2, use_dot=True)),
    (3, 40, 8, 1, -8, gcfg.SkinnyConfig(16, 32, 2)),  # block_m < 0: pair blocks of -block_m tokens
    (8, 24, 4, 0, -8, gcfg.SkinnyConfig(16, 64, 1, use_dot=True)),
    (1, 256, 8, 1, -8, gcfg.SkinnyConfig(16, 64, 2)),
])
@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_router_matches_composition(poison_empty, M, E, top_k, extra, block_m, cfg, renormalize):
    """Logits within bf16 rounding of the f32 reference; routing and alignment exactly those of the naive
    ops on the kernel's own logits (near-ties may legitimately flip with one ulp of the logits); the
    alignment as expert-sorted blocks or as pair blocks."""
    pair_blocks, block_m = block_m < 0, abs(block_m)
    dtype, K = torch.bfloat16, 96
    x = torch.randn(M, K, device=DEV).to(dtype)
    gw = _weight(E + extra, K, "dense", dtype)
    shared = _weight(2 * 24, K, "dense", dtype) if extra else None
    logits, tw, ids, (sorted_ids, expert_ids, num_padded), h = router_fused.route_align(
        x, gw, E, top_k, renormalize, block_m, cfg, shared_w13=shared, pair_blocks=pair_blocks)
    if shared is None:
        assert h is None
    else:  # the shared expert's gate_up tiles of the same launch
        assert rel_fro(h, router_fused.naive_shared_gate_up(x, shared)) <= 2e-2
    ref_logits = router_fused.naive_route_align(x, gw, E, top_k, renormalize, block_m)[0]
    assert rel_fro(logits, ref_logits) <= 1e-2
    rw, rids = moe_naive.route(logits[:, :E], top_k, renormalize)
    # bf16 logits tie often; torch.topk orders ties arbitrarily, the kernel by lowest expert index
    p = torch.softmax(logits[:, :E].float(), -1)
    assert torch.equal(p.gather(1, ids.long()), p.gather(1, rids))
    same = p.gather(1, ids.long())[:, 1:] == p.gather(1, ids.long())[:, :-1]
    assert (ids[:, 1:] > ids[:, :-1])[same].all()
    rids = ids.long()
    # one bf16 ulp: the CPU interpreter's f32 -> bf16 cast truncates where torch rounds to nearest
    exact = DEV == "cuda"
    assert torch.allclose(tw.float(), rw.to(dtype).float(), rtol=0 if exact else 2 ** -7, atol=0)
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))
    _assert_alignment(ids, rids, E, block_m, pair_blocks, sorted_ids, expert_ids, num_padded)
    assert torch.equal(skinny.tickets(x.device), torch.zeros_like(skinny.tickets(x.device)))


def _assert_alignment(ids, rids, E, block_m, pair_blocks, sorted_ids, expert_ids, num_padded):
    """A launch's alignment is exactly the naive one: pair blocks of `ids`, or expert-sorted blocks of `rids`."""
    if pair_blocks:
        r_sorted, r_expert, r_n = moe_naive.moe_pair_blocks(ids, block_m)
        assert torch.equal(sorted_ids, r_sorted) and torch.equal(expert_ids, r_expert) and int(num_padded) == r_n
        return
    r_sorted, r_expert, r_n = moe_naive.moe_align_block_size(rids, E, block_m)
    assert int(num_padded) == r_n
    assert torch.equal(sorted_ids[:r_n], r_sorted)
    assert torch.equal(expert_ids[: r_n // block_m], r_expert)
    assert (expert_ids[r_n // block_m:] == -1).all()


@pytest.mark.parametrize("M,E,top_k,extra,block_m", [(1, 24, 4, 1, 8), (2, 40, 3, 0, 16), (1, 16, 8, 1, 8),
                                                     (1, 256, 8, 0, 8), (8, 256, 8, 1, -8), (3, 20, 10, 0, -8)])
def test_route_align_logits_matches_composition(poison_empty, M, E, top_k, extra, block_m):
    """Routing + alignment from logits in one launch (tiny batches; block_m < 0: pair blocks of up to
    -block_m tokens): the naive route and alignment exactly, weights rounded once to bf16."""
    pair_blocks, block_m = block_m < 0, abs(block_m)
    logits = torch.randn(M, E + extra, device=DEV)  # f32: no ties
    tw, ids, (sorted_ids, expert_ids, num_padded) = router_fused.route_align_logits(
        logits, E, top_k, True, block_m, torch.bfloat16, pair_blocks=pair_blocks)
    rw, rids = moe_naive.route(logits[:, :E], top_k, True)
    assert torch.equal(ids.long(), rids)
    exact = DEV == "cuda"  # the CPU interpreter's f32 -> bf16 cast truncates
    assert torch.allclose(tw.float(), rw.bfloat16().float(), rtol=0 if exact else 2 ** -7, atol=0)
    _assert_alignment(ids, rids, E, block_m, pair_blocks, sorted_ids, expert_ids, num_padded)
    if pair_blocks:
        with pytest.raises(ValueError, match="pair blocks"):
            router_fused.route_align_logits(logits.repeat(9, 1), E, top_k, True, 8, torch.bfloat16, pair_blocks=True)
        return
    with pytest.raises(ValueError, match="M \\* top_k"):
        router_fused.route_align_logits(torch.randn(2, E, device=DEV), E, 8, True, 8, torch.bfloat16)


def _defined(logits, tw, ids, alignment, h, block_m):
    """A router call's outputs, the alignment up to num_padded (entries past it are unspecified)."""
    sorted_ids, expert_ids, num_padded = alignment
    n = int(num_padded)
    return [logits, tw, ids, sorted_ids[:n], expert_ids[:n // block_m], num_padded, h]


TAILS = [router_fused.RouterTail(*t) for t in
         [(False, False, False), (True, False, False), (True, True, False), (False, True, True), (True, True, True)]]


def _tied_gate(E, extra, K, dtype, M):
    """Gate rows with ties: rows 2i and 2i + 1 equal, so every row of logits has equal pairs among its top-k."""
    w = torch.randn(E + extra, K, device=DEV) / math.sqrt(K)
    w[1:E:2] = w[0:E - 1:2].clone()
    return WeightTensor("dense", w.to(dtype))


@pytest.mark.parametrize("M,E,top_k,block_m,warps,pair_blocks", [
    (1, 64, 8, 8, 4, True), (3, 40, 8, 8, 8, True), (8, 64, 8, 8, 4, True), (2, 24, 3, 4, 8, True),
    (3, 40, 6, 16, 4, False), (1, 32, 8, 8, 1, True)])
def test_fused_router_tails_agree(poison_empty, M, E, top_k, block_m, warps, pair_blocks):
    """Every RouterTail variant (rows replicated per warp, pair blocks from registers, 32-bit logit keys) gives
    the same bytes as the first on tied logits (equal gate rows), and those are the naive ops' results with ties
    taken by the lowest expert index; also as the separate route_align_logits launch."""
    dtype, K = torch.bfloat16, 64
    x = torch.randn(M, K, device=DEV).to(dtype)
    gw = _tied_gate(E, 1, K, dtype, M)
    shared = _weight(2 * 16, K, "dense", dtype)
    cfg = gcfg.SkinnyConfig(8, 32, 2, warps)
    outs = [router_fused.route_align(x, gw, E, top_k, True, block_m, cfg, shared_w13=shared, pair_blocks=pair_blocks,
                                     tail=t) for t in TAILS]
    logits, tw, ids, (sorted_ids, expert_ids, num_padded), h = outs[0]
    p = torch.softmax(logits[:, :E].float(), -1)
    same = p.gather(1, ids.long())[:, 1:] == p.gather(1, ids.long())[:, :-1]
    assert same.any(), "the test needs ties in the top-k"
    rw, rids = moe_naive.route(logits[:, :E], top_k, True)
    assert torch.equal(p.gather(1, ids.long()), p.gather(1, rids))
    assert (ids[:, 1:] > ids[:, :-1])[same].all()  # ties: lowest expert index first
    exact = DEV == "cuda"  # the CPU interpreter's f32 -> bf16 cast truncates
    assert torch.allclose(tw.float(), rw.to(dtype).float(), rtol=0 if exact else 2 ** -7, atol=0)
    _assert_alignment(ids, ids.long(), E, block_m, pair_blocks, sorted_ids, expert_ids, num_padded)
    ref = _defined(logits, tw, ids, (sorted_ids, expert_ids, num_padded), h, block_m)
    for t, o in zip(TAILS[1:], outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(_defined(*o, block_m), ref)), t
    for t in TAILS if pair_blocks or M * top_k <= router_fused.LOGITS_MAX_PAIRS else ():
        got = router_fused.route_align_logits(logits, E, top_k, True, block_m, dtype, pair_blocks=pair_blocks,
                                              tail=t, num_warps=warps)
        assert all(torch.equal(a, b) for a, b in zip(_defined(None, *got, None, block_m)[1:6], ref[1:6])), t
    assert not skinny.tickets(x.device).any()


def test_router_tail_from_table(tmp_path, monkeypatch):
    """The finishing program's variant per M: tuned.json's router "tail" (first M key >= M), else the default;
    unknown names are an error."""
    assert router_fused.RouterTail.for_rows(1) == router_fused.RouterTail(replicate=True, logit_keys=True)
    assert router_fused.RouterTail.for_rows(5) == router_fused.RouterTail(reg_align=True, logit_keys=True)
    table = tmp_path / "t.json"
    table.write_text('{"router": {"max_m": 8, "tail": {"2": "", "4": "replicate,bogus"}}}')
    monkeypatch.setenv("LINRNN_SKINNY_TABLE", str(table))
    assert router_fused.RouterTail.for_rows(2) == router_fused.RouterTail()
    assert gcfg.router_tail(9) == gcfg.ROUTER_TAIL_DEFAULT
    with pytest.raises(ValueError, match="bogus"):
        router_fused.RouterTail.for_rows(3)


def test_fused_router_rejects_bad_inputs():
    x = torch.randn(2, 32, device=DEV).to(torch.bfloat16)
    cfg = gcfg.SkinnyConfig(16, 32, 1)
    with pytest.raises(ValueError, match="top_k"):
        router_fused.route_align(x, _weight(8, 32, "dense", torch.bfloat16), 8, 9, True, 16, cfg)
    with pytest.raises(ValueError, match="never quantized"):
        router_fused.route_align(x, _weight(8, 32, "fp8", torch.bfloat16), 8, 2, True, 16, cfg)
    with pytest.raises(ValueError, match="does not fit"):
        router_fused.route_align(x, _weight(8, 16, "dense", torch.bfloat16), 8, 2, True, 16, cfg)


# ---- GPU: Qwen3.5-35B-A3B shapes -------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 8, 32])
@pytest.mark.parametrize("shape", ["in_proj", "out_proj", "shared", "fp8"])
def test_gpu_full_shapes(poison_empty, M, shape):
    """Default configs at the model's widths, every fused option the layers use; tickets left at 0."""
    dtype, H = torch.bfloat16, 2048
    dev = torch.device("cuda")
    x = torch.randn(M, H if shape != "out_proj" else 4096, device=DEV).to(dtype)
    res, nw = torch.randn(M, H, device=DEV).to(dtype), (0.1 * torch.randn(H, device=DEV)).to(dtype)
    if shape == "in_proj":
        w, kw = _weight(12352, H, "dense", dtype), {}
    elif shape == "fp8":
        w, kw = _weight(4096, H, "fp8", dtype), {}
    elif shape == "out_proj":
        z = torch.randn(M, 4096 + 64, device=DEV).to(dtype)[:, 64:]
        w = _weight(H, 4096, "dense", dtype)
        kw = dict(prologue_kind="gated_norm", gate=z, pro_w=(1 + 0.1 * torch.randn(128, device=DEV)).to(dtype),
                  head=128, residual=res, norm_w=nw)
    else:
        w13 = _weight(1024, H, "dense", dtype)
        h = naive.skinny_linear(x, w13, epilogue="silu_mul")
        cfg = gcfg.skinny_config(M, 512, H, "dense", dev)
        assert rel_fro(skinny.skinny_linear(x, w13, cfg, epilogue="silu_mul"), h) <= 2e-2
        x, w = h, _weight(H, 512, "dense", dtype)
        logits = torch.randn(M, 257, device=DEV).to(dtype)
        kw = dict(epilogue="gate_add", addend=torch.randn(M, H, device=DEV).to(dtype), gate_logit=logits[:, 256:],
                  residual=res, norm_w=nw)
    cfg = gcfg.skinny_config(M, w.out_features, x.shape[1], w.fmt, dev, kw.get("head", 0))
    out = skinny.skinny_linear(x, w, cfg, **kw)
    ref = naive.skinny_linear(x, w, **kw)
    for a, b in zip(out if isinstance(out, tuple) else (out,), ref if isinstance(ref, tuple) else (ref,)):
        assert rel_fro(a, b) <= 2e-2
    assert not skinny.tickets(dev).any()


@pytest.mark.gpu
@pytest.mark.parametrize("M,pair_blocks", [(1, False), (8, False), (32, False), (1, True), (8, True)])
def test_gpu_router_full_shape(poison_empty, M, pair_blocks):
    """35B shapes; pair_blocks (the engine's choice at <= 8 tokens on Hopper): the same logits, ids, weights
    and h as the expert-sorted launch, bit for bit, and the naive pair blocks of those ids."""
    dtype, H, E = torch.bfloat16, 2048, 256
    x = torch.randn(M, H, device=DEV).to(dtype)
    gw = _weight(E + 1, H, "dense", dtype)
    cfg = gcfg.skinny_config(M, E + 1, H, "dense", torch.device("cuda"))
    shared = _weight(1024, H, "dense", dtype)
    if pair_blocks:
        got = router_fused.route_align(x, gw, E, 8, True, 8, cfg, shared_w13=shared, pair_blocks=True)
        assert all(torch.equal(a, b) for a, b in zip(got[3], moe_naive.moe_pair_blocks(got[2], 8)[:2]))
        assert int(got[3][2]) == M * 8 * 8
    logits, tw, ids, (sorted_ids, expert_ids, num_padded), h = router_fused.route_align(
        x, gw, E, 8, True, 16, cfg, shared_w13=shared)
    if pair_blocks:
        for a, b in zip(got[:3] + got[4:], (logits, tw, ids, h)):
            assert torch.equal(a, b)
    assert rel_fro(h, router_fused.naive_shared_gate_up(x, shared)) <= 2e-2
    ref = router_fused.naive_route_align(x, gw, E, 8, True, 16)[0]
    assert rel_fro(logits, ref) <= 1e-2
    rw, rids = moe_naive.route(logits[:, :E], 8, True)
    p = torch.softmax(logits[:, :E].float(), -1)
    assert torch.equal(p.gather(1, ids.long()), p.gather(1, rids))
    assert torch.equal(tw, rw.to(dtype))
    r_sorted, r_expert, r_n = moe_naive.moe_align_block_size(ids.long(), E, 16)
    assert int(num_padded) == r_n and torch.equal(sorted_ids[:r_n], r_sorted)
    assert torch.equal(expert_ids[: r_n // 16], r_expert) and (expert_ids[r_n // 16:] == -1).all()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 4, 8])
def test_gpu_router_tails_full_shape(poison_empty, M):
    """35B shapes (E = 256 + the shared gate row, top-8, the shared expert's gate_up, pair blocks of 8), the engine's
    tile config, tied gate rows: every RouterTail variant gives the bytes of the first, which are the naive ops'
    (ties by lowest expert index); the default tail's graph replay == its eager call, byte for byte."""
    dtype, H, E = torch.bfloat16, 2048, 256
    dev = torch.device("cuda")
    x = torch.randn(M, H, device=DEV).to(dtype)
    gw = _tied_gate(E, 1, H, dtype, M)
    shared = _weight(1024, H, "dense", dtype)
    cfg = gcfg.router_config(M, E + 1 + 512, H, dev)

    def call(t=None):
        return router_fused.route_align(x, gw, E, 8, True, 8, cfg, shared_w13=shared, pair_blocks=True, tail=t)

    outs = [_defined(*call(t), 8) for t in TAILS]
    logits, tw, ids = outs[0][:3]
    p = torch.softmax(logits[:, :E].float(), -1)
    rw, rids = moe_naive.route(logits[:, :E], 8, True)
    assert torch.equal(p.gather(1, ids.long()), p.gather(1, rids)) and torch.equal(tw, rw.to(dtype))
    same = p.gather(1, ids.long())[:, 1:] == p.gather(1, ids.long())[:, :-1]
    assert same.any() and (ids[:, 1:] > ids[:, :-1])[same].all()
    r_sorted, r_expert, r_n = moe_naive.moe_pair_blocks(ids, 8)
    assert torch.equal(outs[0][3], r_sorted) and torch.equal(outs[0][4], r_expert) and int(outs[0][5]) == r_n
    assert rel_fro(logits, router_fused.naive_route_align(x, gw, E, 8, True, 8)[0]) <= 1e-2
    for t, o in zip(TAILS[1:], outs[1:]):
        assert all(torch.equal(a, b) for a, b in zip(o, outs[0])), t
    eager = _defined(*call(), 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(_defined(*captured, 8), eager))
    assert not skinny.tickets(dev).any()


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kind", ["gated_norm", "sigmoid_gate"])
def test_gpu_out_projections_tuned(poison_empty, M, kind):
    """The K = 4096 out projections with the configs the engine takes (tuned.json, one-shot tiles where they won) at
    35B shapes: == the naive composition; run to run and graph replay == eager, byte for byte; tickets left at 0."""
    dtype, H, K, head = torch.bfloat16, 2048, 4096, 128
    dev = torch.device("cuda")
    x = torch.randn(M, K, device=DEV).to(dtype)
    if kind == "gated_norm":
        gate = torch.randn(M, K + 64, device=DEV).to(dtype)[:, 64:]
        pro_w = (1 + 0.1 * torch.randn(head, device=DEV)).to(dtype)
    else:
        gate, pro_w = torch.randn(M, K // 256, 512, device=DEV).to(dtype)[..., 256:], None
        head = 256
    kw = dict(prologue_kind=kind, gate=gate, pro_w=pro_w, head=head, residual=torch.randn(M, H, device=DEV).to(dtype),
              norm_w=(0.1 * torch.randn(H, device=DEV)).to(dtype))
    w = _weight(H, K, "dense", dtype)
    cfg = gcfg.skinny_config(M, H, K, "dense", dev, head, kind)
    eager = skinny.skinny_linear(x, w, cfg, **kw)
    ref = naive.skinny_linear(x, w, **kw)
    for a, b in zip(eager, ref):
        assert not torch.isnan(a).any() and rel_fro(a, b) <= 2e-2, cfg
    again = skinny.skinny_linear(x, w, cfg, **kw)
    assert all(torch.equal(a, b) for a, b in zip(again, eager))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = skinny.skinny_linear(x, w, cfg, **kw)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(out, eager))
    assert not skinny.tickets(dev).any()


@pytest.mark.gpu
def test_gpu_graph_replay_is_bit_identical():
    """Captured and replayed (twice) == eager, byte for byte: split-K tickets reset inside the graph."""
    dtype, H = torch.bfloat16, 2048
    x = torch.randn(4, 4096, device=DEV).to(dtype)
    w = _weight(H, 4096, "dense", dtype)
    cfg = gcfg.SkinnyConfig(16, 128, 8, use_dot=False)
    nw = (0.1 * torch.randn(H, device=DEV)).to(dtype)
    eager = skinny.skinny_linear(x, w, cfg, norm_w=nw)
    out = []
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        skinny.skinny_linear(x, w, cfg, norm_w=nw)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        out = skinny.skinny_linear(x, w, cfg, norm_w=nw)
    for _ in range(2):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


_SMEM_PROBE = _SKINNY_SIGNATURE + r"""
import torch, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linrnn_kernels.gemv import config, skinny
fn = skinny._skinny_gemm_kernel
cfg = config.skinny_config(32, 64, 128, "dense", torch.device("cpu"))  # the default dot config at 32 rows
x = torch.empty(32, 128, dtype=torch.float32)
cex = dict(PRO=0, EPI=1, HAS_RES=0, ROW_NORM=0, HAS_SCALE=0, HEAD=1, SPLIT_MAX=1, USE_DOT=1, RM=32, KCP=1, KC=2,
           ADD_GROUP=1, ADD_SPLITS=0, COMPUTE=tl.float32, BLOCK_M=32, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
           BLOCK_R=1024, EVEN_K=1, PDL=0, ONE_SHOT=0)
sig, consts, attrs = skinny_signature(fn, cex, "*fp32")
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                   options=dict(num_warps=cfg.num_warps, num_stages=skinny.pipeline_stages(cfg, x)))
print("SHARED", k.metadata.shared)
"""


def test_f32_dot_tiles_fit_sm90_shared_memory():
    """f32 activations with the silu_mul epilogue (2 weight tiles per stage) at the bf16-tuned depth needed
    245,760 bytes of shared memory on the H200 (limit 232,448: the f32 test model's 32-token prefill graph
    failed to capture); pipeline_stages halves the depth for 4-byte tiles."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _SMEM_PROBE], capture_output=True, text=True, env=env, timeout=600)
    line = [s for s in out.stdout.splitlines() if s.startswith("SHARED")]
    assert line, out.stderr[-3000:]
    assert int(line[0].split()[1]) <= 232448


# ---- the sweep behind kernels/gemv/tuned.json ----------------------------------------------------------


def test_sweep_table_merge_and_markdown():
    """A partial sweep (some cases, some M) updates the committed table: measured keys take the new configs at the
    measured M and keep the others; max_m follows the new sweep where the fused call lost, else reaches as far as
    the old table did; the markdown skips the table's "_source" note."""
    from linrnn_bench.kernels import gemv as sweep

    def row(key, M, fused, chain, cfg):
        return {"case": "c", "key": key, "plain": False, "N": 8, "K": 16, "M": M, "calls": 1, "chain_us": chain,
                "cublas_us": chain, "fused_us": fused, "pct_copy": 1.0, "cublas_pct_copy": 1.0, "floor_us": 0.1,
                "vs_chain": chain / fused, "best_config": cfg}

    rows = [row("a", 1, 5.0, 9.0, [4, 1024, 1, 8, 1, 0]), row("a", 8, 8.0, 9.0, [64, 128, 16, 8, 4, 1]),
            row("b", 1, 5.0, 9.0, [1, 2048, 1, 4, 1, 0]), row("b", 8, 10.0, 9.0, [4, 256, 2, 8, 1, 0])]
    new = sweep.table_from_rows(rows)
    assert new["a"]["max_m"] == 8 and new["b"]["max_m"] == 1
    base = {"_source": "note", "a": {"max_m": 16, "1": [16, 256, 4, 4, 1, 0], "16": [64, 128, 16, 4, 4, 1]},
            "b": {"max_m": 8, "1": [4, 512, 2, 4, 1, 0]}, "c": {"max_m": 2, "1": [8, 256, 1, 4, 1, 0]}}
    merged = sweep.merge_tables(base, new, [1, 8])
    assert merged["a"] == {"max_m": 16, "1": [4, 1024, 1, 8, 1, 0], "8": [64, 128, 16, 8, 4, 1],
                           "16": [64, 128, 16, 4, 4, 1]}
    assert merged["b"]["max_m"] == 1 and merged["b"]["1"] == [1, 2048, 1, 4, 1, 0]
    assert merged["c"] == base["c"] and merged["_source"] == "note"
    md = sweep.markdown({"env": {}, "copy_GBs": 4200.0, "rows": rows, "table": merged}, [1, 8])
    assert "a: 16, b: 1, c: 2" in md and "_source" not in md
    # every looped FMA candidate holds at most 64 f32 products per thread (its accumulator); one-shot tiles carry
    # no accumulator: 8-64 KB of weights per program, at most 1024 products per thread
    for M in (1, 2, 8):
        for c in sweep.candidates(M, 2048, 4096):
            if c.one_shot:
                assert 8 << 10 <= 2 * c.block_n * c.block_k <= 64 << 10, c
                assert c.use_dot or M * c.block_n * c.block_k <= 1024 * 32 * c.num_warps, c
            elif not c.use_dot:
                assert M * c.block_n * c.block_k <= 64 * 32 * c.num_warps
