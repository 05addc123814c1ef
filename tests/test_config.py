import json

import pytest

from linrnn_serve.config import ConfigError, ModelConfig

BASE_TEXT = dict(
    vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2,
    head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8,
    moe_intermediate_size=512, shared_expert_intermediate_size=512, rms_norm_eps=1e-6,
    rope_parameters={"mrope_interleaved": True, "mrope_section": [11, 11, 10], "partial_rotary_factor": 0.25,
                     "rope_theta": 10000000, "rope_type": "default"},
    model_type="qwen3_5_moe_text", eos_token_id=248044,
)


def qwen35(**text):
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": False, "text_config": dict(BASE_TEXT, **text)}


def test_qwen35_nested_text_config():
    cfg = ModelConfig.from_dict(qwen35())
    assert cfg.model_type == "qwen3_5_moe" and cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert cfg.layer_types[:4] == ["linear_attention"] * 3 + ["full_attention"]
    assert cfg.attn_layers == [3, 7, 11, 15, 19, 23, 27, 31, 35, 39] and len(cfg.gdn_layers) == 30
    assert (cfg.key_dim, cfg.value_dim, cfg.conv_dim) == (2048, 4096, 8192)
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7
    assert cfg.norm_topk_prob and all(cfg.is_moe_layer(i) for i in range(40))
    assert cfg.eos_token_id == [248044]


def test_qwen3_next_flat_and_derived_layer_types():
    raw = dict(BASE_TEXT, model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], num_hidden_layers=48,
               num_experts=512, num_experts_per_tok=10, norm_topk_prob=False, decoder_sparse_step=1,
               mlp_only_layers=[], intermediate_size=5120, rope_theta=1e7, partial_rotary_factor=0.25)
    raw.pop("rope_parameters")
    cfg = ModelConfig.from_dict(raw)
    assert cfg.model_type == "qwen3_next" and not cfg.norm_topk_prob
    assert cfg.layer_types.count("full_attention") == 12 and cfg.layer_types[47] == "full_attention"
    raw["mlp_only_layers"] = [0]
    assert not ModelConfig.from_dict(raw).is_moe_layer(0)


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c.update(model_type="llama"), "model_type"),
    (lambda c: c["text_config"].pop("hidden_size"), "hidden_size"),
    (lambda c: c["text_config"].update(rope_parameters={"rope_type": "yarn", "factor": 4.0}), "yarn"),
    (lambda c: c["text_config"].update(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "rope_scaling"),
    (lambda c: c["text_config"].update(layer_types=["linear_attention"] * 3), "layer_types"),
    (lambda c: c["text_config"].update(num_experts_per_tok=300), "num_experts_per_tok"),
    (lambda c: c["text_config"].update(hidden_act="gelu"), "hidden_act"),
    (lambda c: c.pop("text_config"), "text_config"),
    (lambda c: c.update(architectures=["LlamaForCausalLM"]), "architectures"),
])
def test_unsupported_or_missing_fields_are_named(mutate, field):
    raw = qwen35()
    mutate(raw)
    with pytest.raises(ConfigError, match=field):
        ModelConfig.from_dict(raw)


def test_from_pretrained_names_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(qwen35(hidden_size=None)))
    with pytest.raises(ConfigError, match=r"config\.json.*hidden_size"):
        ModelConfig.from_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="no config.json"):
        ModelConfig.from_pretrained(tmp_path / "missing")


def test_default_token_budget_by_device():
    from linrnn_serve.config import (LARGE_GPU_BYTES, LARGE_GPU_TOKEN_BUDGET, TOKEN_BUDGET,
                                     default_max_num_batched_tokens)
    assert default_max_num_batched_tokens("cuda", 141 * 2**30) == LARGE_GPU_TOKEN_BUDGET == 8192  # H200
    assert default_max_num_batched_tokens("cuda", 80 * 2**30) == 8192  # H100
    assert default_max_num_batched_tokens("cuda", LARGE_GPU_BYTES - 1) == TOKEN_BUDGET == 2048  # 48 GB cards
    assert default_max_num_batched_tokens("cpu", None) == 2048


def test_engine_resolves_the_token_budget():
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    eng = LLMEngine(EngineConfig(model="tiny", load_format="dummy", device="cpu", max_num_seqs=4, max_model_len=256),
                    progress=False)
    assert eng.config.max_num_batched_tokens == 2048 and eng.scheduler.cfg.max_num_batched_tokens == 2048
    eng = LLMEngine(EngineConfig(model="tiny", load_format="dummy", device="cpu", max_num_seqs=4, max_model_len=256,
                                 max_num_batched_tokens=300), progress=False)
    assert eng.config.max_num_batched_tokens == 300
