"""Model and engine configuration.

`ModelConfig` is parsed from a Hugging Face `config.json` of model_type `qwen3_5_moe` (text config
nested under `text_config`), `qwen3_5_moe_text` (what `Qwen3_5MoeForCausalLM.save_pretrained`
writes) or `qwen3_next` (flat). Field meanings follow SPEC §1.1 and §1.11. Anything we cannot run
faithfully fails here, at load, with the field named.

Nothing here imports CUDA things.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json we cannot serve faithfully. The message names the field."""


SUPPORTED_MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next")
SUPPORTED_ARCHITECTURES = (
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3NextForCausalLM",
)
_LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass
class ModelConfig:
    """The text decoder of a Qwen3.5-MoE / Qwen3-Next model (SPEC §1)."""

    model_type: str  # "qwen3_5_moe" or "qwen3_next" (qwen3_5_moe_text is normalised to qwen3_5_moe)
    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: list[str]
    rms_norm_eps: float
    # gated full attention (SPEC §1.7)
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_position_embeddings: int
    # Gated DeltaNet (SPEC §1.5)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE (SPEC §1.8)
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    # Qwen3-Next dense-MLP layers (SPEC §1.2); empty / unused for Qwen3.5
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    intermediate_size: int = 0
    tie_word_embeddings: bool = False
    eos_token_id: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    pad_token_id: int | None = None
    mtp_num_hidden_layers: int = 0
    torch_dtype: str = "bfloat16"
    # raw `quantization_config` (or hf_quant_config.json contents); parsed by checkpoint.quant_config
    quantization: dict[str, Any] | None = None

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    @property
    def gdn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "linear_attention"]

    @property
    def attn_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "full_attention"]

    def is_moe_layer(self, i: int) -> bool:
        # SPEC §1.2: Qwen3.5 is all-MoE; Qwen3-Next uses decoder_sparse_step / mlp_only_layers.
        if self.model_type == "qwen3_5_moe":
            return True
        return (
            i not in self.mlp_only_layers
            and self.num_experts > 0
            and (i + 1) % self.decoder_sparse_step == 0
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    # ---- parsing -------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> "ModelConfig":
        cfg_path = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_path):
            raise ConfigError(f"{cfg_path}: no config.json in the checkpoint directory")
        try:
            with open(cfg_path) as f:
                raw = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{cfg_path}: not valid JSON ({e})") from e
        # Legacy ModelOpt exports keep the quantization block in a side file (SPEC §2.2).
        hf_quant = os.path.join(path, "hf_quant_config.json")
        if "quantization_config" not in raw and os.path.isfile(hf_quant):
            with open(hf_quant) as f:
                raw["quantization_config"] = {"hf_quant_config": json.load(f)}
        try:
            return cls.from_dict(raw)
        except ConfigError as e:
            raise ConfigError(f"{cfg_path}: {e}") from None

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else ""
        if arch and arch not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(f"architectures {archs!r} is not supported (supported: {SUPPORTED_ARCHITECTURES})")

        text = raw
        if model_type == "qwen3_5_moe":
            if "text_config" not in raw or not isinstance(raw["text_config"], dict):
                raise ConfigError("text_config is required for model_type 'qwen3_5_moe'")
            text = dict(raw["text_config"])
            if "tie_word_embeddings" in raw and "tie_word_embeddings" not in text:
                text["tie_word_embeddings"] = raw["tie_word_embeddings"]
        family = "qwen3_next" if model_type == "qwen3_next" else "qwen3_5_moe"
        arch = arch or ("Qwen3NextForCausalLM" if family == "qwen3_next" else "Qwen3_5MoeForCausalLM")

        def req(name: str, typ=int):
            if name not in text or text[name] is None:
                raise ConfigError(f"required field {name!r} is missing")
            v = text[name]
            if typ is int and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ConfigError(f"field {name!r} must be a positive integer, got {v!r}")
            if typ is float and not isinstance(v, (int, float)):
                raise ConfigError(f"field {name!r} must be a number, got {v!r}")
            return v

        def opt(name: str, default):
            v = text.get(name, default)
            return default if v is None else v

        hidden = req("hidden_size")
        n_layers = req("num_hidden_layers")
        n_heads = req("num_attention_heads")
        head_dim = opt("head_dim", hidden // n_heads)

        # SPEC §1.2: derive layer_types from full_attention_interval when absent.
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = opt("full_attention_interval", 4)
            layer_types = [
                "linear_attention" if (i + 1) % interval != 0 else "full_attention" for i in range(n_layers)
            ]
        if len(layer_types) != n_layers:
            raise ConfigError(f"layer_types has {len(layer_types)} entries but num_hidden_layers is {n_layers}")
        for t in layer_types:
            if t not in _LAYER_TYPES:
                raise ConfigError(f"layer_types entry {t!r} is not one of {_LAYER_TYPES}")

        rope_theta, partial = _parse_rope(text)
        rotary_dim = int(head_dim * partial)
        if rotary_dim % 2 or rotary_dim <= 0:
            raise ConfigError(f"partial_rotary_factor {partial} gives an invalid rotary dim {rotary_dim}")

        if text.get("hidden_act", "silu") != "silu":
            raise ConfigError(f"hidden_act {text['hidden_act']!r} is not supported (only 'silu')")
        if text.get("attention_bias", False):
            raise ConfigError("attention_bias=true is not supported")
        if text.get("attn_output_gate", True) is not True:
            raise ConfigError("attn_output_gate=false is not supported")
        if text.get("use_sliding_window", False):
            raise ConfigError("use_sliding_window=true is not supported")

        n_kv = req("num_key_value_heads")
        if n_heads % n_kv:
            raise ConfigError(f"num_attention_heads {n_heads} is not a multiple of num_key_value_heads {n_kv}")
        nk, nv = req("linear_num_key_heads"), req("linear_num_value_heads")
        if nv % nk:
            raise ConfigError(f"linear_num_value_heads {nv} is not a multiple of linear_num_key_heads {nk}")
        n_exp, topk = req("num_experts"), req("num_experts_per_tok")
        if topk > n_exp:
            raise ConfigError(f"num_experts_per_tok {topk} exceeds num_experts {n_exp}")

        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_list = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))

        if family == "qwen3_5_moe":
            norm_topk = True  # SPEC §1.8: Qwen3.5 always renormalises
            sparse_step, mlp_only, inter = 1, [], 0
        else:
            norm_topk = bool(opt("norm_topk_prob", True))
            sparse_step = opt("decoder_sparse_step", 1)
            mlp_only = list(opt("mlp_only_layers", []))
            inter = opt("intermediate_size", 0)

        cfg = cls(
            model_type=family,
            architecture=arch,
            vocab_size=req("vocab_size"),
            hidden_size=hidden,
            num_hidden_layers=n_layers,
            layer_types=list(layer_types),
            rms_norm_eps=float(opt("rms_norm_eps", 1e-6)),
            num_attention_heads=n_heads,
            num_key_value_heads=n_kv,
            head_dim=head_dim,
            rotary_dim=rotary_dim,
            rope_theta=float(rope_theta),
            max_position_embeddings=opt("max_position_embeddings", 32768),
            linear_num_key_heads=nk,
            linear_num_value_heads=nv,
            linear_key_head_dim=req("linear_key_head_dim"),
            linear_value_head_dim=req("linear_value_head_dim"),
            linear_conv_kernel_dim=opt("linear_conv_kernel_dim", 4),
            num_experts=n_exp,
            num_experts_per_tok=topk,
            moe_intermediate_size=req("moe_intermediate_size"),
            shared_expert_intermediate_size=opt("shared_expert_intermediate_size", 0),
            norm_topk_prob=norm_topk,
            decoder_sparse_step=sparse_step,
            mlp_only_layers=mlp_only,
            intermediate_size=inter,
            tie_word_embeddings=bool(opt("tie_word_embeddings", False)),
            eos_token_id=eos_list,
            bos_token_id=text.get("bos_token_id", raw.get("bos_token_id")),
            pad_token_id=text.get("pad_token_id", raw.get("pad_token_id")),
            mtp_num_hidden_layers=opt("mtp_num_hidden_layers", 0),
            torch_dtype=str(text.get("dtype") or text.get("torch_dtype") or raw.get("torch_dtype") or "bfloat16"),
            quantization=raw.get("quantization_config"),
        )
        if any(not cfg.is_moe_layer(i) for i in range(n_layers)) and cfg.intermediate_size <= 0:
            raise ConfigError("intermediate_size is required when some layers use a dense MLP")
        return cfg


def _parse_rope(text: dict[str, Any]) -> tuple[float, float]:
    """Return (rope_theta, partial_rotary_factor); reject scaling we do not implement.

    transformers v5 writes `rope_parameters`; older configs write `rope_theta` / `rope_scaling` at
    the top level. Qwen3.5's interleaved M-RoPE reduces to 1-D RoPE for text (SPEC §1.7), so its
    `mrope_section` / `mrope_interleaved` keys are accepted.
    """
    params = text.get("rope_parameters") or {}
    scaling = text.get("rope_scaling")
    if scaling:
        rtype = scaling.get("rope_type", scaling.get("type", "default"))
        if rtype not in ("default", "mrope"):
            raise ConfigError(f"rope_scaling type {rtype!r} is not supported (only default RoPE)")
    rtype = params.get("rope_type", "default")
    if rtype not in ("default", "mrope"):
        raise ConfigError(f"rope_parameters.rope_type {rtype!r} is not supported (only default RoPE)")
    theta = params.get("rope_theta", text.get("rope_theta", 10000.0))
    partial = params.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
    if not (isinstance(theta, (int, float)) and theta > 0 and math.isfinite(theta)):
        raise ConfigError(f"rope_theta must be a positive number, got {theta!r}")
    if not (0 < partial <= 1):
        raise ConfigError(f"partial_rotary_factor must be in (0, 1], got {partial!r}")
    return float(theta), float(partial)


# Default chunked-prefill token budget (vLLM's online-serving defaults): 8192 on GPUs with >= 70 GiB (H100 / H200),
# else 2048. H200, 35B-A3B NVFP4, 64 x 128-token prompts (benchmarks/results/serving/prefill_round/): one
# 8192-token step prefills them in 0.162 s, four 2048-token steps (CUDA graphs) in 0.227 s (the MoE's expert GEMMs
# get 4x the tokens per weight tile); its activation peak (~2 GiB) is measured at start-up and reserved.
LARGE_GPU_BYTES = 70 * 2**30
LARGE_GPU_TOKEN_BUDGET = 8192
TOKEN_BUDGET = 2048


def default_max_num_batched_tokens(device_type: str, total_memory: int | None) -> int:
    """The token budget per step when none is given: LARGE_GPU_TOKEN_BUDGET on a GPU of >= 70 GiB, else
    TOKEN_BUDGET (smaller GPUs keep the memory for the KV cache; CPUs gain nothing from longer steps)."""
    if device_type == "cuda" and total_memory is not None and total_memory >= LARGE_GPU_BYTES:
        return LARGE_GPU_TOKEN_BUDGET
    return TOKEN_BUDGET


@dataclass
class EngineConfig:
    """What the CLI / LLM(...) / AsyncLLMEngine are constructed from (vLLM-style names)."""

    model: str  # checkpoint dir, HF repo id, or preset name (linrnn_serve.presets)
    load_format: str = "auto"  # "auto" | "dummy" (random weights of the real shapes, no download)
    dtype: str = "auto"  # "auto" (bf16 on GPU, f32 on CPU) | "bfloat16" | "float32"
    device: str = "auto"  # "auto" | "cuda" | "cpu"
    max_model_len: int | None = None  # default: min(config max_position_embeddings, 8192)
    # a max_model_len above the model's max_position_embeddings is refused unless this is set
    # (positions the model was not trained on: quality is unknown); vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN
    allow_long_max_model_len: bool = False
    max_num_seqs: int = 64
    # chunked-prefill token budget per step; None: default_max_num_batched_tokens(device) when the engine starts
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float = 0.90
    block_size: int = 16
    enforce_eager: bool = False  # no CUDA graphs
    ssm_bf16_tau: float = math.inf  # heads with decay timescale <= tau keep bf16 state (inf: all f32)
    ssm_calibration: str | None = None  # text file for tier-2 calibration (classifier.py)
    seed: int = 0
    max_queue_len: int = 1024  # waiting requests beyond this are refused (HTTP 503)
    served_model_name: str | None = None
    num_kv_blocks: int | None = None  # override the memory-budget computation (tests)
    tensor_parallel_size: int = 1  # ranks (GPUs, or CPU processes) the model is sharded over (parallel.py)
    enable_expert_parallel: bool = False  # with tensor_parallel_size > 1: partition the routed experts
    # exact prefix caching (cache/prefix_cache.py): radix tree of KV blocks + recurrent-state snapshots
    enable_prefix_caching: bool = False
    # share of the cache memory (what gpu_memory_utilization leaves after weights, state slots,
    # activations and graphs) given to the prefix cache's state snapshots; the rest is paged KV
    prefix_snapshot_fraction: float = 0.1
    num_prefix_snapshots: int | None = None  # override the snapshot count (tests)
    max_logprobs: int = 20  # most logprobs / prompt_logprobs / top_logprobs a request may ask for
    # "auto": the checkpoint's generation_config.json gives default sampling params; "vllm": none; or a folder
    generation_config: str = "auto"
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # chat front end (server and LLM.chat): template override, output parsers
    chat_template: str | None = None  # a file path or the template text
    reasoning_parser: str | None = None  # "qwen3" | "deepseek_r1"
    tool_call_parser: str | None = None  # "qwen3_coder" | "hermes"
    enable_auto_tool_choice: bool = False
    # structured output waits for the end of the reasoning (</think>) unless this is set (vLLM's default)
    structured_outputs_enable_in_reasoning: bool = False
    # how the core drives its workers (engine/executor.py): "uniproc" (one in-process worker), a
    # registered kind, or "package.module:Class" (e.g. the host-overhead benchmark's stubbed forward)
    executor: str = "uniproc"
    # overlapped steps (vLLM's async scheduling): step N+1 is scheduled and launched before step N's sampled ids
    # reach the host. None: on for CUDA, off on the CPU (where the forward runs on the host and nothing overlaps)
    async_scheduling: bool | None = None
    # late binding (engine/step_clock.py): with overlapped steps the engine-core process schedules step N+1 just
    # before step N is predicted to end, reading arrivals meanwhile, not at N's start. None: on where steps overlap
    late_binding: bool | None = None
    # mixed batches: a step with prefill rows runs its decode rows inside the prefill forward as one-token chunks
    # (one forward per step instead of two). None: MIXED_BATCH_DEFAULT (runner/model_runner.py)
    mixed_batch: bool | None = None
    # burst coalescing (engine/burst.py): the engine-core process holds new prompts back briefly so that a burst of
    # arrivals prefills in one step. None: on in the engine-core process (the offline engine never holds)
    coalesce_bursts: bool | None = None
    # a held burst's first arrivals prefill while the rest arrive (engine/burst.py, head start). None: on with
    # burst coalescing
    burst_head_start: bool | None = None
