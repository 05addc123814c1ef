"""`--model` resolution: local directories, presets, Hugging Face repo ids (linrnn_serve/presets.py).
Never touches the network: Hub cases run with HF_HUB_OFFLINE=1."""
from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch
from helpers import run_prompt

from linrnn_serve import presets
from linrnn_serve.checkpoint import synth
from linrnn_serve.models.loading import load_model
from linrnn_serve.presets import PRESETS, ModelResolutionError, resolve_model


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LINRNN_SERVE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # belt and braces: no test may reach the Hub


def test_local_directory(tmp_path):
    d = str(tmp_path / "ckpt")
    synth.synth_preset("tiny-next", d, dtype=torch.float32, progress=False, mtp=False)
    r = resolve_model(d)
    assert r.model_dir == d and r.tokenizer_dir == d and r.name == "ckpt"
    assert r.cfg.model_type == "qwen3_next"
    logits = run_prompt(load_model(r.cfg, r.model_dir, torch.float32, "cpu", progress=False), [1, 2, 3])
    assert torch.isfinite(logits).all()


def test_local_directory_without_tokenizer(tmp_path, caplog):
    d = str(tmp_path / "ckpt")
    synth.synth_preset("tiny", d, dtype=torch.float32, progress=False, mtp=False)
    for f in os.listdir(d):
        if f.startswith("tokenizer"):
            os.remove(os.path.join(d, f))
    with caplog.at_level(logging.WARNING):
        r = resolve_model(d)
    assert r.tokenizer_dir != d and os.path.isfile(os.path.join(r.tokenizer_dir, "tokenizer.json"))
    assert "no tokenizer files" in caplog.text


def test_tiny_preset_generated_once():
    r = resolve_model("tiny")
    assert r.name == "tiny" and r.model_dir.startswith(presets.cache_dir())
    index = os.path.join(r.model_dir, "model.safetensors.index.json")
    mtime = os.path.getmtime(index)
    r2 = resolve_model("tiny")
    assert r2.model_dir == r.model_dir and os.path.getmtime(index) == mtime  # cached, not regenerated
    assert r.cfg.model_type == "qwen3_5_moe" and r.cfg.layer_types.count("full_attention") == 1
    assert r.cfg.linear_num_value_heads == 2 * r.cfg.linear_num_key_heads
    assert r.cfg.shared_expert_intermediate_size > 0
    model = load_model(r.cfg, r.model_dir, torch.float32, "cpu", progress=False)
    assert torch.isfinite(run_prompt(model, [1, 2, 3, 4])).all()


def test_default_preset(caplog):
    with caplog.at_level(logging.INFO):
        r = resolve_model(None)
    assert r.name == "default"
    if presets.default_model_dir() is None:
        assert "not packaged yet" in caplog.text and "tiny" in caplog.text
        assert r.model_dir == resolve_model("tiny").model_dir
    else:
        assert r.model_dir == presets.default_model_dir()


@pytest.mark.parametrize("name,model_type,experts,quantized", [
    ("qwen35moe-nvfp4", "qwen3_5_moe", 256, True),
    ("qwen35moe-bf16", "qwen3_5_moe", 256, False),
    ("qwen35moe-122b-nvfp4", "qwen3_5_moe", 256, True),
    ("qwen35moe-397b-nvfp4", "qwen3_5_moe", 512, True),
    ("qwen35moe-397b-bf16", "qwen3_5_moe", 512, False),
    ("qwen3-next-nvfp4", "qwen3_next", 512, True),
    ("qwen3-next-bf16", "qwen3_next", 512, False),
])
def test_dummy_presets_need_no_download(name, model_type, experts, quantized):
    r = resolve_model(name, load_format="dummy")
    assert r.model_dir is None and r.name == name
    assert r.cfg.model_type == model_type and r.cfg.num_experts == experts
    assert bool(r.cfg.quantization) == quantized
    if quantized:
        q = r.cfg.quantization
        assert q["quant_method"] == "modelopt" and q["quant_algo"] == "NVFP4" and q["group_size"] == 16
    assert os.path.isfile(os.path.join(r.tokenizer_dir, "tokenizer.json"))


def test_nvfp4_preset_plan_quantizes_only_routed_experts():
    try:
        from linrnn_serve.checkpoint.quant_config import QuantPlan
    except ImportError:
        pytest.skip("QuantPlan does not exist yet")
    cfg = resolve_model("qwen35moe-nvfp4", load_format="dummy").cfg
    plan = QuantPlan.from_model_config(cfg)
    counts = plan.counts()
    assert counts["experts"] == {"nvfp4": 40}
    assert set(counts["linears"]) == {"dense"}


def test_presets_have_descriptions_and_known_architectures():
    for p in PRESETS.values():
        assert p.description
        if p.arch:
            assert p.arch in synth.ARCHITECTURES
    assert PRESETS["qwen35moe-nvfp4"].repo_id == "nvidia/Qwen3.6-35B-A3B-NVFP4"
    assert PRESETS["qwen3-next-nvfp4"].repo_id == "nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4"


def test_unknown_name():
    with pytest.raises(ModelResolutionError, match="not a checkpoint directory, a preset") as e:
        resolve_model("no-such-model")
    assert "qwen35moe-nvfp4" in str(e.value)
    with pytest.raises(ModelResolutionError, match="no such checkpoint directory"):
        resolve_model("./does/not/exist")
    with pytest.raises(ModelResolutionError, match="load-format"):
        resolve_model("tiny", load_format="pt")


def test_offline_hub_error_message():
    with pytest.raises(ModelResolutionError) as e:
        resolve_model("linrnn-serve-test/this-repo-does-not-exist")
    msg = str(e.value)
    assert "HF_HUB_OFFLINE" in msg and "--load-format dummy" in msg and "local checkpoint directory" in msg
    with pytest.raises(ModelResolutionError, match="--model qwen3-next-nvfp4 --load-format dummy"):
        resolve_model("qwen3-next-nvfp4")  # real weights wanted, offline


def test_hub_download_uses_patterns(monkeypatch, tmp_path):
    """A repo id resolves through snapshot_download with only the needed files (stubbed: no network)."""
    src = str(tmp_path / "snap")
    synth.synth_preset("tiny", src, dtype=torch.float32, progress=False, mtp=False)
    calls = []

    def fake_snapshot_download(repo_id, allow_patterns=None, local_files_only=False, **kw):
        calls.append((repo_id, allow_patterns, local_files_only))
        return src

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(presets, "_hf_offline", lambda: False)
    r = resolve_model("someone/tiny-model")
    assert r.model_dir == src and r.name == "someone/tiny-model"
    assert "*.safetensors" in calls[0][1] and "*.json" in calls[0][1] and "*.jinja" in calls[0][1]
    resolve_model("someone/tiny-model", load_format="dummy")
    assert "*.safetensors" not in calls[1][1]  # dummy weights: configs and tokenizer only
    shutil.rmtree(src)


@pytest.mark.parametrize("name,billions,tp", [("qwen35moe-122b-bf16", 122, 2), ("qwen35moe-397b-nvfp4", 397, 4)])
def test_large_preset_sizes(name, billions, tp):
    """Text parameters within 3 % of the release's name (docs/large_presets.md), and the shapes split
    over the GPUs they need (tensor and expert parallel)."""
    import math

    from linrnn_serve.checkpoint.synth import tensor_defs
    from linrnn_serve.parallel import Shard, local_config

    cfg = resolve_model(name, load_format="dummy").cfg
    total = sum(math.prod(d.stack_shape) for d in tensor_defs(cfg, fused_experts=True, mtp_layers=0))
    assert abs(total / 1e9 - billions) / billions < 0.03, total
    for ep in (False, True):
        lc = local_config(cfg, Shard(tp - 1, tp, ep))
        assert lc.num_attention_heads * tp == cfg.num_attention_heads
        assert lc.linear_num_value_heads * tp == cfg.linear_num_value_heads


def test_dummy_only_preset_refuses_download():
    with pytest.raises(presets.ModelResolutionError, match="--load-format dummy"):
        resolve_model("qwen35moe-122b-nvfp4")
