"""Decay-timescale classifier and the f32/bf16 head map (issue #4): tier 1 from weights, thresholds,
the startup description, the checkpoint content hash, tier-2 calibration and its sidecar cache."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import make_hf_checkpoint
from linrnn_serve import classifier as clf
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model

QWEN35_35B = {  # text config of Qwen3.5-35B-A3B (SPEC §1.11), enough for sizes
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4, "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "partial_rotary_factor": 0.25, "rope_theta": 1e7,
}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("tiny_clf"))


@pytest.fixture(scope="module")
def model(ckpt):
    return load_model(ModelConfig.from_pretrained(ckpt), ckpt, torch.float32, "cpu", progress=False)


def test_tier1_timescales_from_weights(model):
    taus = clf.head_timescales(model)
    assert len(taus) == len(model.cfg.gdn_layers)
    for tau, li in zip(taus, model.cfg.gdn_layers):
        m = model.layers[li].linear_attn
        A = -torch.exp(m.A_log.float())
        expect = 1.0 / (A.abs() * F.softplus(m.dt_bias.float()))
        assert tau.shape == (model.cfg.linear_num_value_heads,)
        torch.testing.assert_close(tau, expect, rtol=1e-6, atol=0)
        assert (tau > 0).all()


def test_threshold_semantics():
    taus = [torch.tensor([0.5, 3.0, 100.0, 1e4]), torch.tensor([2.0, 2.0, 50.0, 7.0])]
    assert clf.bf16_head_map(taus, math.inf) == [[False] * 4, [False] * 4]  # hybrid off: all f32
    assert clf.bf16_head_map(taus, 0) == [[True] * 4, [True] * 4]  # all bf16
    # short memory (tau <= T) -> bf16, long memory -> f32
    assert clf.bf16_head_map(taus, 3.0) == [[True, True, False, False], [True, True, False, False]]
    assert clf.bf16_head_map(taus, 60.0) == [[True, True, False, False], [True, True, True, True]]
    with pytest.raises(ValueError, match="ssm_bf16_tau"):
        clf.bf16_head_map(taus, -1)
    with pytest.raises(ValueError, match="ssm_bf16_tau"):
        clf.bf16_head_map(taus, math.nan)


def test_state_bytes_at_35b_shapes():
    cfg = ModelConfig.from_dict(QWEN35_35B)
    n = len(cfg.gdn_layers)
    assert n == 30
    all_f32 = clf.state_bytes_per_seq(cfg, [[False] * 32] * n, torch.bfloat16)
    assert all_f32["ssm_f32"] == 30 * 32 * 128 * 128 * 4 == 62914560  # BENCH: ~63 MB per sequence
    assert all_f32["ssm_bf16"] == 0
    assert all_f32["conv"] == 30 * 3 * 8192 * 2
    half = clf.state_bytes_per_seq(cfg, [[h % 2 == 0 for h in range(32)]] * n, torch.bfloat16)
    assert half["ssm_f32"] + half["ssm_bf16"] == 30 * 32 * 128 * 128 * 3


def test_build_head_map_and_description(model):
    heads, desc = clf.build_head_map(model, math.inf)
    assert heads == [[False] * 4 for _ in model.cfg.gdn_layers]
    assert "every head f32" in desc and "100.0 %" in desc and "state per sequence" in desc
    taus = torch.cat(clf.head_timescales(model))
    T = float(taus.median())
    heads, desc = clf.build_head_map(model, T)
    n_f32 = sum(not b for m in heads for b in m)
    assert n_f32 == int((taus > T).sum())
    assert f"{n_f32}/{taus.numel()}" in desc
    for li in model.cfg.gdn_layers:
        assert f"L{li}:" in desc  # per-layer fractions
    _, desc0 = clf.build_head_map(model, 0)
    assert "every head bf16" in desc0 and "0/" in desc0


def test_checkpoint_hash(ckpt, tmp_path):
    h1 = clf.checkpoint_hash(ckpt)
    assert h1 == clf.checkpoint_hash(ckpt) and len(h1) == 64
    # a copy with one byte of tensor data changed hashes differently (same headers and sizes)
    import shutil

    other = tmp_path / "copy"
    shutil.copytree(ckpt, other)
    fn = sorted(f for f in os.listdir(other) if f.endswith(".safetensors"))[0]
    p = other / fn
    data = bytearray(p.read_bytes())
    data[-1] ^= 0x40
    p.write_bytes(bytes(data))
    assert clf.checkpoint_hash(other) != h1
    with pytest.raises(ValueError, match="neither config.json"):
        clf.checkpoint_hash(tmp_path / "copy" / ".." / "..")


def test_calibration_measures_decay_and_is_cached(model, ckpt, tmp_path, monkeypatch):
    tokens = torch.randint(0, 128, (150,), generator=torch.Generator().manual_seed(5)).tolist()
    taus, note = clf.calibrated_timescales(model, ckpt, tokens, cache_dir=str(tmp_path), seq_len=64)
    assert "tier 2" in note and "saved" in note
    assert len(taus) == len(model.cfg.gdn_layers) and all((t > 0).all() for t in taus)
    path = clf.sidecar_path(clf.checkpoint_hash(ckpt), str(tmp_path))
    side = json.load(open(path))
    assert side["format"] == clf.SIDECAR_FORMAT and side["num_tokens"] == 150
    L0 = side["layers"][0]
    assert set(L0) >= {"layer", "mean_decay", "mean_log_decay", "mean_tau", "tau"}
    assert all(0 < d <= 1 for d in L0["mean_decay"])
    # tau = -1 / mean log-decay
    assert L0["tau"] == pytest.approx([-1 / g for g in L0["mean_log_decay"]], rel=1e-6)

    # the next start reuses the sidecar without running the model
    monkeypatch.setattr(clf, "calibrate", lambda *a, **k: pytest.fail("calibration ran again"))
    taus2, note2 = clf.calibrated_timescales(model, ckpt, tokens, cache_dir=str(tmp_path), seq_len=64)
    assert "reused" in note2
    for x, y in zip(taus, taus2):
        torch.testing.assert_close(x, y)
    # different calibration text: measured again
    with pytest.raises(pytest.fail.Exception, match="calibration ran again"):
        clf.calibrated_timescales(model, ckpt, tokens[:100], cache_dir=str(tmp_path), seq_len=64)


def test_calibration_equals_tier1_when_a_is_zero(model, tmp_path):
    """With in_proj_a's rows zeroed, every a_t = 0 and tier 2 must reproduce the weight formula."""
    import copy

    m = copy.deepcopy(model)
    for gdn in clf.gdn_modules(m):
        mod, r0, rows, _ = gdn.in_proj.locate("a")
        with torch.no_grad():
            mod.weight[r0:r0 + rows].zero_()
    layers = clf.calibrate(m, list(range(40)), seq_len=40)
    for L, t1 in zip(layers, clf.head_timescales(m)):
        torch.testing.assert_close(torch.tensor(L["tau"]), t1, rtol=1e-5, atol=0)


def test_build_head_map_with_calibration(model, ckpt, tmp_path):
    tokens = list(range(60))
    taus = torch.cat(clf.head_timescales(model))
    heads, desc = clf.build_head_map(model, float(taus.median()), checkpoint_dir=ckpt, calibration_tokens=tokens,
                                     cache_dir=str(tmp_path))
    assert "tier 2" in desc
    heads_inf, desc_inf = clf.build_head_map(model, math.inf, checkpoint_dir=ckpt, calibration_tokens=tokens,
                                             cache_dir=str(tmp_path / "none"))
    assert "calibration skipped" in desc_inf and not os.path.exists(tmp_path / "none")
