"""NVFP4 format reference (SPEC §2.1-2.3) against the producers' own code: compressed-tensors 0.20
(installed) bit for bit, ModelOpt's scale rules (and its library bit for bit where importable)."""
import pytest
import torch

from linrnn_kernels.quant import WeightTensor, nvfp4

E2M1 = torch.tensor(nvfp4.E2M1_VALUES)


def _weights(dtype, seed=0, n=96, k=256):
    """Random weights with per-row magnitudes spanning 100x, an all-zero block, a tiny block, a -0.0."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * torch.logspace(-3, -1, n)[:, None]
    w[3, :16] = 0
    w[5, 16:32] *= 1e-7
    w[7, 5] = -0.0
    return w.to(dtype)


# ---- E2M1 rounding and packing ---------------------------------------------------------------------------
@pytest.mark.parametrize("x,want", [
    (0.0, 0.0), (0.25, 0.0), (0.2501, 0.5), (0.75, 1.0), (0.7499, 0.5), (1.25, 1.0), (1.2501, 1.5),
    (1.75, 2.0), (2.5, 2.0), (2.5001, 3.0), (3.5, 4.0), (3.4999, 3.0), (5.0, 4.0), (5.0001, 6.0), (100.0, 6.0),
])
def test_e2m1_round_to_nearest_ties_to_even_saturating(x, want):
    for sign in (1.0, -1.0):
        code = nvfp4.round_to_e2m1(torch.tensor([sign * x]))
        assert E2M1[code.long()].item() == sign * want or (want == 0 and E2M1[code.long()].item() == 0)
        assert (code.item() >> 3) == (1 if sign * x < 0 else 0)  # sign bit iff x < 0


def test_negative_zero_and_small_negatives():
    codes = nvfp4.round_to_e2m1(torch.tensor([-0.0, 0.0, -0.1, 0.1]))
    assert codes.tolist() == [0, 0, 8, 0]


def test_pack_low_nibble_is_even_element():
    codes = torch.tensor([[1, 2, 15, 8]], dtype=torch.uint8)
    packed = nvfp4.pack(codes)
    assert packed.tolist() == [[0x21, 0x8F]]
    assert torch.equal(nvfp4.unpack(packed), codes)


def test_dequantize_per_row_scale_keeps_fused_halves_exact():
    """gate/up halves with different global scales: one row_scale per row (no reconciliation loss)."""
    w = _weights(torch.float32, n=32, k=64)
    halves = [nvfp4.quantize(w[:16]), nvfp4.quantize(w[16:] * 7)]
    packed = torch.cat([h[0] for h in halves])
    sb = torch.cat([h[1] for h in halves])
    row = torch.cat([h[2].expand(16) for h in halves])
    got = WeightTensor("nvfp4", packed, sb, row).dequantize()
    for i, (p, s, g) in enumerate(halves):
        assert torch.equal(got[16 * i:16 * (i + 1)], nvfp4.dequantize(p, s, g.expand(16)))


# ---- compressed-tensors: bit-identical to the library -----------------------------------------------------
def _ct_reference(w):
    """What compressed-tensors 0.20 writes for W with the NVFP4A16 preset, driven as llm-compressor's
    min-max observer drives it: generate_gparam, calculate_qparams (scale kept in W's dtype as the module
    parameter is), NVFP4PackedCompressor.compress; and its decompression."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    scheme = QuantizationScheme(targets=["Linear"], **NVFP4A16)
    mn, mx = torch.aminmax(w)
    gs = generate_gparam(mn.reshape(1, 1), mx.reshape(1, 1)).reshape(1)
    groups = w.unflatten(-1, (-1, 16))
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=gs)
    sd = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale.to(w.dtype),
                                          "weight_global_scale": gs}, scheme)
    deq = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
    return sd, deq


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_compressed_tensors_quantization_is_bit_identical(dtype, seed):
    w = _weights(dtype, seed)
    ref, ref_deq = _ct_reference(w)
    packed, sb, g = nvfp4.quantize_compressed_tensors(w)
    assert torch.equal(g.reshape(1), ref["weight_global_scale"])
    assert torch.equal(sb.view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(packed, ref["weight_packed"])
    # their dequantization (bf16 output, divides by the global scale) equals ours (row_scale = 1/global)
    ours = nvfp4.dequantize(packed, sb, (1 / g).expand(w.shape[0]), ref_deq.dtype)
    assert torch.equal(ours, ref_deq)


def test_compressed_tensors_global_scale_is_rounded_in_weight_dtype():
    """generate_gparam divides a python float by the bf16 amax: the global scale has bf16 precision."""
    amax = torch.tensor(0.0123, dtype=torch.bfloat16)
    g = nvfp4.compressed_tensors_global_scale(amax)
    assert g.dtype == torch.float32
    assert g.item() == torch.tensor(2688.0 / amax.float().item()).to(torch.bfloat16).float().item()
    assert nvfp4.compressed_tensors_global_scale(torch.tensor(0.0)).item() == 1.0  # all-zero tensor


def test_compressed_tensors_stacked_matrices_use_their_own_global_scale():
    w = torch.stack([_weights(torch.bfloat16, s, n=32, k=64) for s in range(3)])
    packed, sb, g = nvfp4.quantize_compressed_tensors(w)
    for e in range(3):
        p1, s1, g1 = nvfp4.quantize_compressed_tensors(w[e])
        assert torch.equal(packed[e], p1) and torch.equal(sb[e].view(torch.uint8), s1.view(torch.uint8))
        assert torch.equal(g[e], g1)


# ---- ModelOpt --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_modelopt_scales_follow_spec(dtype):
    """weight_scale_2 = amax/(6*448); block scale = E4M3(amax_b / (6*ws2)), 0 -> 1, >= 2^-9 (SPEC §2.2)."""
    w = _weights(dtype)
    packed, sb, ws2 = nvfp4.quantize(w)
    assert ws2.dtype == torch.float32 and ws2.item() == (w.abs().max().float() / 2688.0).item()
    amax_b = w.float().abs().unflatten(-1, (-1, 16)).amax(-1)
    want = (amax_b / (6 * ws2)).clone()
    want[want == 0] = 1.0
    want = want.clamp(2 ** -9, 448).to(torch.float8_e4m3fn)
    assert torch.equal(sb.view(torch.uint8), want.view(torch.uint8))
    assert sb[3, 0].float() == 1.0  # the all-zero block
    # codes: RNE of W / (s_b * ws2)
    scaled = w.float().unflatten(-1, (-1, 16)) / (sb.float() * ws2)[..., None]
    assert torch.equal(nvfp4.unpack(packed), nvfp4.round_to_e2m1(scaled.flatten(-2)))


@pytest.mark.parametrize("seed", [0, 1])
def test_modelopt_and_compressed_tensors_agree_within_one_scale_step(seed):
    """Both flavours pick the block scale amax_b/6 rounded to E4M3 (ModelOpt relative to ws2, compressed-
    tensors relative to 1/global): effective scales differ by at most one E4M3 step (2^-3 relative)."""
    w = _weights(torch.bfloat16, seed)
    p_mo, s_mo, ws2 = nvfp4.quantize(w)
    p_ct, s_ct, g = nvfp4.quantize_compressed_tensors(w)
    eff_mo = s_mo.float() * ws2
    eff_ct = s_ct.float() / g
    normal = (w.float().abs().unflatten(-1, (-1, 16)).amax(-1) > w.float().abs().max() * 2 ** -6)
    ratio = (eff_mo / eff_ct)[normal]
    assert ((ratio - 1).abs() <= 2 ** -3 + 1e-6).all()
    d_mo = nvfp4.dequantize(p_mo, s_mo, ws2.expand(w.shape[0]))
    d_ct = nvfp4.dequantize(p_ct, s_ct, (1 / g).expand(w.shape[0]))
    # each is within half an E2M1 step (<= 1 x its block scale) of W
    bound = (eff_mo + eff_ct).repeat_interleave(16, -1)
    assert ((d_mo - d_ct).abs() <= bound + 1e-12).all()
    err = [((d - w.float()).norm() / w.float().norm()).item() for d in (d_mo, d_ct)]
    assert max(err) < 0.15 and abs(err[0] - err[1]) < 0.02


def test_modelopt_library_bit_identical():
    """Runs where nvidia-modelopt is importable (not a CI dependency)."""
    mo = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    for dtype in (torch.bfloat16, torch.float32):
        w = _weights(dtype)
        qt, sb, ws2 = mo.NVFP4QTensor.quantize(w.clone(), 16)
        packed, s, g = nvfp4.quantize(w)
        assert torch.equal(qt._quantized_data, packed)
        assert torch.equal(sb.view(torch.uint8), s.view(torch.uint8)) and torch.equal(ws2.reshape(()), g)
        deq = qt.dequantize(dtype=torch.float32, scale=sb, double_scale=ws2, block_sizes={-1: 16})
        assert torch.equal(deq, nvfp4.dequantize(packed, s, g.expand(w.shape[0])))
