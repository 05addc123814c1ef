"""HF checkpoint tensor names -> where they land in our model (SPEC §1.5-1.10, §2).

A checkpoint tensor resolves to one or more `Target`s:
  * a plain parameter (norms, embeddings, conv1d, A_log, dt_bias), or
  * a weight piece of a projection: (our module, part, expert, checkpoint suffix). The storage format
    of the part's weight group (dense, NVFP4, FP8; layers/linear.py) says which attribute and shape
    the suffix maps to, or
  * nothing (an empty list): recognised but unused, i.e. FP8 KV-cache scales (`k_proj.k_scale`, ...).

Handled name variants: `model.language_model.*` (Qwen3.5 VL wrapper) and `model.*` prefixes; fused
3-D experts (`experts.gate_up_proj`, `experts.down_proj`) and per-expert tensors; Qwen3-Next's
interleaved `in_proj_qkvz` / `in_proj_ba` (de-interleaved here, SPEC §1.6). `mtp.*` and vision
tensors are skipped (pass `skip_mtp=False` once an MTP head exists).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import torch

from linrnn_serve.config import ModelConfig

VISION_PREFIXES = ("model.visual.", "visual.", "model.vision_tower.")
MTP_PREFIX = "mtp."


def canonical_name(name: str) -> str:
    """`model.language_model.X` -> `model.X`; everything else unchanged."""
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


def skipped(name: str, skip_mtp: bool = True) -> bool:
    return name.startswith(VISION_PREFIXES) or (skip_mtp and name.startswith(MTP_PREFIX))


@dataclass
class Target:
    module: str  # our module path ("" = top level)
    param: str | None = None  # plain parameter name (for non-projection tensors)
    part: str | None = None  # projection part (FusedLinear part or Experts part)
    expert: int | None = None  # expert index for per-expert tensors (None: not per expert, or all experts)
    all_experts: bool = False  # source carries a leading [E] dim (fused 3-D experts)
    suffix: str = "weight"  # checkpoint suffix within the HF module (weight, weight_scale, ...)
    transform: Callable[[torch.Tensor], torch.Tensor] | None = None  # applied to the source first
    shape: tuple[int, ...] | None = None  # expected source shape for plain params


_L = r"model\.layers\.(\d+)\."
# ModelOpt: k_proj.k_scale / v_proj.v_scale; compressed-tensors kv_cache_scheme: self_attn.{k,v}_scale
_KV_CACHE_SCALE = re.compile(r"(?:[qkv]_proj\.|attn\.)?(?:[qkv]_scale|prob_scale)")
_SUFFIX = r"(weight|weight_packed|weight_scale|weight_scale_2|weight_global_scale|input_scale|input_global_scale)"


def _qkvz_split(cfg: ModelConfig):
    """Row de-interleave of Qwen3-Next's in_proj_qkvz / in_proj_ba (SPEC §1.6).

    Works for any tensor whose dim 0 is the fused output rows (weights, block scales); scalars and
    per-tensor scales pass through unchanged.
    """
    hk, dk, dv = cfg.linear_num_key_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    r = cfg.linear_num_value_heads // hk

    def rows(t, sizes, pick):
        if t.numel() == 1:  # per-tensor scales apply to every part
            return t
        g = t.reshape(hk, sum(sizes), *t.shape[1:])
        parts = torch.split(g, sizes, dim=1)
        return torch.cat([parts[i].reshape(-1, *t.shape[1:]) for i in pick], 0)

    qkvz = [dk, dk, r * dv, r * dv]
    return {
        "qkv": lambda t: rows(t, qkvz, [0, 1, 2]),
        "z": lambda t: rows(t, qkvz, [3]),
        "b": lambda t: rows(t, [r, r], [0]),
        "a": lambda t: rows(t, [r, r], [1]),
    }


def resolve(cfg: ModelConfig, name: str) -> list[Target] | None:
    """Targets of a canonical checkpoint tensor name; None if the name is not part of the model."""
    H, V = cfg.hidden_size, cfg.vocab_size
    if name == "model.embed_tokens.weight":
        return [Target("", param="embed_tokens", shape=(V, H))]
    if name == "model.norm.weight":
        return [Target("norm", param="weight", shape=(H,))]
    m = re.fullmatch(r"lm_head\." + _SUFFIX, name)
    if m:
        return [Target("lm_head", part="weight", suffix=m[1])]
    m = re.fullmatch(_L + r"(.*)", name)
    if not m:
        return None
    i, rest = int(m[1]), m[2]
    if i >= cfg.num_hidden_layers:
        return None
    L = f"layers.{i}."
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return [Target(L + rest.split(".")[0], param="weight", shape=(H,))]
    if cfg.layer_types[i] == "linear_attention" and rest.startswith("linear_attn."):
        return _resolve_gdn(cfg, L + "linear_attn", rest[len("linear_attn."):])
    if cfg.layer_types[i] == "full_attention" and rest.startswith("self_attn."):
        return _resolve_attn(cfg, L + "self_attn", rest[len("self_attn."):])
    if rest.startswith("mlp."):
        return _resolve_mlp(cfg, i, L + "mlp", rest[len("mlp."):])
    return None


def _resolve_gdn(cfg, mod, rest):
    hv, dv, K = cfg.linear_num_value_heads, cfg.linear_value_head_dim, cfg.linear_conv_kernel_dim
    if rest == "conv1d.weight":
        return [Target(mod, param="conv1d_weight", shape=(cfg.conv_dim, 1, K), transform=lambda t: t[:, 0])]
    if rest in ("A_log", "dt_bias"):
        return [Target(mod, param=rest, shape=(hv,))]
    if rest == "norm.weight":
        return [Target(mod, param="norm_weight", shape=(dv,))]
    m = re.fullmatch(r"in_proj_(qkv|z|b|a)\." + _SUFFIX, rest)
    if m:
        return [Target(mod + ".in_proj", part=m[1], suffix=m[2])]
    m = re.fullmatch(r"in_proj_(qkvz|ba)\." + _SUFFIX, rest)
    if m:
        split = _qkvz_split(cfg)
        parts = ("qkv", "z") if m[1] == "qkvz" else ("b", "a")
        return [Target(mod + ".in_proj", part=p, suffix=m[2], transform=split[p]) for p in parts]
    m = re.fullmatch(r"out_proj\." + _SUFFIX, rest)
    if m:
        return [Target(mod + ".out_proj", part="weight", suffix=m[1])]
    return None


def _resolve_attn(cfg, mod, rest):
    if rest in ("q_norm.weight", "k_norm.weight"):
        return [Target(mod, param=rest.split(".")[0], shape=(cfg.head_dim,))]
    if _KV_CACHE_SCALE.fullmatch(rest):  # FP8 KV-cache scales: recognised, unused (the cache stays bf16)
        return []
    m = re.fullmatch(r"(q|k|v)_proj\." + _SUFFIX, rest)
    if m:
        return [Target(mod + ".qkv_proj", part=m[1], suffix=m[2])]
    m = re.fullmatch(r"o_proj\." + _SUFFIX, rest)
    if m:
        return [Target(mod + ".o_proj", part="weight", suffix=m[1])]
    return None


def _resolve_mlp(cfg, i, mod, rest):
    if not cfg.is_moe_layer(i):
        m = re.fullmatch(r"(gate|up|down)_proj\." + _SUFFIX, rest)
        if not m:
            return None
        if m[1] == "down":
            return [Target(mod + ".down_proj", part="weight", suffix=m[2])]
        return [Target(mod + ".gate_up_proj", part=m[1], suffix=m[2])]
    if rest == "gate.weight":
        return [Target(mod + ".gate", part="router")]
    if rest == "shared_expert_gate.weight" and cfg.shared_expert_intermediate_size:
        return [Target(mod + ".gate", part="shared_gate")]
    if rest == "experts.gate_up_proj":
        return [Target(mod + ".experts", part="gate_up", all_experts=True)]
    if rest == "experts.down_proj":
        return [Target(mod + ".experts", part="down", all_experts=True)]
    m = re.fullmatch(r"experts\.(\d+)\.(gate|up|down)_proj\." + _SUFFIX, rest)
    if m:
        e = int(m[1])
        if e >= cfg.num_experts:
            return None
        return [Target(mod + ".experts", part=m[2], expert=e, suffix=m[3])]
    m = re.fullmatch(r"shared_expert\.(gate|up|down)_proj\." + _SUFFIX, rest)
    if m and cfg.shared_expert_intermediate_size:
        if m[1] == "down":
            return [Target(mod + ".shared_expert.down_proj", part="weight", suffix=m[2])]
        return [Target(mod + ".shared_expert.gate_up_proj", part=m[1], suffix=m[2])]
    return None


def standard_names(cfg: ModelConfig, suffixes_of: Callable[[str], list[str]]) -> list[str]:
    """Canonical names of a complete checkpoint in the standard layout (Qwen3.5 split projections,
    per-expert experts; Qwen3-Next fused qkvz/ba). Used to name what is missing.

    `suffixes_of(hf_module)` gives the required checkpoint suffixes of a projection's format.
    """
    out = ["model.embed_tokens.weight", "model.norm.weight"]
    out += [f"lm_head.{s}" for s in suffixes_of("lm_head")]

    def proj(mod):
        return [f"{mod}.{s}" for s in suffixes_of(mod)]

    for i in range(cfg.num_hidden_layers):
        P = f"model.layers.{i}."
        out += [P + "input_layernorm.weight", P + "post_attention_layernorm.weight"]
        if cfg.layer_types[i] == "linear_attention":
            A = P + "linear_attn."
            out += [A + "conv1d.weight", A + "A_log", A + "dt_bias", A + "norm.weight"]
            if cfg.model_type == "qwen3_next":
                out += proj(A + "in_proj_qkvz") + proj(A + "in_proj_ba")
            else:
                out += sum((proj(A + f"in_proj_{p}") for p in ("qkv", "z", "b", "a")), [])
            out += proj(A + "out_proj")
        else:
            A = P + "self_attn."
            out += [A + "q_norm.weight", A + "k_norm.weight"]
            out += sum((proj(A + f"{p}_proj") for p in ("q", "k", "v", "o")), [])
        M = P + "mlp."
        if cfg.is_moe_layer(i):
            out.append(M + "gate.weight")
            if cfg.shared_expert_intermediate_size:
                out.append(M + "shared_expert_gate.weight")
                out += sum((proj(M + f"shared_expert.{p}_proj") for p in ("gate", "up", "down")), [])
            for e in range(cfg.num_experts):
                out += sum((proj(M + f"experts.{e}.{p}_proj") for p in ("gate", "up", "down")), [])
        else:
            out += sum((proj(M + f"{p}_proj") for p in ("gate", "up", "down")), [])
    return out
