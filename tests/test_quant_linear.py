"""Quantized dense linear (kernels/quant/linear.py) against dequantize-then-matmul.

CPU: the shared grouped-GEMM kernel under TRITON_INTERPRET=1 (f32 compute, plain-Triton NVFP4
decode), with shapes that exercise ragged N / K / T masks and split-K. GPU (`-m gpu`): bf16
activations at real projection shapes, both NVFP4 decodes and FP8.
"""
from __future__ import annotations

import os

import pytest
import torch

from helpers import KERNEL_DEVICE
from linrnn_kernels.moe import grouped_gemm as gg
from linrnn_kernels.quant import WeightTensor, linear, nvfp4
from linrnn_kernels.quant.linear import linear_naive, linear_triton

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = KERNEL_DEVICE


def rel_err(y, ref) -> float:
    return float((y.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture
def nan_buffers(monkeypatch):
    def alloc(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(gg, "alloc", alloc)


def make_weight(fmt: str, N: int, K: int, device=DEV, dtype=torch.float32) -> WeightTensor:
    W = torch.randn(N, K, device=device) * 0.02
    if fmt == "dense":
        return WeightTensor("dense", W.to(dtype))
    if fmt == "fp8":
        rs = W.abs().amax(-1) / 448.0
        return WeightTensor("fp8", (W / rs[:, None]).to(torch.float8_e4m3fn), None, rs)
    # two fused parts with their own global scale (e.g. q and k of one projection)
    parts = [nvfp4.quantize(Wp) for Wp in W.split([N // 2, N - N // 2])]
    return WeightTensor("nvfp4", torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]),
                        torch.cat([p[2].expand(p[0].shape[0]) for p in parts]).float().contiguous())


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "dense"])
@pytest.mark.parametrize("T,N,K", [(1, 48, 96), (5, 64, 64), (37, 40, 192)])
@pytest.mark.parametrize("split", [1, 2])
def test_linear_triton_interpreter(nan_buffers, fmt, T, N, K, split):
    w = make_weight(fmt, N, K)
    x = torch.randn(T, K, device=DEV)
    cfg = gg.GemmConfig(16, 32, 64, split)
    y = linear_triton(x, w, config=cfg, nvfp4_path="triton")
    ref = linear_naive(x, w)
    assert not y.isnan().any()
    assert rel_err(y, ref) <= 1e-5


def test_linear_keeps_leading_dims_and_default_config(nan_buffers):
    w = make_weight("nvfp4", 32, 64)
    x = torch.randn(2, 3, 64, device=DEV).bfloat16()
    y = linear_triton(x, w, nvfp4_path="triton")
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    assert rel_err(y, linear_naive(x, w)) <= 1e-2


def test_linear_dispatch():
    """dense -> F.linear; quantized formats on CPU -> the naive reference."""
    x = torch.randn(3, 64)
    wd = make_weight("dense", 16, 64, device="cpu")
    torch.testing.assert_close(linear(x, wd), x @ wd.data.t())
    wq = make_weight("fp8", 16, 64, device="cpu")
    torch.testing.assert_close(linear(x, wq), linear_naive(x, wq))


def test_linear_rejects_too_small_block_k():
    w = make_weight("nvfp4", 32, 64)
    with pytest.raises(ValueError, match="block_k"):
        linear_triton(torch.randn(2, 64, device=DEV), w, config=gg.GemmConfig(16, 32, 32))


def test_linear_rejects_mismatched_shapes():
    w = make_weight("nvfp4", 32, 64)
    with pytest.raises(ValueError, match="features"):
        linear_triton(torch.randn(2, 48, device=DEV), w)
    bad = WeightTensor("nvfp4", w.data, w.block_scale[:, :2].contiguous(), w.row_scale)
    with pytest.raises(ValueError, match="block_scale"):
        linear_triton(torch.randn(2, 64, device=DEV), bad)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 64, 300])
@pytest.mark.parametrize("N,K", [(2048, 4096), (8192, 2048)])
@pytest.mark.parametrize("fmt,path", [("nvfp4", "asm"), ("nvfp4", "triton"), ("fp8", None)])
def test_linear_gpu(nan_buffers, T, N, K, fmt, path):
    w = make_weight(fmt, N, K)
    x = torch.randn(T, K, device="cuda").bfloat16()
    y = linear_triton(x, w, nvfp4_path=path)
    ref = linear_naive(x, w)
    assert not y.isnan().any()
    assert rel_err(y, ref) <= 1e-2
    with torch.no_grad():
        assert torch.equal(linear(x, w), linear_triton(x, w))  # dispatch takes the Triton path


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 10,
                    reason="the W4A4 dot_scaled NVFP4 path needs FP4 tensor cores (sm_100+); none here")
@pytest.mark.parametrize("T", [1, 64, 300])
def test_linear_dot_scaled_w4a4(nan_buffers, T):
    w = make_weight("nvfp4", 2048, 4096)
    x = torch.randn(T, 4096, device="cuda").bfloat16()
    y = linear_triton(x, w, nvfp4_path="dot_scaled")
    assert not y.isnan().any()
    assert rel_err(y, linear_naive(x, w, activations="nvfp4")) <= 1e-2


@pytest.mark.parametrize("N", [257, 9, 256])
def test_dense_linear_pads_unaligned_outputs(N):
    """The MoE gate's 257 outputs: padded to an aligned row stride (cuBLAS' fast kernels), same values."""
    from linrnn_kernels.quant.linear import OUT_ALIGN, dense_linear
    x, w = torch.randn(33, 64), torch.randn(N, 64)
    y = dense_linear(x, w, align=True)
    assert y.shape == (33, N) and y.stride(0) % OUT_ALIGN == 0
    assert (y.stride(0) == N) == (N % OUT_ALIGN == 0)
    torch.testing.assert_close(y, x @ w.t(), rtol=1e-5, atol=1e-5)
    assert dense_linear(x, w, align=False).is_contiguous()
    if N == 257:  # the router consumes the strided view as it is
        from linrnn_kernels.moe import route
        ref_w, ref_ids = route((x @ w.t())[:, :256].contiguous(), 8, True)
        got_w, got_ids = route(y[:, :256], 8, True)
        assert torch.equal(got_ids, ref_ids) and torch.equal(got_w, ref_w)
