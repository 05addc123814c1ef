"""Shared test fixtures: tiny HF-format checkpoints written by transformers itself."""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from safetensors.torch import load_file, save_file

# Device for the kernel tests' tensors: compiled Triton kernels on a CUDA machine, the Triton interpreter
# (TRITON_INTERPRET=1, set by conftest.py when there is no CUDA) on CPU tensors otherwise.
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TINY = dict(
    vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=16, moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=8,
    num_experts_per_tok=2, max_position_embeddings=4096,
)


def realistic_timescales(model, seed: int = 0) -> None:
    """SPEC §3's recommended A_log / dt_bias init, so decay timescales span short to long memory."""
    g = torch.Generator().manual_seed(seed)
    for mod in model.modules():
        if hasattr(mod, "A_log") and hasattr(mod, "dt_bias"):
            n = mod.A_log.numel()
            A = torch.empty(n).uniform_(1, 16, generator=g)
            dt = torch.exp(torch.empty(n).uniform_(torch.log(torch.tensor(1e-3)), torch.log(torch.tensor(0.1)),
                                                   generator=g)).clamp(min=1e-4)
            with torch.no_grad():
                mod.A_log.copy_(torch.log(A))
                mod.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))


def make_hf_checkpoint(path, family: str = "qwen3_5_moe", dtype=torch.float32, seed: int = 0,
                       shard_size: str = "200KB", **overrides) -> str:
    """Build a random tiny model with transformers and save_pretrained it (sharded) into `path`."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig, Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(seed)
    kw = dict(TINY, **overrides)
    if family == "qwen3_5_moe":
        model = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**kw))
    elif family == "qwen3_next":
        kw.setdefault("intermediate_size", 48)
        model = Qwen3NextForCausalLM(Qwen3NextConfig(**kw))
    else:
        raise ValueError(family)
    realistic_timescales(model, seed)
    model = model.to(dtype)
    model.save_pretrained(str(path), max_shard_size=shard_size)
    return str(path)


def rewrite_as_release_layout(path) -> None:
    """Turn a saved Qwen3_5MoeForCausalLM checkpoint into the layout of the real Qwen3.5 releases:
    nested `text_config` under model_type qwen3_5_moe (Qwen3_5MoeForConditionalGeneration),
    `model.language_model.*` names, and fused 3-D experts (SPEC §1.8, §1.10)."""
    path = str(path)
    tensors = {}
    for fn in sorted(os.listdir(path)):
        if fn.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(path, fn)))
            os.remove(os.path.join(path, fn))
    idx = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(idx):
        os.remove(idx)
    experts = defaultdict(dict)
    out = {}
    for name, t in tensors.items():
        parts = name.split(".")
        if ".mlp.experts." in name:
            layer, e, proj = int(parts[2]), int(parts[5]), parts[6]
            experts[layer][(e, proj)] = t
            continue
        out[name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name] = t
    for layer, d in experts.items():
        E = 1 + max(e for e, _ in d)
        gate_up = torch.stack([torch.cat([d[(e, "gate_proj")], d[(e, "up_proj")]], 0) for e in range(E)])
        down = torch.stack([d[(e, "down_proj")] for e in range(E)])
        out[f"model.language_model.layers.{layer}.mlp.experts.gate_up_proj"] = gate_up.contiguous()
        out[f"model.language_model.layers.{layer}.mlp.experts.down_proj"] = down.contiguous()
    # an MTP tensor and a vision tensor, which the loader must skip
    out["mtp.fc.weight"] = torch.randn(4, 4)
    out["model.visual.patch_embed.proj.weight"] = torch.randn(4, 4)
    names = sorted(out)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fn, ns in shards.items():
        save_file({n: out[n] for n in ns}, os.path.join(path, fn))
        weight_map.update({n: fn for n in ns})
    with open(idx, "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)
    text["model_type"] = "qwen3_5_moe_text"
    text.pop("architectures", None)
    text["rope_parameters"] = dict(text.get("rope_parameters") or {}, mrope_interleaved=True,
                                   mrope_section=[2, 1, 1])
    cfg = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
           "text_config": text, "tie_word_embeddings": False, "vision_config": {"depth": 1}}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)


def run_prompt(model, ids: list[int]) -> torch.Tensor:
    """All-position logits [T, V] of one prompt from an empty state."""
    from linrnn_serve.runner.session import Session

    s = Session(model, 1, len(ids) + 16)
    return s.forward([s.new_seq()], [ids], all_logits=True)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b| (NaN-safe: NaN anywhere fails)."""
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


def rel_fro(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b||_F / ||b||_F (NaN anywhere fails): the bf16 tolerance metric."""
    if torch.isnan(a).any() or torch.isnan(b).any():
        return float("inf")
    return ((a.float() - b.float()).norm() / b.float().norm()).item()
