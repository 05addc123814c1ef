"""Hybrid per-head f32/bf16 recurrent state end to end (issue #4): threshold inf is bit-identical to an
all-f32 engine, prefill + decode carries state exactly like token-by-token decode, and padded rows
(dummy slot 0) never touch a live slot."""
from __future__ import annotations

import math

import pytest
import torch

from helpers import KERNEL_DEVICE, make_hf_checkpoint
from linrnn_kernels.gdn import conv as conv_k
from linrnn_kernels.gdn import decode as decode_k
from linrnn_kernels.gdn import prefill as prefill_k
from linrnn_serve.classifier import build_head_map, head_timescales
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model
from linrnn_serve.runner.session import Session
from test_gdn_kernels import BLOCKED, FULL, SMALL, head_map, make_inputs, make_pools, rel_fro, rel_max

# ---- threshold inf == all-f32 engine, byte for byte ---------------------------------------------------


def _state_bytes(sess: Session) -> list[torch.Tensor]:
    st = sess.caches.state
    return [t.detach().clone() for t in st.ssm_f32 + st.ssm_bf16] + [st.conv.detach().clone()]


def _run_engine(model, bf16_heads, prompts, steps, greedy=True):
    """Prefill all prompts in one varlen batch, then `steps` decode steps (greedy, or fixed tokens so that
    a near-tie argmax cannot fork two runs being compared); all logits and pools."""
    sess = Session(model, len(prompts), max(len(p) for p in prompts) + steps + 1, bf16_heads=bf16_heads)
    sids = [sess.new_seq() for _ in prompts]
    logits = [sess.forward(sids, prompts)]
    for step in range(steps):
        nxt = logits[-1].argmax(-1).tolist() if greedy else [(7 * step + 3 * i) % 100 for i in range(len(sids))]
        logits.append(sess.forward(sids, [[t] for t in nxt]))
    return torch.stack(logits), _state_bytes(sess)


def _check_inf_bit_identical(model, steps=64):
    heads, desc = build_head_map(model, math.inf)
    assert heads == [[False] * model.cfg.linear_num_value_heads for _ in model.cfg.gdn_layers]
    assert "every head f32" in desc
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, model.cfg.vocab_size, (n,), generator=g).tolist() for n in (70, 9, 1)]
    la, sa = _run_engine(model, heads, prompts, steps)
    lb, sb = _run_engine(model, None, prompts, steps)
    if not torch.equal(la, lb):
        lc, _ = _run_engine(model, None, prompts, steps)
        if not torch.equal(lb, lc):
            pytest.fail("the all-f32 engine is not deterministic run to run (an op outside the GDN state path)")
        pytest.fail("threshold inf logits differ from the all-f32 engine")
    assert len(sa) == len(sb)
    for x, y in zip(sa, sb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


@pytest.fixture(scope="module")
def tiny_f32(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("tiny_hybrid"))
    return load_model(ModelConfig.from_pretrained(path), path, torch.float32, "cpu", progress=False)


def test_threshold_inf_bit_identical_to_all_f32_engine(tiny_f32):
    _check_inf_bit_identical(tiny_f32)


@pytest.mark.gpu
def test_gpu_threshold_inf_bit_identical_to_all_f32_engine(tmp_path):
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        path = make_hf_checkpoint(tmp_path)
        model = load_model(ModelConfig.from_pretrained(path), path, torch.bfloat16, "cuda", progress=False)
        _check_inf_bit_identical(model)
    finally:
        torch.use_deterministic_algorithms(False)


def test_hybrid_threshold_runs_both_partitions(tiny_f32):
    """A finite threshold splits heads into both pools; the engine still runs and stays close to all-f32."""
    taus = torch.cat(head_timescales(tiny_f32))
    T = float(taus.median())
    heads, desc = build_head_map(tiny_f32, T)
    flat = [b for m in heads for b in m]
    assert any(flat) and not all(flat), "median threshold must give both partitions"
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (40, 3)]
    la, _ = _run_engine(tiny_f32, heads, prompts, 8)
    lb, _ = _run_engine(tiny_f32, None, prompts, 8)
    assert rel_fro(la, lb) < 2e-2


# ---- the model's GDN layers run our kernels ---------------------------------------------------------


def _model_logits_with_kernels(model, monkeypatch, gdn_triton: bool, f32_fraction: float):
    """Prefill + 3 decode steps of two prompts through the model, counting GDN kernel launches; only the
    GDN ops' dispatch is forced (to Triton, or to the naive reference), every other op runs as usual."""
    import linrnn_kernels.gdn as gdn_ops

    calls = {"decode": 0, "prefill": 0, "conv_decode": 0, "conv_varlen": 0}

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(decode_k, "gdn_decode", counted("decode", decode_k.gdn_decode))
    monkeypatch.setattr(prefill_k, "gdn_prefill", counted("prefill", prefill_k.gdn_prefill))
    monkeypatch.setattr(conv_k, "conv1d_decode", counted("conv_decode", conv_k.conv1d_decode))
    monkeypatch.setattr(conv_k, "conv1d_varlen", counted("conv_varlen", conv_k.conv1d_varlen))
    # decode batches the skinny GEMM takes run the conv in the in_proj kernel's epilogue (layers/gdn.py): count it
    # as the conv decode it replaces
    import linrnn_kernels.gemv as gemv_ops
    fused_linear = gemv_ops.fused_linear

    def fused_linear_counted(*a, **k):
        if k.get("epilogue") == "conv":
            calls["conv_decode"] += 1
        return fused_linear(*a, **k)

    monkeypatch.setattr(gemv_ops, "fused_linear", fused_linear_counted)
    # on CPU, forcing Triton runs the kernels under the interpreter inside the real layer
    monkeypatch.setattr(gdn_ops, "use_triton", lambda t: gdn_triton)
    logits, _ = _run_engine(model, head_map_for(model, f32_fraction), [[5, 6, 7] * 23, [9, 8]], 3, greedy=False)
    return logits, calls


def head_map_for(model, f32_fraction):
    kind = "f32" if f32_fraction == 1 else str(f32_fraction)
    return [head_map(model.cfg.linear_num_value_heads, kind) for _ in model.cfg.gdn_layers]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model cannot launch compiled kernels; "
                    "test_gpu_model_gdn_layers_run_triton_kernels runs this check on CUDA")
@pytest.mark.parametrize("f32_fraction,tol", [(1.0, 1e-4), (0.5, 1e-2)])
def test_model_gdn_layers_run_triton_kernels(tiny_f32, monkeypatch, f32_fraction, tol):
    """The layer's strided q/k/v/a/b views go through the Triton kernels (interpreter) and match the
    naive reference ops; with bf16 heads the interpreter's bf16 rounding (truncation) differs from torch's."""
    with monkeypatch.context() as m:
        ref, ref_calls = _model_logits_with_kernels(tiny_f32, m, False, f32_fraction)
    got, calls = _model_logits_with_kernels(tiny_f32, monkeypatch, True, f32_fraction)
    assert ref_calls == {"decode": 0, "prefill": 0, "conv_decode": 0, "conv_varlen": 0}
    n_gdn = len(tiny_f32.cfg.gdn_layers)
    assert calls == {"decode": 3 * n_gdn, "prefill": n_gdn, "conv_decode": 3 * n_gdn, "conv_varlen": n_gdn}
    assert rel_max(got, ref) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("f32_fraction,tol", [(1.0, 1e-4), (0.5, 1e-2)])
def test_gpu_model_gdn_layers_run_triton_kernels(tmp_path, monkeypatch, f32_fraction, tol):
    """f32 activations: the model on CUDA runs our GDN kernels and matches the naive GDN ops."""
    path = make_hf_checkpoint(tmp_path)
    model = load_model(ModelConfig.from_pretrained(path), path, torch.float32, "cuda", progress=False)
    with monkeypatch.context() as m:
        ref, _ = _model_logits_with_kernels(model, m, False, f32_fraction)
    got, calls = _model_logits_with_kernels(model, monkeypatch, True, f32_fraction)
    n_gdn = len(model.cfg.gdn_layers)
    assert calls == {"decode": 3 * n_gdn, "prefill": n_gdn, "conv_decode": 3 * n_gdn, "conv_varlen": n_gdn}
    # bf16 heads: a state element next to a rounding boundary may round the other way
    assert rel_max(got, ref) <= tol


# ---- prefill + decode == token-by-token decode ----------------------------------------------------------


def _prefill_then_decode(shape, lens, n_prefill, kind, dtype, device):
    """Sequences of `lens` tokens; path A prefills the first n_prefill[i] tokens (chunked kernel + varlen
    conv) then decodes the rest one token per step; path B decodes every token from an empty state."""
    Hk, Hv, Dk, Dv = shape["Hk"], shape["Hv"], shape["Dk"], shape["Dv"]
    B, L = len(lens), max(lens)
    C = 2 * Hk * Dk + Hv * Dv
    slots = B + 2
    idx = torch.arange(1, B + 1, dtype=torch.int32, device=device)
    g = torch.Generator().manual_seed(3)
    x_raw = torch.randn(B, L, C, generator=g).to(device=device, dtype=dtype)  # pre-conv q/k/v inputs
    w_conv = (0.5 * torch.randn(C, 4, generator=g)).to(device=device, dtype=dtype)
    _, _, _, a_all, b_all, A_log, dt_bias = make_inputs(B * L, Hk, Hv, Dk, Dv, dtype, device)
    a_all, b_all = a_all.reshape(B, L, Hv), b_all.reshape(B, L, Hv)
    mask = head_map(Hv, kind)

    def split(y):  # conv output [n, C] -> q, k, v views
        n = y.shape[0]
        return (y[:, :Hk * Dk].view(n, Hk, Dk), y[:, Hk * Dk:2 * Hk * Dk].view(n, Hk, Dk),
                y[:, 2 * Hk * Dk:].view(n, Hv, Dv))

    def fresh():
        f32, bf, isb, loc = make_pools(Hv, Dk, Dv, slots, mask, [], device)
        f32.zero_(), bf.zero_()
        return f32, bf, isb, loc, torch.zeros(slots, 3, C, device=device, dtype=dtype)

    def decode_steps(pools, start):  # decode tokens start[i]..lens[i]-1 of each sequence, batched per step
        f32, bf, isb, loc, cst = pools
        outs = {}
        for t in range(L):
            rows = [i for i in range(B) if start[i] <= t < lens[i]]
            if not rows:
                continue
            r = torch.tensor(rows, device=device)
            y = conv_k.conv1d_decode(x_raw[r, t], w_conv, cst, idx[r])
            q, k, v = split(y)
            o = decode_k.gdn_decode(q, k, v, a_all[r, t], b_all[r, t], A_log, dt_bias, f32, bf, isb, loc, idx[r])
            for j, i in enumerate(rows):
                outs[(i, t)] = o[j]
        return outs

    # path A
    pa = fresh()
    f32, bf, isb, loc, cst = pa
    cu = torch.tensor([0] + torch.tensor(n_prefill).cumsum(0).tolist(), dtype=torch.int32, device=device)
    xs = torch.cat([x_raw[i, :n] for i, n in enumerate(n_prefill)])
    y = conv_k.conv1d_varlen(xs, w_conv, cst, cu, idx)
    q, k, v = split(y)
    a_p = torch.cat([a_all[i, :n] for i, n in enumerate(n_prefill)])
    b_p = torch.cat([b_all[i, :n] for i, n in enumerate(n_prefill)])
    o_pre = prefill_k.gdn_prefill(q, k, v, a_p, b_p, A_log, dt_bias, cu, f32, bf, isb, loc, idx)
    outs_a = decode_steps(pa, n_prefill)
    for i, n in enumerate(n_prefill):
        for t in range(n):
            outs_a[(i, t)] = o_pre[cu[i] + t]
    # path B
    pb = fresh()
    outs_b = decode_steps(pb, [0] * B)
    keys = sorted(outs_b)
    assert sorted(outs_a) == keys
    oa = torch.stack([outs_a[kk] for kk in keys])
    ob = torch.stack([outs_b[kk] for kk in keys])
    return oa, ob, pa, pb


@pytest.mark.parametrize("kind", ["f32", "0.5"])
def test_prefill_then_decode_equals_token_by_token(kind):
    oa, ob, pa, pb = _prefill_then_decode(SMALL, [70, 5, 1], [66, 2, 1], kind, torch.float32, KERNEL_DEVICE)
    _check_paths(oa, ob, pa, pb, kind, exact_dtype=True)


def test_prefill_then_decode_blocked_bf16_layout():
    """Dv = 128: the bf16 partition holds two column blocks per head (linrnn_kernels/gdn/layout.py); the state
    the prefill writes is the state decode reads."""
    oa, ob, pa, pb = _prefill_then_decode(BLOCKED, [70, 5, 1], [66, 2, 1], "0.5", torch.float32, KERNEL_DEVICE)
    _check_paths(oa, ob, pa, pb, "0.5", exact_dtype=True)


def _check_paths(oa, ob, pa, pb, kind, exact_dtype):
    # f32 heads: two exact-arithmetic orders of the same recurrence. bf16 heads: decode rounds the state
    # every token, prefill once per sequence, so they drift apart by a few bf16 roundings.
    if kind == "f32" and exact_dtype:
        assert rel_max(oa, ob) <= 1e-5
    else:
        assert rel_fro(oa, ob) <= 2e-2
    assert rel_max(pa[0], pb[0]) <= (1e-5 if exact_dtype else 1e-2)  # f32 partition
    if pa[1].shape[1]:
        assert rel_fro(pa[1], pb[1]) <= 2e-2  # bf16 partition
    assert torch.equal(pa[4], pb[4])  # conv state: copies of inputs


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["f32", "0.3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_prefill_then_decode_equals_token_by_token(kind, dtype):
    oa, ob, pa, pb = _prefill_then_decode(FULL, [200, 64, 1, 65], [130, 63, 1, 64], kind, dtype, "cuda")
    _check_paths(oa, ob, pa, pb, kind, exact_dtype=dtype == torch.float32)


# ---- padded rows (dummy slot 0) ---------------------------------------------------------------------------


def _padded_rows(shape, device, dtype):
    Hk, Hv, Dk, Dv = shape["Hk"], shape["Hv"], shape["Dk"], shape["Dv"]
    slots = 8
    C = 2 * Hk * Dk + Hv * Dv
    f32, bf, isb, loc = make_pools(Hv, Dk, Dv, slots, head_map(Hv, "0.5"), list(range(slots)), device)
    cst = torch.randn(slots, 3, C, device=device).to(dtype)
    w_conv = (0.5 * torch.randn(C, 4, device=device)).to(dtype)
    rows = torch.tensor([3, 0, 5, 0], dtype=torch.int32, device=device)  # two live rows, two padded
    x = torch.randn(4, C, device=device).to(dtype)
    _, _, _, a, b, A_log, dt_bias = make_inputs(4, Hk, Hv, Dk, Dv, dtype, device)
    before = [t.clone() for t in (f32, bf, cst)]
    # one launch config for both batch sizes: a different tile shape would reorder the Dk reduction
    cfg = decode_k.decode_config(4, Hv, Dk, Dv, torch.device(device))

    def step(sel):
        y = conv_k.conv1d_decode(x[sel], w_conv, cst, rows[sel])
        q, k, v = y[:, :Hk * Dk].view(-1, Hk, Dk), y[:, Hk * Dk:2 * Hk * Dk].view(-1, Hk, Dk), y[:, 2 * Hk * Dk:]
        return decode_k.gdn_decode(q, k, v.view(-1, Hv, Dv), a[sel], b[sel], A_log, dt_bias, f32, bf, isb, loc,
                                   rows[sel], config=cfg)

    o_pad = step(torch.arange(4, device=device))
    untouched = [s for s in range(slots) if s not in (0, 3, 5)]
    for new, old in zip((f32, bf, cst), before):
        assert torch.equal(new[untouched].view(torch.uint8), old[untouched].view(torch.uint8))
    after_pad = [t.clone() for t in (f32, bf, cst)]
    # the live rows alone, from the same starting state: same bytes in slots 3 and 5, same outputs
    for t, old in zip((f32, bf, cst), before):
        t.copy_(old)
    o_live = step(torch.tensor([0, 2], device=device))
    assert torch.equal(o_live, o_pad[[0, 2]])
    for new, ref in zip((f32, bf, cst), after_pad):
        assert torch.equal(new[[3, 5]].view(torch.uint8), ref[[3, 5]].view(torch.uint8))
    # an all-padding batch touches only slot 0
    snap = [t.clone() for t in (f32, bf, cst)]
    step(torch.tensor([1, 3], device=device))
    for new, old in zip((f32, bf, cst), snap):
        assert torch.equal(new[1:].view(torch.uint8), old[1:].view(torch.uint8))


def test_padded_rows_leave_live_slots_unchanged():
    _padded_rows(SMALL, KERNEL_DEVICE, torch.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_padded_rows_leave_live_slots_unchanged(dtype):
    _padded_rows(FULL, "cuda", dtype)
