"""Config of the embedded default model, and the byte budget of its NVFP4 checkpoint.

Architecture: exactly qwen3_5_moe (transformers' Qwen3_5MoeTextConfig / Qwen3_5MoeForCausalLM, SPEC §1):
8 layers = (3 x Gated-DeltaNet + 1 x gated full attention) x 2, every layer a sparse MoE with a
sigmoid-gated shared expert, untied lm_head, zero-centred RMSNorms. Scaled down:

  vocab 8192 (tools/tokenizer.py), hidden 384
  GDN: 3 key heads / 6 value heads (Hv = 2 Hk, grouped as in the release), head dims 64/64, conv 4
  attention: 6 q heads / 2 kv heads, head_dim 64, partial rotary 0.25 (16 dims), rope_theta 1e4
  MoE: 16 experts, top-4, expert width 128, shared expert width 256

Sizing (nvfp4_checkpoint_bytes below, scope experts+shared as NVFP4, all else bf16): ~34 MB on disk,
of which embeddings + lm_head 12.6 MB, GDN 7.2 MB, attention 2.2 MB, MoE 12.1 MB. ~32 M parameters,
~15 M active per token (incl. lm_head). The ~38 MB limit leaves room for safetensors headers.
Why these choices: bf16 tensors cost 2 B/param on disk and NVFP4 experts 0.5625 B/param, so the
routed experts hold most parameters (19 M of 32 M) for 12 MB; hidden 384 keeps the bf16 embedding,
lm_head and mixers affordable; 8 layers is the smallest depth that still has the real 3:1 pattern
twice. rope_theta is 1e4 (not the release's 1e7): with 16 rotary dims and contexts <= 8k, 1e7
would leave almost no rotation.
"""
from __future__ import annotations

import math

DEFAULT = dict(
    vocab_size=8192,
    hidden_size=384,
    num_hidden_layers=8,
    layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    full_attention_interval=4,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=3,
    linear_num_value_heads=6,
    linear_key_head_dim=64,
    linear_value_head_dim=64,
    linear_conv_kernel_dim=4,
    num_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=128,
    shared_expert_intermediate_size=256,
    max_position_embeddings=8192,
    rms_norm_eps=1e-6,
    initializer_range=0.02,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    router_aux_loss_coef=0.01,  # load balancing for training (Mixtral 0.02, Qwen 0.001); unused at inference
    output_router_logits=False,
    tie_word_embeddings=False,
    eos_token_id=[2, 0],  # <|im_end|>, <|endoftext|> (tools/tokenizer.py)
    pad_token_id=None,  # a padding_idx would freeze the <|endoftext|> embedding at zero
    bos_token_id=None,
)

# a tiny model of the same architecture for the CPU pipeline test
TINY = dict(DEFAULT, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16, linear_value_head_dim=16,
            num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
            num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"],
            max_position_embeddings=1024)

MAX_SHARD_BYTES = 15 * 1000 * 1000  # the GPU machine returns files of at most 16 MB
NVFP4_BUDGET_BYTES = 38 * 1000 * 1000


def text_config(preset: str = "default", **overrides) -> dict:
    base = {"default": DEFAULT, "tiny": TINY}[preset]
    cfg = dict(base, **overrides)
    n = cfg["num_hidden_layers"]
    if len(cfg["layer_types"]) != n:
        k = cfg["full_attention_interval"]
        cfg["layer_types"] = ["linear_attention" if (i + 1) % k else "full_attention" for i in range(n)]
    return cfg


def hf_config(cfg: dict):
    from transformers import Qwen3_5MoeTextConfig

    return Qwen3_5MoeTextConfig(**cfg)


def tensor_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """HF tensor name -> (shape, role) of the bf16 checkpoint (per-expert names, as save_pretrained
    writes them). role: 'expert' / 'shared' (NVFP4 under scope experts+shared) or 'dense'."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    kd = cfg["linear_num_key_heads"] * cfg["linear_key_head_dim"]
    vd = cfg["linear_num_value_heads"] * cfg["linear_value_head_dim"]
    nv = cfg["linear_num_value_heads"]
    nh, nkv, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    E, I, Is = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["shared_expert_intermediate_size"]
    out = {"model.embed_tokens.weight": ((V, H), "dense"), "model.norm.weight": ((H,), "dense"),
           "lm_head.weight": ((V, H), "dense")}
    for i, lt in enumerate(cfg["layer_types"]):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = ((H,), "dense")
        out[p + "post_attention_layernorm.weight"] = ((H,), "dense")
        if lt == "linear_attention":
            a = p + "linear_attn."
            out.update({a + "in_proj_qkv.weight": ((2 * kd + vd, H), "dense"),
                        a + "in_proj_z.weight": ((vd, H), "dense"),
                        a + "in_proj_b.weight": ((nv, H), "dense"), a + "in_proj_a.weight": ((nv, H), "dense"),
                        a + "conv1d.weight": ((2 * kd + vd, 1, cfg["linear_conv_kernel_dim"]), "dense"),
                        a + "A_log": ((nv,), "dense"), a + "dt_bias": ((nv,), "dense"),
                        a + "norm.weight": ((cfg["linear_value_head_dim"],), "dense"),
                        a + "out_proj.weight": ((H, vd), "dense")})
        else:
            a = p + "self_attn."
            out.update({a + "q_proj.weight": ((2 * nh * hd, H), "dense"), a + "k_proj.weight": ((nkv * hd, H), "dense"),
                        a + "v_proj.weight": ((nkv * hd, H), "dense"), a + "o_proj.weight": ((H, nh * hd), "dense"),
                        a + "q_norm.weight": ((hd,), "dense"), a + "k_norm.weight": ((hd,), "dense")})
        m = p + "mlp."
        out[m + "gate.weight"] = ((E, H), "dense")
        out[m + "shared_expert_gate.weight"] = ((1, H), "dense")
        for e in range(E):
            out.update({f"{m}experts.{e}.gate_proj.weight": ((I, H), "expert"),
                        f"{m}experts.{e}.up_proj.weight": ((I, H), "expert"),
                        f"{m}experts.{e}.down_proj.weight": ((H, I), "expert")})
        out.update({m + "shared_expert.gate_proj.weight": ((Is, H), "shared"),
                    m + "shared_expert.up_proj.weight": ((Is, H), "shared"),
                    m + "shared_expert.down_proj.weight": ((H, Is), "shared")})
    return out


def nvfp4_checkpoint_bytes(cfg: dict, scope: tuple[str, ...] = ("expert", "shared")) -> dict:
    """Bytes on disk of the compressed-tensors NVFP4 checkpoint (SPEC §2.3): per quantized [N, K] weight
    weight_packed N*K/2 (uint8) + weight_scale N*K/16 (E4M3) + weight_global_scale 4 (+ 4 for an
    input_global_scale if W4A4), everything else bf16; plus ~110 B of safetensors header per tensor."""
    by_role: dict[str, int] = {}
    n_tensors = 0
    params = {"total": 0, "nvfp4": 0}
    for name, (shape, role) in tensor_shapes(cfg).items():
        numel = math.prod(shape)
        params["total"] += numel
        if role in scope:
            N, K = shape
            b, n = N * K // 2 + N * K // 16 + 4 + 4, 4
            params["nvfp4"] += numel
        else:
            b, n = 2 * numel, 1
        key = ("embed+lm_head" if name in ("model.embed_tokens.weight", "lm_head.weight") else
               "mixers+norms+router" if role == "dense" else role)
        by_role[key] = by_role.get(key, 0) + b
        n_tensors += n
    header = 110 * n_tensors
    total = sum(by_role.values()) + header
    return {"total": total, "by_role": by_role, "header_estimate": header, "tensors": n_tensors,
            "params": params, "min_shards": -(-total // MAX_SHARD_BYTES),
            "bf16_total": 2 * params["total"]}


if __name__ == "__main__":
    import json

    print(json.dumps(nvfp4_checkpoint_bytes(text_config()), indent=1))
