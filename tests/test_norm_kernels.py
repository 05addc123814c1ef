"""Fused row-wise kernels (kernels/norm) vs their naive references; CPU runs them under
TRITON_INTERPRET=1, the gpu-marked test at the model's real widths."""
import pytest
import torch

from helpers import KERNEL_DEVICE, rel_err, rel_fro
from linrnn_kernels.norm import fused, naive

DEV = KERNEL_DEVICE


def _tol(dtype):
    return 1e-5 if dtype == torch.float32 else 1e-2


def _err(a, b):
    """f32: max-abs relative; bf16: relative Frobenius (rounding-order differences of an ulp)."""
    return rel_err(a, b) if a.dtype == torch.float32 else rel_fro(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm(dtype, with_res):
    x = torch.randn(5, 96, device=DEV).to(dtype)
    r = torch.randn(5, 96, device=DEV).to(dtype) if with_res else None
    w = (0.1 * torch.randn(96, device=DEV)).to(dtype)
    y, h = fused.add_rmsnorm(x, r, w, 1e-6)
    ry, rh = naive.add_rmsnorm(x, r, w, 1e-6)
    assert _err(y, ry) <= _tol(dtype)
    # the residual sum is one rounding of an f32 add: exact in f32; on the CPU interpreter bf16 casts
    # may round differently from torch by one ulp
    assert torch.equal(h, rh) if (dtype == torch.float32 or DEV == "cuda") else _err(h, rh) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_rmsnorm_strided_gate(dtype):
    T, H, D = 3, 4, 32
    proj = torch.randn(T, 2 * H * D + 7, device=DEV).to(dtype)
    z = proj[:, 5:5 + H * D].reshape(T, H, D)  # a strided view, as in the GDN layer
    x = torch.randn(T, H, D, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    assert _err(fused.gated_rmsnorm(x, z, w, 1e-6), naive.gated_rmsnorm(x, z, w, 1e-6)) <= _tol(dtype)


@pytest.fixture
def nan_outputs(monkeypatch):
    """The kernels' outputs start as NaN (torch.empty / empty_like poisoned), so an unwritten element shows."""
    empty, empty_like = torch.empty, torch.empty_like
    monkeypatch.setattr(torch, "empty", lambda *a, **k: empty(*a, **k).fill_(float("nan")))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: empty_like(*a, **k).fill_(float("nan")))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_res", [False, True])
def test_add_rmsnorm_gated_addend(nan_outputs, dtype, with_res):
    """addend + sigmoid(g) * x, then the residual add and norm, in one pass (the MoE's shared-expert join at
    prefill sizes); g a strided column of the router logits, as in the layer."""
    T, N, E = 7, 96, 20
    x, a = torch.randn(T, N, device=DEV).to(dtype), torch.randn(T, N, device=DEV).to(dtype)
    logits = torch.randn(T, E + 3, device=DEV).to(dtype)[:, :E + 1]
    g = logits[:, E:]
    r = torch.randn(T, N, device=DEV).to(dtype) if with_res else None
    w = (0.1 * torch.randn(N, device=DEV)).to(dtype)
    y, h = fused.add_rmsnorm(x, r, w, 1e-6, addend=a, gate_logit=g)
    ry, rh = naive.add_rmsnorm(x, r, w, 1e-6, addend=a, gate_logit=g)
    assert not y.isnan().any() and not h.isnan().any()
    assert _err(y, ry) <= _tol(dtype) and _err(h, rh) <= _tol(dtype)
    # the unfused chain it replaces (kernels/gemv compose)
    uy, uh = naive.add_rmsnorm(a + torch.sigmoid(g) * x, r, w, 1e-6)
    assert torch.equal(ry, uy) and torch.equal(rh, uh)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T,H,D", [(3, 4, 32), (5, 3, 128), (1, 1, 16)])
def test_gated_rmsnorm_tiles(nan_outputs, dtype, T, H, D):
    """Several (token, head) rows per program, a ragged last tile."""
    proj = torch.randn(T, 3 * H * D + 5, device=DEV).to(dtype)
    z = proj[:, 5:5 + H * D].reshape(T, H, D)
    x = torch.randn(T, H, D, device=DEV).to(dtype)
    w = (1 + 0.1 * torch.randn(D, device=DEV)).to(dtype)
    y = fused.gated_rmsnorm(x, z, w, 1e-6)
    # bf16 at D = 128: 1.02e-2 relative Frobenius on the CPU interpreter, the same with one row per program
    assert not y.isnan().any() and _err(y, naive.gated_rmsnorm(x, z, w, 1e-6)) <= 2 * _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype):
    h = torch.randn(7, 2 * 48, device=DEV).to(dtype)
    assert _err(fused.silu_mul(h), naive.silu_mul(h)) <= _tol(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope(dtype):
    T, HQ, HK, D, rd = 6, 4, 2, 32, 8
    qkv = torch.randn(T, HQ * 2 * D + 2 * HK * D, device=DEV).to(dtype)
    q = qkv[:, : HQ * 2 * D].reshape(T, HQ, 2 * D)[..., :D]  # per-head [q | gate] interleave
    k = qkv[:, HQ * 2 * D: HQ * 2 * D + HK * D].reshape(T, HK, D)
    qw, kw = (0.1 * torch.randn(D, device=DEV)).to(dtype), (0.1 * torch.randn(D, device=DEV)).to(dtype)
    pos = torch.tensor([0, 1, 5, 100, 4000, 70000], device=DEV)
    inv = 1.0 / (1e7 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=DEV) / rd))
    qo, ko = fused.qk_norm_rope(q, k, qw, kw, pos, inv, 1e-6)
    rq, rk = naive.qk_norm_rope(q, k, qw, kw, pos, inv, 1e-6)
    assert _err(qo, rq) <= _tol(dtype) and _err(ko, rk) <= _tol(dtype)


@pytest.mark.gpu
def test_model_widths_on_gpu():
    x, r = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16), torch.randn(64, 2048, device="cuda",
                                                                                    dtype=torch.bfloat16)
    w = 0.1 * torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    assert _err(fused.add_rmsnorm(x, r, w, 1e-6)[0], naive.add_rmsnorm(x, r, w, 1e-6)[0]) <= 1e-2
    o, z = torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16), torch.randn(64, 32, 128, device="cuda",
                                                                                       dtype=torch.bfloat16)
    gw = torch.ones(128, device="cuda", dtype=torch.bfloat16)
    assert _err(fused.gated_rmsnorm(o, z, gw, 1e-6), naive.gated_rmsnorm(o, z, gw, 1e-6)) <= 1e-2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_rope_write_kv(dtype):
    """q/k norm + RoPE with k and v written to their cache pages in the same launch == qk_norm_rope then
    write_kv; a negative slot is skipped; every other cache entry untouched (NaN-poisoned)."""
    from linrnn_kernels.attention import naive as attn_naive

    T, HQ, HK, D, rd, bs = 5, 4, 2, 32, 8, 4
    qkv = torch.randn(T, HQ * 2 * D + 2 * HK * D, device=DEV).to(dtype)
    q = qkv[:, : HQ * 2 * D].reshape(T, HQ, 2 * D)[..., :D]
    k = qkv[:, HQ * 2 * D: HQ * 2 * D + HK * D].reshape(T, HK, D)
    v = qkv[:, HQ * 2 * D + HK * D:].reshape(T, HK, D)
    qw, kw = (0.1 * torch.randn(D, device=DEV)).to(dtype), (0.1 * torch.randn(D, device=DEV)).to(dtype)
    pos = torch.tensor([0, 1, 5, 100, 4000], device=DEV)
    inv = 1.0 / (1e7 ** (torch.arange(0, rd, 2, dtype=torch.float32, device=DEV) / rd))
    slots = torch.tensor([3, 9, -1, 0, 14], device=DEV)
    kc = torch.full((4, bs, HK, D), float("nan"), device=DEV).to(dtype)
    vc = kc.clone()
    rkc, rvc = kc.clone(), vc.clone()
    qo = fused.qk_norm_rope_write_kv(q, k, v, qw, kw, pos, inv, 1e-6, kc, vc, slots)
    rq, rk = naive.qk_norm_rope(q, k, qw, kw, pos, inv, 1e-6)
    live = slots >= 0
    attn_naive.write_kv(rk[live], v[live], rkc, rvc, slots[live])
    assert _err(qo, rq) <= _tol(dtype)
    written = ~torch.isnan(rkc.float())
    assert torch.equal(written, ~torch.isnan(kc.float())) and torch.equal(written, ~torch.isnan(vc.float()))
    assert _err(kc[written], rkc[written]) <= _tol(dtype)
    assert torch.equal(vc[written], rvc[written])
