"""Quantized checkpoints in both real layouts (SPEC §2.2 ModelOpt, §2.3 compressed-tensors) load, pick the
right format per module, and give the logits of the dequantized model (issue #3)."""
import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_hf_checkpoint, rel_err, rel_fro, rewrite_as_release_layout, run_prompt
from linrnn_kernels.quant import nvfp4
from linrnn_serve.checkpoint import CheckpointError
from linrnn_serve.checkpoint.layout import canonical_name
from linrnn_serve.checkpoint.quant_config import CtNameMatcher, QuantPlan, VllmExcludeMatcher
from linrnn_serve.checkpoint.quantize import quantize_checkpoint
from linrnn_serve.config import ConfigError, ModelConfig
from linrnn_serve.layers.linear import DenseWeights
from linrnn_serve.layers.quant import Fp8Weights, Nvfp4Weights
from linrnn_serve.models.loading import load_model

TOL = 1e-3
IDS = list(range(3, 40))


# ---- helpers -------------------------------------------------------------------------------------------
def _read_all(path):
    out = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out


def _config(path):
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


def _write_dir(dst, tensors, config, hf_quant=None):
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if hf_quant is not None:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(hf_quant, f)


def dequantized_reference(qdir, dst):
    """Dense f32 checkpoint: every quantized module replaced by its dequantized weight, same names,
    config without quantization_config."""
    t = _read_all(qdir)
    dense = {}
    for name, x in t.items():
        mod, _, suf = name.rpartition(".")
        if suf == "weight_packed" or (suf == "weight" and x.dtype == torch.uint8):
            if mod + ".weight_scale_2" in t:
                g = t[mod + ".weight_scale_2"].float()
            else:
                g = 1 / t[mod + ".weight_global_scale"].float()
            dense[mod + ".weight"] = nvfp4.dequantize(x, t[mod + ".weight_scale"], g.reshape(()).expand(x.shape[0]))
        elif suf == "weight" and x.dtype == torch.float8_e4m3fn:
            s = t[mod + ".weight_scale"].float()
            dense[name] = x.float() * (s.reshape(-1, 1) if s.numel() > 1 else s.reshape(()))
        elif re.fullmatch(r"weight_scale(_2)?|weight_global_scale|input_scale|input_global_scale|[kv]_scale", suf):
            continue
        else:
            dense[name] = x.float() if x.is_floating_point() else x
    cfg = _config(qdir)
    cfg.pop("quantization_config", None)
    _write_dir(dst, dense, cfg)
    return str(dst)


def _load(path, dtype=torch.float32, device="cpu"):
    return load_model(ModelConfig.from_pretrained(path), str(path), dtype, device, progress=False)


def _check_logits(qdir, tmp_path):
    ref = run_prompt(_load(dequantized_reference(qdir, tmp_path / "ref")), IDS)
    model = _load(qdir)
    assert rel_err(run_prompt(model, IDS), ref) <= TOL
    return model


def _linears(name, t):
    """(module, weight) pairs of a source tensor: 2-D weights, and fused 3-D experts per expert."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        base = name.rsplit(".", 1)[0]
        if name.endswith("gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{base}.{e}.gate_proj", t[e, :inter]
                yield f"{base}.{e}.up_proj", t[e, inter:]
        else:
            for e in range(t.shape[0]):
                yield f"{base}.{e}.down_proj", t[e]
    elif name.endswith(".weight") and t.dim() == 2 and not name.startswith(("mtp.", "model.visual.")) \
            and "embed_tokens" not in name:
        yield name[: -len(".weight")], t


def _fp8(w, per_channel=False):
    amax = w.float().abs().amax(-1, keepdim=True) if per_channel else w.float().abs().max()
    s = amax / 448.0
    return (w.float() / s).to(torch.float8_e4m3fn), (s if per_channel else s.reshape(()))


def write_quantized(src, dst, scheme_of, config_edit, hf_quant=None, extra=None):
    """Hand-written quantized checkpoint: scheme_of(canonical module) -> None | 'modelopt' | 'ct' | 'fp8' |
    'fp8-channel' (independent of the quantizer under test, as a third-party export would be)."""
    out = {}
    for name, t in _read_all(src).items():
        pairs = list(_linears(name, t))
        if not pairs:
            out[name] = t
        for mod, w in pairs:
            s = scheme_of(canonical_name(mod))
            if s is None:
                out[mod + ".weight"] = w.contiguous()
            elif s == "modelopt":
                p, sb, ws2 = nvfp4.quantize(w)
                out.update({mod + ".weight": p, mod + ".weight_scale": sb, mod + ".weight_scale_2": ws2,
                            mod + ".input_scale": torch.tensor(0.01)})
            elif s == "ct":
                p, sb, g = nvfp4.quantize_compressed_tensors(w)
                out.update({mod + ".weight_packed": p, mod + ".weight_scale": sb,
                            mod + ".weight_global_scale": g.reshape(1)})
            else:
                q, sc = _fp8(w, s == "fp8-channel")
                out.update({mod + ".weight": q, mod + ".weight_scale": sc, mod + ".input_scale": torch.tensor(0.02)})
    out.update(extra or {})
    cfg = _config(src)
    config_edit(cfg)
    _write_dir(dst, {k: v.contiguous() for k, v in out.items()}, cfg, hf_quant)
    return str(dst)


@pytest.fixture(scope="module")
def qwen35_release(tmp_path_factory):
    """Qwen3.5 release layout (nested text_config, model.language_model.*, fused 3-D experts, mtp, visual)."""
    path = make_hf_checkpoint(tmp_path_factory.mktemp("q35"), dtype=torch.bfloat16)
    rewrite_as_release_layout(path)
    return path


@pytest.fixture(scope="module")
def qwen35(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("q35flat"), dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_hf_checkpoint(tmp_path_factory.mktemp("qnext"), "qwen3_next", dtype=torch.bfloat16,
                              mlp_only_layers=[1])


def _group_formats(fused):
    return [type(g) for g in fused.groups]


# ---- our quantizer's output, both layouts -------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
@pytest.mark.parametrize("family,scope", [("qwen35_release", "experts+shared"), ("qwen35_release", "all-linear"),
                                          ("qwen3_next", "all-linear"), ("qwen3_next", "experts")])
def test_quantized_checkpoint_matches_dequantized_reference(request, tmp_path, fmt, family, scope):
    src = request.getfixturevalue(family)
    out = tmp_path / "q"
    quantize_checkpoint(src, str(out), fmt, scope, progress=False)
    model = _check_logits(out, tmp_path)
    nv = Nvfp4Weights.for_layout(fmt)
    layer0 = model.layers[0]
    assert type(layer0.mlp.experts.w13) is nv and type(layer0.mlp.experts.w2) is nv
    gdn = _group_formats(layer0.linear_attn.in_proj)
    if scope == "all-linear":  # in_proj_a/b stay bf16: one NVFP4 GEMM for [qkv, z], one dense for [b, a]
        assert gdn == [nv, DenseWeights]
        assert _group_formats(model.layers[3].self_attn.qkv_proj) == [nv]
    else:
        assert gdn == [DenseWeights]
    assert _group_formats(model.lm_head) == [DenseWeights]


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["modelopt", "compressed-tensors"])
def test_quantized_checkpoint_on_gpu(qwen35_release, tmp_path, fmt):
    """Same on CUDA in bf16, so the NVFP4 expert / linear kernels run (reference: f32 CPU dequantized).
    bf16 arithmetic alone moves these end-to-end logits (4 layers, bf16 activations and residual stream) by
    0.6-1.4% relative Frobenius depending on the random weights (1.4% for this fixture), so the bound is
    relative to that floor, measured here on the same checkpoint in bf16 through the reference ops on CPU:
    the kernels round in other places (f32 accumulators, fused ops), but may not add more error than bf16
    rounding itself does (factor 2), and a kernel bug gives O(1) errors."""
    out = tmp_path / "q"
    quantize_checkpoint(qwen35_release, str(out), fmt, "all-linear", progress=False)
    ref = run_prompt(_load(dequantized_reference(out, tmp_path / "ref")), IDS)
    bf16_floor = rel_fro(run_prompt(_load(out, torch.bfloat16), IDS), ref)
    got = run_prompt(_load(out, torch.bfloat16, "cuda"), IDS)
    err = rel_fro(got.float().cpu(), ref)
    assert err <= max(1e-2, 2 * bf16_floor), f"rel_fro {err:.4f} vs bf16 floor {bf16_floor:.4f} (CPU reference ops)"


# ---- hand-written checkpoints mirroring real releases --------------------------------------------------------
def test_modelopt_qwen3_next_nvfp4_release(qwen3_next, tmp_path):
    """nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4 (SPEC §2.2): legacy hf_quant_config.json, NVFP4 experts, shared
    expert, out_proj and o_proj; bf16 in_proj_qkvz / in_proj_ba / q,k,v (+ FP8 KV scales) via exclude_modules."""
    L = 4
    exclude = ["lm_head", "mtp*", "*.in_proj_ba", "shared_expert_gate"]  # fnmatch, substring
    for i in range(L):
        if i % 4 == 3:
            exclude += [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"]
        else:
            exclude.append(f"model.layers.{i}.linear_attn.in_proj_qkvz")
        if i != 1:
            exclude.append(f"model.layers.{i}.mlp.gate")
    excluded = VllmExcludeMatcher(exclude)
    hf_quant = {"producer": {"name": "modelopt", "version": "0.33.0"},
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8", "group_size": 16,
                                 "exclude_modules": exclude}}
    kv = {f"model.layers.3.self_attn.{p}_proj.{p}_scale": torch.tensor(1.0) for p in "kv"}
    q = write_quantized(qwen3_next, tmp_path / "q", lambda m: None if excluded(m) else "modelopt",
                        lambda cfg: None, hf_quant, kv)
    model = _check_logits(q, tmp_path)
    nv = Nvfp4Weights.for_layout("modelopt")
    assert _group_formats(model.layers[0].linear_attn.in_proj) == [DenseWeights]
    assert _group_formats(model.layers[0].linear_attn.out_proj) == [nv]
    assert _group_formats(model.layers[3].self_attn.qkv_proj) == [DenseWeights]
    assert _group_formats(model.layers[3].self_attn.o_proj) == [nv]
    assert _group_formats(model.layers[1].mlp.gate_up_proj) == [nv]  # the dense-MLP layer
    assert type(model.layers[0].mlp.experts.w13) is nv
    assert _group_formats(model.layers[0].mlp.shared_expert.gate_up_proj) == [nv]
    assert _group_formats(model.layers[0].mlp.gate) == [DenseWeights]


def test_modelopt_qwen36_mixed_precision(qwen35_release, tmp_path):
    """nvidia/Qwen3.6-35B-A3B-NVFP4 (SPEC §2.2): MIXED_PRECISION in config.json; FP8 in_proj_qkv/z, out_proj and
    q/k/v/o, bf16 in_proj_a/b, W4A16_NVFP4 experts + shared expert; per-expert names under language_model."""
    cfg = ModelConfig.from_pretrained(qwen35_release)
    layers = {}
    for i in range(cfg.num_hidden_layers):
        P = f"model.language_model.layers.{i}."
        names = ([P + f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "out_proj")]
                 if cfg.layer_types[i] == "linear_attention" else [P + f"self_attn.{p}_proj" for p in "qkvo"])
        layers.update({n: {"quant_algo": "FP8"} for n in names})
        for e in range(cfg.num_experts):
            layers.update({P + f"mlp.experts.{e}.{p}_proj": {"quant_algo": "W4A16_NVFP4", "group_size": 16}
                           for p in ("gate", "up", "down")})
        layers.update({P + f"mlp.shared_expert.{p}_proj": {"quant_algo": "W4A16_NVFP4", "group_size": 16}
                       for p in ("gate", "up", "down")})
    qcfg = {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "quantized_layers": layers,
            "ignore": ["mtp.layers.0*", "mtp*"], "kv_cache_scheme": None,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}},
            "producer": {"name": "modelopt", "version": "0.37.0"}}
    algo = {canonical_name(k): v["quant_algo"] for k, v in layers.items()}
    q = write_quantized(qwen35_release, tmp_path / "q",
                        lambda m: {"FP8": "fp8", "W4A16_NVFP4": "modelopt"}.get(algo.get(m)),
                        lambda c: c.update(quantization_config=qcfg))
    model = _check_logits(q, tmp_path)
    nv = Nvfp4Weights.for_layout("modelopt")
    assert _group_formats(model.layers[0].linear_attn.in_proj) == [Fp8Weights, DenseWeights]  # mixed fused run
    assert _group_formats(model.layers[0].linear_attn.out_proj) == [Fp8Weights]
    assert _group_formats(model.layers[3].self_attn.qkv_proj) == [Fp8Weights]
    assert type(model.layers[0].mlp.experts.w2) is nv
    assert _group_formats(model.layers[0].mlp.shared_expert.down_proj) == [nv]
    assert _group_formats(model.lm_head) == [DenseWeights]


def test_compressed_tensors_mixed_groups_and_regex_ignore(qwen35, tmp_path):
    """llm-compressor style: NVFP4 for Linear, an FP8 per-channel group for q/k by regex (names beat the class
    target), ignore with exact names and 're:' patterns (linear_attn.* stays bf16, SPEC §2.3)."""
    ignore = ["lm_head", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*linear_attn\\..*"]
    qk = "re:.*self_attn\\.(q|k)_proj$"
    w4 = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True,
          "dynamic": False, "scale_dtype": "torch.float8_e4m3fn"}
    w8 = {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False}
    qcfg = {"quant_method": "compressed-tensors", "format": "mixed-precision", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": w4, "format": "nvfp4-pack-quantized",
                                          "input_activations": {"num_bits": 4, "type": "float",
                                                                "strategy": "tensor_group", "group_size": 16,
                                                                "dynamic": "local"}},
                              "group_1": {"targets": [qk], "weights": w8, "format": "float-quantized"}},
            "ignore": ignore, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}
    ign, fp8 = CtNameMatcher(ignore), CtNameMatcher([qk])
    kv = {f"model.layers.3.self_attn.{p}_scale": torch.tensor(1.0) for p in "kv"}
    q = write_quantized(qwen35, tmp_path / "q",
                        lambda m: None if ign(m) else "fp8-channel" if fp8(m) else "ct",
                        lambda c: c.update(quantization_config=qcfg), extra=kv)
    model = _check_logits(q, tmp_path)
    nv = Nvfp4Weights.for_layout("compressed-tensors")
    assert _group_formats(model.layers[3].self_attn.qkv_proj) == [Fp8Weights.per_channel(), nv]
    assert _group_formats(model.layers[3].self_attn.o_proj) == [nv]
    assert _group_formats(model.layers[0].linear_attn.in_proj) == [DenseWeights]
    assert type(model.layers[0].mlp.experts.w13) is nv


# ---- matching rules ------------------------------------------------------------------------------------------
def test_vllm_exclude_matching_rules():
    m = VllmExcludeMatcher(["lm_head", "model.layers.0.self_attn.q_proj", "*.in_proj_ba", "mtp*",
                            "model.layers.2.mlp*", "shared_expert_gate"])
    assert m("lm_head") and m("model.layers.0.self_attn.q_proj")  # exact
    assert m("model.layers.5.mlp.shared_expert_gate")  # substring
    assert m("model.layers.5.linear_attn.in_proj_ba")  # fnmatch
    assert m("mtp") and m("mtp.layers.0.mlp.experts.0.gate_proj")  # `mtp*` -> mtp + mtp.*
    assert m("model.layers.2.mlp.experts.3.up_proj")
    assert not m("model.layers.0.self_attn.k_proj") and not m("model.layers.5.linear_attn.in_proj_qkvz")
    # vLLM quirk, reproduced: `model.layers.2.mlp*` expands to `model.layers.2.mlp`, a substring of layer 20's names
    assert m("model.layers.20.mlp.experts.0.up_proj") is False  # '...layers.2.mlp' is not in '...layers.20.mlp'
    assert VllmExcludeMatcher(["model.layers.2*"])("model.layers.20.mlp.gate")  # ... but `layers.2` is


def test_compressed_tensors_matching_is_exact_or_anchored_regex():
    m = CtNameMatcher(["lm_head", "re:.*mlp\\.gate$", "re:mlp"])
    assert m("lm_head") and m("model.layers.0.mlp.gate")
    assert not m("model.lm_head") and not m("model.layers.0.mlp.gate_proj")
    assert not m("model.layers.0.mlp.experts.0.up_proj")  # "re:mlp" is re.match: anchored at the start


def _plan(qcfg, **cfg_kw):
    from helpers import TINY
    raw = dict(TINY, model_type="qwen3_5_moe_text", quantization_config=qcfg, **cfg_kw)
    return QuantPlan.from_model_config(ModelConfig.from_dict(raw))


def test_visual_and_spelling_and_summary():
    p = _plan({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
               "ignore": ["model.language_model.layers.0.linear_attn.in_proj_qkv", "lm_head"]})
    assert p.format_of("model.layers.0.linear_attn.in_proj_qkv") is DenseWeights  # other spelling
    assert p.format_of("model.layers.1.linear_attn.in_proj_qkv") is Nvfp4Weights.for_layout("modelopt")
    assert p.format_of("lm_head") is DenseWeights
    assert p.scheme_for("model.visual.blocks.0.attn.qkv") is None
    s = p.summary()
    assert "nvfp4: 30 linears + routed experts of 4 layers (96 linears)" in s and "dense: 2 linears" in s


@pytest.mark.parametrize("qcfg,field", [
    ({"quant_method": "gptq"}, "quant_method"),
    ({"quant_method": "modelopt", "quant_algo": "INT4_AWQ"}, "quant_algo"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 32}, "group_size"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION"}, "quantized_layers"),
    ({"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION",
      "quantized_layers": {"model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "W8A16"}}}, "quant_algo"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int"}}}}, "format"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "float",
                                                                 "strategy": "group", "group_size": 32}}}},
     "strategy"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "block"}}}}, "strategy"),
    ({"quant_method": "compressed-tensors", "format": "float-quantized", "sparsity_config": {"format": "2:4"},
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float",
                                                                 "strategy": "tensor"}}}}, "sparsity_config"),
])
def test_unsupported_schemes_name_the_field(qcfg, field):
    with pytest.raises(ConfigError, match=field):
        _plan(qcfg)


def test_partly_excluded_experts_are_rejected():
    with pytest.raises(ConfigError, match="routed experts of model.layers.0.mlp.experts"):
        _plan({"quant_method": "modelopt", "quant_algo": "NVFP4", "ignore": ["model.layers.0.mlp.experts.0.*"]})


# ---- loader errors --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ct_ckpt(qwen35, tmp_path_factory):
    out = tmp_path_factory.mktemp("ct") / "q"
    quantize_checkpoint(qwen35, str(out), "compressed-tensors", "experts+shared", progress=False)
    return out


def _patch(path, fn, config_fn=None):
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            save_file(fn(load_file(os.path.join(path, f))), os.path.join(path, f))
    if config_fn:
        cfg = _config(path)
        config_fn(cfg)
        json.dump(cfg, open(os.path.join(path, "config.json"), "w"))


@pytest.fixture
def ct_copy(ct_ckpt, tmp_path):
    import shutil
    dst = tmp_path / "copy"
    shutil.copytree(ct_ckpt, dst)
    return dst


def test_quantized_tensor_for_dense_module_is_named(ct_copy):
    _patch(ct_copy, lambda t: t, lambda c: c["quantization_config"]["ignore"].append(
        "model.layers.2.mlp.shared_expert.up_proj"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.mlp\.shared_expert\.up_proj\.weight_\w+.*dense"):
        _load(ct_copy)


def test_dense_tensor_for_quantized_module_is_named(ct_copy):
    name = "model.layers.1.linear_attn.out_proj"
    _patch(ct_copy, lambda t: t, lambda c: c["quantization_config"].update(
        ignore=[i for i in c["quantization_config"]["ignore"] if i != name]))
    with pytest.raises(CheckpointError, match=re.escape(name + ".weight") + r" has shape \(64, 64\), expected "
                                              r"\(64, 32\) \(nvfp4"):
        _load(ct_copy)


def test_wrong_scale_shape_names_file_tensor_and_shapes(ct_copy):
    name = "model.layers.0.mlp.experts.3.down_proj.weight_scale"

    def widen(t):
        if name in t:
            t[name] = torch.cat([t[name], t[name][:, :1]], 1)
        return t
    _patch(ct_copy, widen)
    with pytest.raises(CheckpointError) as e:
        _load(ct_copy)
    msg = str(e.value)
    assert name in msg and "(64, 3)" in msg and "(64, 2)" in msg and ".safetensors" in msg


def test_wrong_dtype_is_named(ct_copy):
    name = "model.layers.0.mlp.shared_expert.down_proj.weight_scale"

    def to_f32(t):
        if name in t:
            t[name] = t[name].float()
        return t
    _patch(ct_copy, to_f32)
    with pytest.raises(CheckpointError, match=re.escape(name) + r".*expected E4M3 block scales"):
        _load(ct_copy)


def test_missing_global_scale_is_named(ct_copy):
    name = "model.layers.2.mlp.experts.7.up_proj.weight_global_scale"

    def drop(t):
        t.pop(name, None)
        return t
    _patch(ct_copy, drop)
    idx = os.path.join(ct_copy, "model.safetensors.index.json")
    if os.path.exists(idx):
        d = json.load(open(idx))
        d["weight_map"].pop(name, None)
        json.dump(d, open(idx, "w"))
    with pytest.raises(CheckpointError, match=r"missing tensors: " + re.escape(name)):
        _load(ct_copy)
