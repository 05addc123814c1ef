"""`linrnn-serve quantize` (issue #3 part 5): real release layouts on disk, readable by the reference library."""
import json
import os

import pytest
import torch
from safetensors import safe_open

from helpers import make_hf_checkpoint, rewrite_as_release_layout
from linrnn_kernels.quant import nvfp4
from linrnn_serve.checkpoint import CheckpointError
from linrnn_serve.cli import main
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model


def _tensors(path):
    out = {}
    idx = os.path.join(path, "model.safetensors.index.json")
    files = sorted(set(json.load(open(idx))["weight_map"].values())) if os.path.exists(idx) else ["model.safetensors"]
    for fn in files:
        with safe_open(os.path.join(path, fn), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """bf16 Qwen3.5 release layout (fused 3-D experts, language_model prefix, mtp + visual tensors) + side files."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("rel"), dtype=torch.bfloat16)
    rewrite_as_release_layout(path)
    for fn, text in (("tokenizer.json", '{"version": "1.0"}'), ("chat_template.jinja", "{{ messages }}")):
        open(os.path.join(path, fn), "w").write(text)
    return path


@pytest.fixture(scope="module")
def ct_out(release, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ct") / "out")
    assert main(["quantize", "--in", release, "--out", out, "--format", "compressed-tensors",
                 "--max-shard-size", "150KB", "--no-progress"]) == 0
    return out


def test_layout_and_side_files(release, ct_out):
    t, src = _tensors(ct_out), _tensors(release)
    modes = {fn: os.stat(os.path.join(ct_out, fn)).st_mode & 0o777 for fn in os.listdir(ct_out)}
    assert len(set(modes.values())) == 1, modes  # shards written like the side files (0644 under umask 022)
    assert any(fn.endswith(".safetensors") for fn in modes)
    cfg = ModelConfig.from_pretrained(release)
    E = cfg.num_experts
    P = "model.language_model.layers.0.mlp."
    assert not any(n.endswith(("experts.gate_up_proj", "experts.down_proj")) for n in t if not n.startswith("mtp"))
    for e in range(E):  # fused 3-D experts written per expert, as real exports do
        for p in ("gate", "up", "down"):
            assert t[f"{P}experts.{e}.{p}_proj.weight_packed"].dtype == torch.uint8
            assert t[f"{P}experts.{e}.{p}_proj.weight_scale"].dtype == torch.float8_e4m3fn
            assert t[f"{P}experts.{e}.{p}_proj.weight_global_scale"].shape == (1,)
    assert t[P + "shared_expert.up_proj.weight_packed"].shape == (32, 32)
    for kept in (P + "gate.weight", P + "shared_expert_gate.weight", "lm_head.weight", "mtp.fc.weight",
                 "model.visual.patch_embed.proj.weight", "model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
                 "model.language_model.embed_tokens.weight"):
        assert torch.equal(t[kept], src[kept]), kept
    assert len([f for f in os.listdir(ct_out) if f.endswith(".safetensors")]) > 1
    assert open(os.path.join(ct_out, "tokenizer.json")).read() == '{"version": "1.0"}'
    assert os.path.exists(os.path.join(ct_out, "chat_template.jinja"))
    assert not os.path.exists(os.path.join(ct_out, "hf_quant_config.json"))
    q = json.load(open(os.path.join(ct_out, "config.json")))["quantization_config"]
    assert "model.language_model.layers.0.linear_attn.in_proj_a" in q["ignore"] and "lm_head" in q["ignore"]
    assert "re:^mtp\\..*" in q["ignore"]


def test_compressed_tensors_reads_our_output(release, ct_out):
    """compressed-tensors parses our quantization_config and decompresses every module to exactly what our
    loaded model holds; codes and scales equal its own compression of the source weights (gate/up of each
    expert share a global scale, as llm-compressor fuses them)."""
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    raw = json.load(open(os.path.join(ct_out, "config.json")))["quantization_config"]
    qcfg = QuantizationConfig.model_validate(raw)
    assert qcfg.format == "nvfp4-pack-quantized"
    scheme = qcfg.config_groups["group_0"]
    t, src = _tensors(ct_out), _tensors(release)
    model = load_model(ModelConfig.from_pretrained(ct_out), ct_out, torch.float32, "cpu", progress=False)
    I = 32
    for i in (0, 3):
        P = f"model.language_model.layers.{i}.mlp."
        w13 = model.layers[i].mlp.experts.w13.weight_tensor().dequantize(torch.bfloat16)
        fused = src[P + "experts.gate_up_proj"]
        for e in (0, 5):
            g_gate = t[f"{P}experts.{e}.gate_proj.weight_global_scale"]
            assert torch.equal(g_gate, t[f"{P}experts.{e}.up_proj.weight_global_scale"])
            assert torch.equal(g_gate, nvfp4.compressed_tensors_global_scale(fused[e].abs().max()).reshape(1))
            for half, p in enumerate(("gate", "up")):
                name = f"{P}experts.{e}.{p}_proj"
                sd = {k: t[f"{name}.{k}"] for k in ("weight_packed", "weight_scale", "weight_global_scale")}
                theirs = NVFP4PackedCompressor.decompress(dict(sd), scheme)["weight"]
                assert torch.equal(theirs, w13[e, half * I:(half + 1) * I])
                w = fused[e, half * I:(half + 1) * I]
                groups = w.unflatten(-1, (-1, 16))
                s, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights, global_scale=g_gate)
                ref = NVFP4PackedCompressor.compress({"weight": w, "weight_scale": s.to(w.dtype),
                                                      "weight_global_scale": g_gate}, scheme)
                assert torch.equal(ref["weight_packed"], sd["weight_packed"])
                assert torch.equal(ref["weight_scale"].view(torch.uint8), sd["weight_scale"].view(torch.uint8))


def test_modelopt_layout_qwen3_next_all_linear(tmp_path):
    src = make_hf_checkpoint(tmp_path / "src", "qwen3_next", dtype=torch.bfloat16)
    out = str(tmp_path / "out")
    assert main(["quantize", "--in", src, "--out", out, "--format", "modelopt", "--scope", "all-linear",
                 "--no-progress"]) == 0
    hq = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
    assert hq["quant_algo"] == "W4A16_NVFP4" and hq["group_size"] == 16 and hq["kv_cache_quant_algo"] is None
    ex = hq["exclude_modules"]
    assert {"lm_head", "model.layers.0.linear_attn.in_proj_ba", "model.layers.0.mlp.gate",
            "model.layers.0.mlp.shared_expert_gate"} <= set(ex)
    assert not any("in_proj_qkvz" in n or "self_attn" in n for n in ex)
    qc = json.load(open(os.path.join(out, "config.json")))["quantization_config"]
    assert qc["quant_method"] == "modelopt" and qc["ignore"] == ex and qc["quant_algo"] == "W4A16_NVFP4"
    t, s = _tensors(out), _tensors(src)
    A = "model.layers.3.self_attn."
    amax = max(s[A + f"{p}_proj.weight"].float().abs().max() for p in "qkv")  # q/k/v share weight_scale_2
    for p in "qkv":
        assert t[A + f"{p}_proj.weight_scale_2"].shape == ()
        assert t[A + f"{p}_proj.weight_scale_2"].item() == (amax / 2688.0).item()
        assert t[A + f"{p}_proj.weight"].dtype == torch.uint8
    E = "model.layers.0.mlp.experts.2."
    for p in ("gate", "up"):  # ModelOpt keeps per-expert gate/up scales separate
        amax = s[E + f"{p}_proj.weight"].float().abs().max()
        assert t[E + f"{p}_proj.weight_scale_2"].item() == (amax / 2688.0).item()
    packed, sb, _ = nvfp4.quantize(s[E + "down_proj.weight"])
    assert torch.equal(t[E + "down_proj.weight"], packed)
    assert torch.equal(t[E + "down_proj.weight_scale"].view(torch.uint8), sb.view(torch.uint8))
    assert t["model.layers.0.linear_attn.in_proj_qkvz.weight"].dtype == torch.uint8
    assert t["model.layers.0.linear_attn.in_proj_ba.weight"].dtype == torch.bfloat16
    assert os.path.exists(os.path.join(out, "model.safetensors"))  # one shard: no index


def test_refuses_existing_output_and_quantized_input(release, ct_out, tmp_path, capsys):
    """User errors are one line on stderr with exit status 2 (tests/test_cli_errors.py runs the console
    script in a subprocess for the no-traceback check); the library function raises CheckpointError."""
    assert main(["quantize", "--in", release, "--out", ct_out, "--format", "modelopt", "--no-progress"]) == 2
    assert "output directory exists" in capsys.readouterr().err
    assert main(["quantize", "--in", ct_out, "--out", str(tmp_path / "x"), "--format", "modelopt",
                 "--no-progress"]) == 2
    assert "already quantized" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    from linrnn_serve.checkpoint.quantize import quantize_checkpoint
    with pytest.raises(CheckpointError, match="already quantized"):
        quantize_checkpoint(ct_out, str(tmp_path / "x"), "modelopt")
    with pytest.raises(SystemExit):
        main(["quantize", "--in", release, "--out", str(tmp_path / "y"), "--format", "gguf"])
