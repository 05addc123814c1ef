"""The decode step with every Triton kernel (the interpreter on CPU) against the reference ops, on tiny
models: covers the layer wiring of the fused kernels (router + alignment, shared expert with its
gate / residual / next-norm epilogue, GDN gated-norm and attention output-gate prologues, dense MLP
layers), and their fallbacks when switched off. Plus the CPU launch counter of a 35B-A3B step."""
from __future__ import annotations

import copy

import pytest
import torch

from helpers import make_hf_checkpoint, rel_err
from linrnn_kernels.dispatch import reference_ops, triton_on
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model
from linrnn_serve.runner.session import Session


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _decode_logits(model, kernels: bool):
    """Reference prefill (both runs decode from the same state), then one decode step with the Triton
    kernels (compiled on CUDA, the interpreter on CPU) or with the reference ops."""
    torch.manual_seed(1)
    s = Session(model, 3, 64)
    sids = [s.new_seq() for _ in range(3)]
    prompts = [torch.randint(0, 128, (n,)).tolist() for n in (5, 9, 3)]
    with reference_ops():
        s.forward(sids, prompts)
    nxt = [[7], [11], [13]]
    if not kernels:
        with reference_ops():
            return s.forward(sids, nxt), s
    if CUDA:
        return s.forward(sids, nxt), s
    with triton_on("cpu"):
        return s.forward(sids, nxt), s


@pytest.mark.parametrize("family,kw", [("qwen3_5_moe", {}),
                                       ("qwen3_next", {"mlp_only_layers": [1], "intermediate_size": 48})])
@pytest.mark.parametrize("switches", [{"LINRNN_SKINNY_GEMM": "1", "LINRNN_FUSED_ROUTER": "1", "LINRNN_FUSED_ROPE_KV": "1"},
                                      {"LINRNN_FUSED_MOE_COMBINE": "1"},
                                      {"LINRNN_SKINNY_GEMM": "0", "LINRNN_FUSED_ROUTER": "0"}],
                         ids=["fused", "fused+combine", "unfused"])
def test_decode_step_kernels_match_reference(tmp_path, monkeypatch, family, kw, switches):
    for k, v in switches.items():
        monkeypatch.setenv(k, v)
    path = make_hf_checkpoint(tmp_path, family, **kw)
    model = load_model(ModelConfig.from_pretrained(path), str(path), torch.float32, DEVICE, progress=False)
    ref, s_ref = _decode_logits(model, kernels=False)
    out, s_out = _decode_logits(model, kernels=True)
    assert not torch.isnan(out).any()
    assert rel_err(out, ref) <= 1e-4
    for a, b in zip(s_out.caches.state.ssm_f32, s_ref.caches.state.ssm_f32):
        assert rel_err(a, b) <= 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="counts on meta / CPU tensors; the GPU profile counts there")
def test_launch_counter_35b_step(monkeypatch):
    """The 35B-A3B NVFP4 decode step at npl 1, counted on meta tensors: at most 400 launches with the
    fused kernels (889 before them), and the counter sees the fallbacks when they are switched off."""
    import os

    from linrnn_bench.launch_count import count_decode_launches
    from linrnn_serve.presets import resolve_model

    for k, v in {"LINRNN_SKINNY_GEMM": "1", "LINRNN_FUSED_ROUTER": "1", "LINRNN_FUSED_ROPE_KV": "1"}.items():
        monkeypatch.setenv(k, v)
    cfg = resolve_model("qwen35moe-nvfp4", "dummy").cfg
    fused = count_decode_launches(cfg, 1)
    assert fused["triton:_router_kernel"] == 40 and "triton:_route_kernel" not in fused
    assert sum(fused.values()) <= 400, fused.most_common(12)
    from linrnn_kernels.gemv import config as gcfg

    for npl in (8, 32):  # the fused router runs up to the measured table's max_m, the unfused one above it
        fused_router = gcfg.fused_router_enabled(npl)
        assert count_decode_launches(cfg, npl)["triton:_router_kernel"] == (40 if fused_router else 0)
    assert gcfg.fused_router_enabled(8)
    old = dict(os.environ)
    try:
        os.environ.update({"LINRNN_SKINNY_GEMM": "0", "LINRNN_FUSED_ROUTER": "0"})
        unfused = count_decode_launches(cfg, 1)
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert unfused["triton:_route_kernel"] == 40 and unfused["triton:_align_kernel"] == 40
    # 723: 843 since the route kernel writes bf16 weights (no cast launch), less the shared-expert join's sigmoid,
    # mul and add (40 x 3), now inside the residual-add norm (kernels/norm add_rmsnorm's gated addend)
    assert sum(unfused.values()) >= 700
