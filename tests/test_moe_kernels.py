"""Sparse-MoE Triton kernels (kernels/moe) against the naive oracle (kernels/moe/naive.py).

CPU: the kernels run under TRITON_INTERPRET=1 on a tiny MoE (E=8, top-2, H=64, I=32). The
interpreter cannot do bf16 arithmetic, inline PTX or dot_scaled, so there the GEMMs compute in f32
with the plain-Triton NVFP4 decode; the GPU tests (`-m gpu`) cover bf16, the inline-PTX decode and
Qwen3.5-35B-A3B shapes (E=256, top-8, H=2048, I=512).
"""
from __future__ import annotations

import math
import os

import pytest
import torch
import triton
import triton.language as tl

from helpers import KERNEL_DEVICE
from linrnn_kernels.moe import align, experts, naive, router
from linrnn_kernels.moe import grouped_gemm as gg
from linrnn_kernels.quant import WeightTensor, nvfp4

CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEV = KERNEL_DEVICE


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.double(), ref.double()
    return float((y - ref).norm() / ref.norm())


@pytest.fixture
def nan_buffers(monkeypatch):
    """Every kernel output / intermediate starts as NaN so an unwritten element fails the test."""
    def alloc(*shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else torch.iinfo(dtype).max
        return torch.full(shape, fill, dtype=dtype, device=device)
    monkeypatch.setattr(gg, "alloc", alloc)


def quantize(W: torch.Tensor, fmt: str, parts: int = 1, dtype=torch.bfloat16) -> WeightTensor:
    """W [..., N, K] (f32) in `fmt`; with parts=2 the two row halves (gate, up) get their own
    global scale, as in real checkpoints (one weight_scale_2 per projection)."""
    if fmt == "dense":
        return WeightTensor("dense", W.to(dtype).contiguous())
    if fmt == "fp8":
        rs = W.abs().amax(-1).clamp_min(1e-12) / 448.0
        return WeightTensor("fp8", (W / rs[..., None]).to(torch.float8_e4m3fn), None, rs.float().contiguous())
    packed, sbs, rss = [], [], []
    for Wp in W.chunk(parts, dim=-2):
        p, sb, ws2 = nvfp4.quantize(Wp)
        packed.append(p)
        sbs.append(sb)
        rss.append(ws2[..., None].expand(*Wp.shape[:-1]))
    return WeightTensor("nvfp4", torch.cat(packed, -2).contiguous(), torch.cat(sbs, -2).contiguous(),
                        torch.cat(rss, -1).float().contiguous())


def realistic_routing(T: int, E: int, H: int, k: int, device, gen=None):
    """Router logits from random hidden states and a router at HF init scale (std 0.02), so
    routing is skewed the way real routers are, not uniform by construction."""
    x = torch.randn(T, H, device=device, generator=gen)
    w_router = torch.randn(E, H, device=device, generator=gen) * 0.02
    return x, x @ w_router.t()


# --------------------------------------------------------------------------------------- router

@pytest.mark.parametrize("T,E,k", [(1, 8, 2), (5, 8, 2), (300, 64, 8), (37, 256, 8)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_route_matches_naive(T, E, k, renormalize):
    logits = torch.randn(T, E, device=DEV) * 2
    w, ids = router.route(logits, k, renormalize)
    w_ref, ids_ref = naive.route(logits, k, renormalize)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)  # GPU exp is ex2.approx


def test_route_weights_in_activation_dtype():
    """weight_dtype=bf16: the f32 weights rounded once in the kernel (no separate cast launch)."""
    logits = torch.randn(37, 256, device=DEV) * 2
    w32, ids32 = router.route(logits, 8, True)
    w16, ids16 = router.route(logits, 8, True, weight_dtype=torch.bfloat16)
    assert w16.dtype == torch.bfloat16 and torch.equal(ids16, ids32)
    exact = DEV == "cuda"  # the CPU interpreter's f32 -> bf16 cast truncates
    assert torch.allclose(w16.float(), w32.bfloat16().float(), rtol=0 if exact else 2 ** -7, atol=0)


def test_route_strided_bf16_logits():
    """The layer passes a column slice of the fused router/shared-gate GEMM output, in bf16."""
    fused = torch.randn(9, 8 + 1, device=DEV).to(torch.bfloat16)
    w, ids = router.route(fused[:, :8], 2, True)
    w_ref, ids_ref = naive.route(fused[:, :8], 2, True)
    assert torch.equal(ids.long(), ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-7)  # GPU exp is ex2.approx


def test_route_rejects_bad_top_k():
    with pytest.raises(ValueError, match="top_k"):
        router.route(torch.randn(2, 4, device=DEV), 5, True)


# ---------------------------------------------------------------------------------------- align

@pytest.mark.parametrize("T,E,k,block_m", [(1, 8, 2, 16), (7, 8, 2, 16), (40, 8, 2, 16), (40, 8, 2, 32),
                                          (20, 64, 8, 16), (3, 256, 8, 16), (200, 256, 8, 16), (257, 256, 8, 8)])
def test_align_matches_naive(T, E, k, block_m):
    """Every path of the one-launch kernel: ids in registers (ONE_PASS, up to 2048 pairs, 1600 not a power of two)
    and two passes over 1024-pair chunks (2056 pairs)."""
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).int()
    sorted_ids, expert_ids, num_padded = align.moe_align_block_size(ids, E, block_m)
    ref_sorted, ref_experts, ref_padded = naive.moe_align_block_size(ids, E, block_m)
    assert int(num_padded) == ref_padded
    assert sorted_ids.numel() == align.max_padded_pairs(T * k, E, block_m) >= ref_padded
    assert torch.equal(sorted_ids[:ref_padded], ref_sorted)
    used = ref_padded // block_m
    assert torch.equal(expert_ids[:used], ref_experts)
    assert bool((expert_ids[used:] == -1).all())


def test_align_skewed_routing():
    """Hot experts that span several blocks, and most experts unused."""
    T, E, k = 50, 16, 2
    ids = torch.stack([torch.tensor([t % 2, 2 + (t % 3)]) for t in range(T)]).to(DEV)
    sorted_ids, expert_ids, num_padded = align.moe_align_block_size(ids, E, 16)
    ref_sorted, ref_experts, ref_padded = naive.moe_align_block_size(ids, E, 16)
    assert int(num_padded) == ref_padded
    assert torch.equal(sorted_ids[:ref_padded], ref_sorted)
    assert torch.equal(expert_ids[:len(ref_experts)], ref_experts)


@pytest.mark.parametrize("T,E,k,block_m,chunk_min,skew", [
    (512, 256, 8, 64, None, False),   # the prefill shape: one chunk of 4096 pairs
    (1100, 64, 4, 16, None, True),    # several 1024-pair chunks, a partial last one, hot experts
    (300, 256, 8, 64, 64, True),      # 38 chunks of 64 pairs, most experts unused
    (250, 48, 3, 8, 32, False),       # E not a power of two, small blocks
    (700, 64, 8, 256, None, True),    # the wgmma kernel's widest blocks (64 << 2 slots)
    (420, 512, 10, 64, None, False),  # Qwen3-Next's 512 experts, top-10 (a [chunks, 512] scan tile)
])
def test_align_chunked_matches_naive(monkeypatch, T, E, k, block_m, chunk_min, skew):
    """The chunked alignment (count -> scan -> place, from align.CHUNKED_MIN_PAIRS pairs) gives the naive
    reference exactly; outputs poisoned first, ids outside [0, E) ignored as by the one-launch kernel."""
    monkeypatch.setattr(align, "CHUNKED_MIN_PAIRS", 1)
    if chunk_min:
        monkeypatch.setattr(align, "_CHUNK_MIN", chunk_min)
    assert align._chunk_size(T * k, E) is not None
    real_empty = torch.empty
    monkeypatch.setattr(align.torch, "empty", lambda *a, **kw: real_empty(*a, **kw).fill_(-7))
    g = torch.Generator().manual_seed(T)
    if skew:  # a third of the pairs on 3 experts
        hot = torch.randint(0, 3, (T, k), generator=g)
        ids = torch.where(torch.rand(T, k, generator=g) < 0.33, hot, torch.randint(0, E, (T, k), generator=g))
    else:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    ids[T // 2, 0] = E  # an id outside [0, E): ignored
    ids = ids.int().to(DEV)
    sorted_ids, expert_ids, num_padded = align.moe_align_block_size(ids, E, block_m)
    ref_sorted, ref_experts, ref_padded = naive.moe_align_block_size(ids, E, block_m)
    assert int(num_padded) == ref_padded
    assert torch.equal(sorted_ids[:ref_padded], ref_sorted)
    used = ref_padded // block_m
    assert torch.equal(expert_ids[:used], ref_experts)
    assert bool((expert_ids[used:] == -1).all())


@pytest.mark.parametrize("T,E,k,block_m", [(1, 256, 8, 8), (3, 16, 8, 8), (8, 12, 8, 8), (5, 7, 3, 8),
                                          (8, 24, 10, 8), (2, 4, 1, 8), (11, 40, 4, 16)])
def test_pair_blocks_match_naive(monkeypatch, T, E, k, block_m):
    """Pair blocks (block b = pair b, token n in slot n, repeated experts skipped): the naive reference
    exactly (outputs poisoned first), hot experts shared by several tokens included (small E),
    non-power-of-two top-k."""
    ids = torch.stack([torch.randperm(E, device=DEV)[:k] for _ in range(T)]).int()
    real = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: real(*a, **kw).fill_(torch.iinfo(torch.int32).max))
    sorted_ids, expert_ids, num_padded = align.moe_pair_blocks(ids, block_m)
    ref_sorted, ref_experts, ref_padded = naive.moe_pair_blocks(ids, block_m)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(expert_ids, ref_experts)
    assert int(num_padded) == ref_padded == T * k * block_m
    # every pair sits in exactly one live block, in its token's slot
    live = (expert_ids >= 0).repeat_interleave(block_m)
    placed = sorted_ids[live & (sorted_ids < T * k)].sort().values
    assert torch.equal(placed.long(), torch.arange(T * k, device=DEV))
    with pytest.raises(ValueError, match="pair blocks"):
        align.moe_pair_blocks(ids.repeat(9, 1), 8)


# ------------------------------------------------------------------------------- NVFP4 decoding

def _decode_all_bytes(mode: str):
    """Decode every byte value under E4M3 scales from subnormal to max through the kernel's
    _dequant_nvfp4, and compare with nvfp4.dequantize: equal, since both are exact products."""

    @triton.jit
    def kernel(p_ptr, s_ptr, out_ptr, R: tl.constexpr, C: tl.constexpr, COMPUTE: tl.constexpr,
               ASM: tl.constexpr):
        r = tl.arange(0, R)
        c = tl.arange(0, C)
        packed = tl.load(p_ptr + r[:, None] * C + c[None, :])
        scale = tl.load(s_ptr + r[:, None] * (C // 4) + tl.arange(0, C // 4)[None, :])
        w0, w1, w2, w3 = gg._dequant_nvfp4(packed, scale, COMPUTE, ASM)
        offs = r[:, None] * (4 * C) + 4 * c[None, :]  # code j of element e is column 4e + j
        tl.store(out_ptr + offs, w0.to(tl.float32))
        tl.store(out_ptr + offs + 1, w1.to(tl.float32))
        tl.store(out_ptr + offs + 2, w2.to(tl.float32))
        tl.store(out_ptr + offs + 3, w3.to(tl.float32))

    R, C = 16, 128  # 16 scales x all 256 byte values (128 16-bit elements) per row
    packed = torch.arange(256, dtype=torch.uint8).repeat(R, 1).to(DEV)
    scale_vals = torch.tensor([2.0 ** -9, 2.0 ** -7 * 3, 0.015625, 0.1, 0.5, 1.0, 1.125, 3.0, 7.5, 10.0,
                               52.0, 100.0, 240.0, 288.0, 416.0, 448.0])
    scales = scale_vals.to(torch.float8_e4m3fn)[:, None].expand(R, C // 4).contiguous().to(DEV)
    out = torch.full((R, 4 * C), float("nan"), device=DEV)
    compute = tl.float32 if INTERPRET else tl.bfloat16
    kernel[(1,)](packed.view(torch.int16), scales, out, R=R, C=C, COMPUTE=compute, ASM=mode == "asm")
    ref = nvfp4.dequantize(packed, scales, torch.ones(R, device=DEV))
    if mode == "asm":  # the asm decode yields W * 2^-7 (undone in the GEMM epilogue)
        ref = ref / gg.ASM_DECODE_GAIN.value
    assert torch.equal(out, ref)


def test_nvfp4_decode_exhaustive_triton():
    _decode_all_bytes("triton")


@pytest.mark.gpu
def test_nvfp4_decode_exhaustive_asm():
    _decode_all_bytes("asm")


def test_quantize_rows_nvfp4_matches_reference(nan_buffers):
    """W4A4 activation quantizer (dot_scaled path) = nvfp4.quantize per row, bit for bit; rows
    with zeros, outliers and a K that is not a power of two."""
    x = torch.randn(5, 96, device=DEV) * torch.tensor([1.0, 30.0, 1e-3, 1.0, 0.0], device=DEV)[:, None]
    x[3, 7] = 500.0
    x = x.bfloat16()
    codes, scales, gain = gg.quantize_rows_nvfp4(x)
    ref_codes, ref_scales, ref_gain = naive.quantize_rows_nvfp4(x)
    assert torch.equal(codes, ref_codes)
    assert torch.equal(scales.view(torch.uint8), ref_scales.view(torch.uint8))
    assert torch.equal(gain, ref_gain)


# ------------------------------------------------------------------------- experts, tiny (CPU)

TINY = dict(E=8, k=2, H=64, I=32)


@pytest.fixture(scope="module")
def tiny_weights():
    g = torch.Generator().manual_seed(1)
    E, H, I = TINY["E"], TINY["H"], TINY["I"]
    W13 = torch.randn(E, 2 * I, H, generator=g) * 0.05
    W2 = torch.randn(E, H, I, generator=g) * 0.05
    return {fmt: (quantize(W13.to(DEV), fmt, parts=2, dtype=torch.float32), quantize(W2.to(DEV), fmt,
                                                                                     dtype=torch.float32))
            for fmt in ("dense", "fp8", "nvfp4")}


# BLOCK_K 64 > I = 32 also covers the ragged-K masks of the down GEMM
SPLIT_CONFIGS = {
    "split1": (gg.GemmConfig(16, 16, 64, 1), gg.GemmConfig(16, 16, 64, 1)),
    "split2": (gg.GemmConfig(16, 16, 64, 2), gg.GemmConfig(16, 32, 64, 2)),
}


@pytest.mark.parametrize("fmt", ["dense", "fp8", "nvfp4"])
@pytest.mark.parametrize("T,split", [(1, "split2"), (5, "split1"), (13, "split1"), (13, "split2")])
def test_moe_experts_tiny(tiny_weights, nan_buffers, fmt, T, split):
    w13, w2 = tiny_weights[fmt]
    x, logits = realistic_routing(T, TINY["E"], TINY["H"], TINY["k"], DEV)
    topk_w, topk_ids = router.route(logits, TINY["k"], True)
    y = experts.moe_experts(x, topk_w, topk_ids, w13, w2, configs=SPLIT_CONFIGS[split], nvfp4_path="triton")
    ref = naive.moe_experts(x, topk_w, topk_ids.long(), w13, w2)
    assert not y.isnan().any()
    assert rel_err(y, ref) <= 1e-5


@pytest.mark.parametrize("fmt", ["dense", "nvfp4"])
def test_moe_experts_tiny_bf16_activations(tiny_weights, nan_buffers, fmt):
    """bf16 x / intermediate / output (compute in f32 under the interpreter), bf16 routing weights
    as layers/moe.py passes them, default config table."""
    w13, w2 = tiny_weights[fmt]
    x, logits = realistic_routing(6, TINY["E"], TINY["H"], TINY["k"], DEV)
    x = x.bfloat16()
    topk_w, topk_ids = router.route(logits, TINY["k"], True)
    topk_w = topk_w.bfloat16()
    y = experts.moe_experts(x, topk_w, topk_ids, w13, w2, nvfp4_path="triton")
    ref = naive.moe_experts(x, topk_w, topk_ids.long(), w13, w2)
    assert y.dtype == torch.bfloat16 and not y.isnan().any()
    assert rel_err(y, ref) <= 1e-2


def test_moe_experts_prefill_chunks(tiny_weights, nan_buffers, monkeypatch):
    """Long prefills run in token chunks (bounded partials); chunks must tile the output."""
    monkeypatch.setattr(experts, "MAX_CHUNK_TOKENS", 4)
    w13, w2 = tiny_weights["nvfp4"]
    x, logits = realistic_routing(10, TINY["E"], TINY["H"], TINY["k"], DEV)
    topk_w, topk_ids = router.route(logits, TINY["k"], True)
    y = experts.moe_experts(x, topk_w, topk_ids, w13, w2, nvfp4_path="triton")
    ref = naive.moe_experts(x, topk_w, topk_ids.long(), w13, w2)
    assert not y.isnan().any() and rel_err(y, ref) <= 1e-5


def test_moe_experts_rejects_bad_shapes(tiny_weights):
    w13, w2 = tiny_weights["nvfp4"]
    x = torch.randn(3, TINY["H"] + 16, device=DEV)
    ids = torch.zeros(3, 2, dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="w13"):
        experts.moe_experts(x, torch.ones(3, 2, device=DEV), ids, w13, w2)
    with pytest.raises(ValueError, match="topk_weights"):
        experts.moe_experts(x[:, :TINY["H"]], torch.ones(3, 3, device=DEV), ids, w13, w2)


@pytest.mark.skipif(INTERPRET, reason="Triton 3.6's interpreter has neither inline PTX nor dot_scaled: "
                                      "the GPU tests cover the asm path; the W4A4 dot_scaled path needs "
                                      "an sm_100 GPU (none available here: compiled offline only, untested)")
def test_nvfp4_hardware_paths_need_gpu():
    pass


def test_describe_nvfp4_gemm_names_path():
    line = gg.describe_nvfp4_gemm()
    assert line.startswith("NVFP4 GEMM: ") and gg.nvfp4_gemm_path() in ("asm", "triton", "dot_scaled")


def test_dispatch_uses_naive_on_cpu():
    """On CPU tensors the package entry points run the naive reference."""
    import linrnn_kernels.moe as moe_ops

    logits = torch.randn(4, 8)
    w, ids = moe_ops.route(logits, 2, True)
    assert ids.dtype == torch.int64  # naive path


# ------------------------------------------------------------------------ experts, GPU (35B-A3B)

QWEN = dict(E=256, k=8, H=2048, I=512)


@pytest.fixture(scope="module")
def qwen_weights():
    if not CUDA:
        pytest.skip("needs CUDA")
    g = torch.Generator(device="cuda").manual_seed(2)
    E, H, I = QWEN["E"], QWEN["H"], QWEN["I"]
    W13 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * 0.02
    W2 = torch.randn(E, H, I, device="cuda", generator=g) * 0.02
    out = {fmt: (quantize(W13, fmt, parts=2), quantize(W2, fmt)) for fmt in ("dense", "fp8", "nvfp4")}
    del W13, W2
    torch.cuda.empty_cache()
    return out


def _qwen_case(B, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x, logits = realistic_routing(B, QWEN["E"], QWEN["H"], QWEN["k"], "cuda", g)
    topk_w, topk_ids = router.route(logits, QWEN["k"], True)
    return x.bfloat16(), topk_w.bfloat16(), topk_ids


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 7, 64, 300])
@pytest.mark.parametrize("fmt,path", [("nvfp4", "asm"), ("nvfp4", "triton"), ("fp8", None), ("dense", None)])
def test_moe_experts_qwen_shapes(qwen_weights, nan_buffers, B, fmt, path):
    w13, w2 = qwen_weights[fmt]
    x, topk_w, topk_ids = _qwen_case(B)
    y = experts.moe_experts(x, topk_w, topk_ids, w13, w2, nvfp4_path=path)
    ref = naive.moe_experts(x.float(), topk_w, topk_ids.long(), w13, w2)
    assert not y.isnan().any()
    assert rel_err(y, ref) <= 1e-2


@pytest.mark.gpu
def test_moe_dispatch_gpu(qwen_weights):
    """The package entry points take the Triton path on CUDA and agree with reference_ops()."""
    import linrnn_kernels.moe as moe_ops
    from linrnn_kernels import reference_ops

    w13, w2 = qwen_weights["nvfp4"]
    x, topk_w, topk_ids = _qwen_case(16, seed=3)
    _, ids = moe_ops.route(torch.randn(16, QWEN["E"], device="cuda"), QWEN["k"], True)
    assert ids.dtype == torch.int32  # the Triton router
    y = moe_ops.moe_experts(x, topk_w, topk_ids, w13, w2)
    if moe_ops.nvfp4_gemm_path() == "dot_scaled":  # sm_100+: W4A4 by default
        ref, tol = naive.moe_experts(x, topk_w, topk_ids.long(), w13, w2, activations="nvfp4"), 2e-2
    else:
        with reference_ops():
            ref, tol = moe_ops.moe_experts(x, topk_w, topk_ids.long(), w13, w2), 1e-2
    assert rel_err(y, ref.float()) <= tol


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 8, 64])
def test_cuda_graph_bit_identical(qwen_weights, B):
    """Routing + experts captured in a CUDA graph replay to the same bytes as eager (and eager is
    reproducible run to run): no atomics, no host syncs."""
    w13, w2 = qwen_weights["nvfp4"]
    g = torch.Generator(device="cuda").manual_seed(5)
    x, logits = realistic_routing(B, QWEN["E"], QWEN["H"], QWEN["k"], "cuda", g)
    x = x.bfloat16()

    def step():
        topk_w, topk_ids = router.route(logits, QWEN["k"], True)
        return experts.moe_experts(x, topk_w.bfloat16(), topk_ids, w13, w2)

    eager = step()
    assert torch.equal(eager, step())
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up (compiles) outside capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.view(torch.int16), eager.view(torch.int16))


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA or torch.cuda.get_device_capability()[0] < 10,
                    reason="the W4A4 dot_scaled NVFP4 path needs FP4 tensor cores (sm_100+); none here")
@pytest.mark.parametrize("B", [1, 64, 300])
def test_moe_experts_dot_scaled_w4a4(qwen_weights, nan_buffers, B):
    """W4A4 against the W4A4 reference (x and the intermediate rounded to NVFP4 per row); the
    intermediate passes through bf16 before its rounding here, hence the looser bound."""
    w13, w2 = qwen_weights["nvfp4"]
    x, topk_w, topk_ids = _qwen_case(B)
    y = experts.moe_experts(x, topk_w, topk_ids, w13, w2, nvfp4_path="dot_scaled")
    ref = naive.moe_experts(x, topk_w, topk_ids.long(), w13, w2, activations="nvfp4")
    assert not y.isnan().any()
    assert rel_err(y, ref) <= 2e-2


@pytest.mark.gpu
def test_default_configs_fill_the_gpu():
    """Decode configs: BLOCK_M 16 up to B=256 (top-8 of 256), split-K only at tiny batches."""
    for B in (1, 8, 64, 256):
        c13, c2 = experts.moe_configs(B, 8, 256, 512, 2048, "nvfp4", "nvfp4", torch.device("cuda"))
        assert c13.block_m == c2.block_m == 16
        blocks = min(256, B * 8)
        assert blocks * math.ceil(512 / c13.block_n) * c13.split_k >= 128


def test_route_align_pdl_launch_options(monkeypatch):
    """route() and the one-launch alignment are PDL launches where PDL is available (router.ROUTE_PDL), unless
    LINRNN_ROUTE_PDL=0 or pdl=False; pdl=True forces them."""
    x = torch.zeros(2, 4)
    assert router.chain_pdl_kwargs(x, None) == {"PDL": False}  # the CPU: no PDL
    on = {"PDL": True, "launch_pdl": True}
    monkeypatch.setattr(router, "pdl_launch_kwargs", lambda t: on)
    assert router.chain_pdl_kwargs(x, None) == (on if router.ROUTE_PDL else {"PDL": False})
    assert router.chain_pdl_kwargs(x, False) == {"PDL": False} and router.chain_pdl_kwargs(x, True) == on
    monkeypatch.setenv("LINRNN_ROUTE_PDL", "0")
    assert router.chain_pdl_kwargs(x, None) == {"PDL": False} and router.chain_pdl_kwargs(x, True) == on


_PDL_ORDER_PROBE = """
import re, sys, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from linrnn_kernels.moe import align, router, router_fused
cases = {
    "route": (router._route_kernel, dict(TOP_K=8, RENORMALIZE=True, BLOCK_T=1, BLOCK_E=256, BLOCK_K=8, PDL=True)),
    "align": (align._align_kernel, dict(BLOCK_M=8, BLOCK_E=256, BLOCK_P=64, PDL=True, ONE_PASS=True)),
    "route_align": (router_fused._route_align_kernel, dict(
        TOP_K=8, RENORMALIZE=True, BLOCK_E=256, BLOCK_TOPK=8, BLOCK_M_ALIGN=8, BLOCK_P=16, BLOCK_B=32, PAIR_BLOCKS=True,
        ROUTE_M=1, REPLICAS=1, REG_ALIGN=False, LOGIT_KEYS=True, PDL=True)),
}
for name, (fn, cex) in cases.items():
    sig, consts = {}, {}
    for i, arg in enumerate(fn.arg_names):
        if arg in cex:
            sig[arg], consts[(i,)] = "constexpr", cex[arg]
        elif arg.endswith("_ptr"):
            sig[arg] = "*bf16" if arg in ("logits_ptr", "weights_ptr", "lg_ptr", "tw_ptr") else "*i32"
        else:
            sig[arg] = "i32"
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                         options=dict(num_warps=1 if name != "align" else 4)).asm["ptx"]
    wait, trig = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
    load = min(i for i in (ptx.find("ld.global"), ptx.find("atom.global"), len(ptx)) if i >= 0)
    print("PDL_ORDER", name, wait >= 0 and trig > wait and load > trig)
"""


def test_route_align_pdl_order_sm90():
    """route(), the one-launch alignment and route_align_logits compiled for sm_90 with PDL (no GPU): the grid
    dependency wait first, then launch_dependents, then the first global load (the kernel launched behind them waits
    for them; they read only what their predecessor wrote after it finished)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _PDL_ORDER_PROBE], env=env, capture_output=True, text=True, check=True)
    rows = [line.split() for line in out.stdout.splitlines() if line.startswith("PDL_ORDER")]
    assert rows and all(r[2] == "True" for r in rows) and len(rows) == 3, out.stdout
