"""EngineArgs: the one definition of the engine's arguments (vLLM's names and spellings).

It feeds the serve CLI (`linrnn-serve [serve] MODEL ...`), the bench CLI (`linrnn-serve bench
batched ...`) and the offline `LLM(...)` constructor:

    parser = argparse.ArgumentParser(); EngineArgs.add_cli_args(parser)
    config = EngineArgs.from_cli_args(parser.parse_args()).create_engine_config()
    config = EngineArgs(model="default", max_model_len="4k").create_engine_config()   # LLM(...)

Each field carries its flag's help in its metadata, so a new engine argument is one field here
(plus its EngineConfig field). Flags vLLM users type that this engine accepts but that change
nothing (`--trust-remote-code`, `--enable-chunked-prefill`, ...) say so in their help; values it
cannot honour (`--kv-cache-dtype fp8`, `--tensor-parallel-size 2` until tensor parallelism lands)
fail in `create_engine_config` with one line saying why. Known vLLM flags this engine does not have
at all (UNSUPPORTED_FLAGS) are accepted by the parser and refused the same way, so the user reads
why instead of argparse's "unrecognized arguments".

Plain dataclass + argparse: bottom of the import graph (imports only linrnn_serve.config).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

from linrnn_serve.config import EngineConfig

DTYPE_ALIASES = {"auto": "auto", "bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32",
                 "float": "float32", "f32": "float32", "half": "float16", "float16": "float16", "fp16": "float16"}
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc",
                   "fp8_ds_mla")
GENERATION_CONFIG_HELP = ("'auto': the checkpoint's generation_config.json supplies default sampling parameters "
                          "(temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens); 'vllm': "
                          "vLLM's neutral defaults; a folder: read generation_config.json from it")

# vLLM flags with no counterpart here -> why (the message a user sees)
UNSUPPORTED_FLAGS: dict[str, str] = {
    "--pipeline-parallel-size": "pipeline parallelism is not implemented (one GPU per engine)",
    "--data-parallel-size": "data parallelism is not implemented: run one server per GPU behind a load balancer",
    "--quantization": "the quantization format is read from the checkpoint's config (NVFP4 ModelOpt / "
                      "compressed-tensors, FP8); there is nothing to choose",
    "--speculative-config": "speculative decoding is not implemented",
    "--enable-lora": "LoRA adapters are not implemented",
    "--lora-modules": "LoRA adapters are not implemented",
    "--cpu-offload-gb": "CPU weight offload is not implemented",
    "--swap-space": "preempted sequences are recomputed, not swapped to CPU memory",
    "--tokenizer": "the tokenizer is read from the checkpoint directory (tokenizer.json)",
    "--tokenizer-mode": "only the checkpoint's fast tokenizer (tokenizer.json) is supported",
    "--revision": "pin a revision by downloading it and passing its directory as the model",
    "--limit-mm-per-prompt": "this server is text-only (no image or video inputs)",
    "--distributed-executor-backend": "there is one in-process worker (no Ray / multiprocessing executor)",
}


def human_int(s: str | int) -> int:
    """vLLM's sizes: '4096', '4k' = 4000, '4K' = 4096, '1m' = 1e6, '1M' = 2**20, '25.6k' = 25600."""
    if isinstance(s, int):
        return s
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmMgG]?)\s*", str(s))
    if not m:
        raise argparse.ArgumentTypeError(f"expected an integer with an optional k/m/g (x1000) or K/M/G (x1024) "
                                         f"suffix, got {s!r}")
    num, suf = m.groups()
    mult = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "K": 2**10, "M": 2**20, "G": 2**30}[suf]
    if suf in "KMG" and suf and "." in num:
        raise argparse.ArgumentTypeError(f"binary suffixes (K/M/G) take a whole number, got {s!r}")
    v = float(num) * mult
    if v != int(v):
        raise argparse.ArgumentTypeError(f"{s!r} is not a whole number of tokens")
    return int(v)


def _max_model_len(s: str) -> int | None:
    if str(s).strip().lower() in ("auto", "-1"):
        return None  # the model's own limit
    v = human_int(s)
    if v < 2:
        raise argparse.ArgumentTypeError(f"must be at least 2, got {s}")
    return v


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _fraction(s: str) -> float:
    v = float(s)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _dtype(s: str) -> str:
    if s not in DTYPE_ALIASES:
        raise argparse.ArgumentTypeError(f"invalid choice {s!r} (choose from {', '.join(DTYPE_ALIASES)})")
    return DTYPE_ALIASES[s]


def _json_dict(s: str) -> dict:
    try:
        v = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e})") from None
    if not isinstance(v, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return v


def _structured_outputs_config(cfg: dict | None) -> bool:
    """--structured-outputs-config -> enable_in_reasoning; ValueError (one line) on what we do not have."""
    cfg = dict(cfg or {})
    backend = cfg.pop("backend", "auto")
    if backend not in ("auto", "xgrammar"):
        raise ValueError(f"--structured-outputs-config: backend {backend!r} is not available (xgrammar only)")
    enable = cfg.pop("enable_in_reasoning", False)
    if not isinstance(enable, bool):
        raise ValueError("--structured-outputs-config: enable_in_reasoning must be true or false")
    if cfg:
        raise ValueError(f"--structured-outputs-config: keys {sorted(cfg)} are not supported (backend, "
                         f"enable_in_reasoning)")
    return enable


def _arg(help: str, group: str = "engine", flags: tuple[str, ...] = (), **argparse_kw) -> dict[str, Any]:
    return {"help": help, "group": group, "flags": flags, "argparse": argparse_kw}


def _f(default, help: str, group: str = "engine", flags: tuple[str, ...] = (), **kw):
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=_arg(help, group, flags, **kw))
    return field(default=default, metadata=_arg(help, group, flags, **kw))


@dataclass
class EngineArgs:
    # ---- model ------------------------------------------------------------------------------
    model: str = _f("default", "checkpoint directory, Hugging Face repo id, or preset name (default: the embedded "
                    "default model); may also be given positionally", "model", metavar="NAME|PATH|HF_REPO_ID")
    served_model_name: list[str] | None = _f(None, "name(s) clients use in the 'model' field (default: the model's "
                                             "name); the first is reported in responses and metrics", "model",
                                             nargs="+", metavar="NAME")
    load_format: str = _f("auto", "'dummy': random weights of the real shapes, no weight download", "model",
                          choices=("auto", "dummy"))
    dtype: str = _f("auto", "weight / activation dtype: auto (bfloat16 on GPU, float32 on CPU), bfloat16, "
                    "float32 (float), float16 (half)", "model", type=_dtype)
    device: str = _f("auto", "'auto': the GPU if there is one, else the CPU", "model", choices=("auto", "cuda", "cpu"))
    seed: int = _f(0, "seed for dummy weights and unseeded requests", "model", type=int)
    trust_remote_code: bool = _f(False, "accepted for vLLM compatibility; no remote code is ever run (the "
                                 "architectures are built in)", "model", action="store_true")
    generation_config: str = _f("auto", GENERATION_CONFIG_HELP, "model")
    override_generation_config: dict | None = _f(None, "JSON object overriding generation-config defaults, e.g. "
                                                 "'{\"temperature\": 0.6}'", "model", type=_json_dict)
    # ---- engine -----------------------------------------------------------------------------
    max_model_len: int | None = _f(None, "context length (prompt + output) per request; k/m (x1000) and K/M "
                                   "(x1024) suffixes; 'auto' or -1: the model's (default: min(model's, 8192)); "
                                   "above the model's limit needs --allow-long-max-model-len",
                                   type=_max_model_len)
    allow_long_max_model_len: bool = _f(False, "accept a --max-model-len above the model's "
                                        "max_position_embeddings (refused otherwise: the model was not trained on "
                                        "those positions; env LINRNN_ALLOW_LONG_MAX_MODEL_LEN=1 or vLLM's "
                                        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 too)", action="store_true")
    max_num_seqs: int = _f(64, "sequences in the running batch", type=_positive_int)
    max_num_batched_tokens: int | None = _f(
        None, "tokens per engine step (chunked-prefill budget; k/K suffixes). Default: 8192 on a GPU with >= 70 GiB "
        "(H100 / H200, as vLLM's server), else 2048: on the H200 one 8192-token step prefills 64 x 128-token prompts "
        "1.4x faster than four 2048-token steps (the expert GEMMs see 4x the tokens); the activation memory of "
        "a full step is measured at start-up and reserved, so a larger budget leaves less to the KV cache",
        type=human_int)
    max_queue_len: int = _f(1024, "requests waiting for admission; beyond this the server answers 503",
                            type=_positive_int)
    gpu_memory_utilization: float = _f(0.90, "fraction of GPU memory for weights, activations and caches",
                                       type=_fraction)
    block_size: int = _f(16, "tokens per paged-KV block", type=_positive_int)
    num_kv_blocks: int | None = _f(None, "fix the number of KV blocks instead of sizing from memory (testing)",
                                   type=_positive_int)
    kv_cache_dtype: str = _f("auto", "KV cache dtype: 'auto' (the model dtype); fp8 KV is not implemented",
                             choices=KV_CACHE_DTYPES)
    enforce_eager: bool = _f(False, "no CUDA graphs", action="store_true")
    async_scheduling: bool | None = _f(None, "overlapped steps: schedule and launch step N+1 before step N's "
                                       "sampled ids reach the host (default: on for CUDA, off on the CPU)",
                                       action=argparse.BooleanOptionalAction)
    late_binding: bool | None = _f(None, "with overlapped steps, schedule step N+1 just before step N is predicted "
                                   "to end (reading new requests meanwhile), not at its start: a request arriving "
                                   "during step N runs in N+1 (default: on where steps overlap)",
                                   action=argparse.BooleanOptionalAction)
    coalesce_bursts: bool | None = _f(None, "new prompts wait briefly (at most 50 ms) for the rest of their burst "
                                      "(the successors of requests that ended together, arrivals close together, "
                                      "a batch about to end) so that the burst prefills in one step; a lone "
                                      "request never waits (default: on in the server's engine core)",
                                      action=argparse.BooleanOptionalAction)
    burst_head_start: bool | None = _f(None, "with --coalesce-bursts, a held burst's first arrivals (>= 1024 prompt "
                                       "tokens, 2 ms after the first, while bursts come back >= 14 ms spread) start "
                                       "prefilling while the rest arrive; they decode with the rest (default: on "
                                       "with burst coalescing)",
                                       action=argparse.BooleanOptionalAction)
    mixed_batch: bool | None = _f(None, "a step with prompts to prefill runs its decode rows in the same forward, "
                                  "as one-token chunks (one forward per step, not two); their logits then "
                                  "depend on who else is prefilling in the last bits (default: off, see "
                                  "the README)", action=argparse.BooleanOptionalAction)
    enable_prefix_caching: bool | None = _f(None, "reuse the cached state / KV of a shared prompt prefix "
                                            "(exact, any length; recurrent-state snapshots)",
                                            action=argparse.BooleanOptionalAction)
    prefix_snapshot_fraction: float = _f(0.1, "share of the cache memory given to prefix-cache state snapshots "
                                         "(the rest is KV)", type=_fraction)
    num_prefix_snapshots: int | None = _f(None, "fix the number of prefix-cache state snapshots instead (testing)",
                                          type=_positive_int)
    enable_chunked_prefill: bool | None = _f(None, "accepted for vLLM compatibility: prefill is always chunked "
                                             "(--max-num-batched-tokens per step)",
                                             action=argparse.BooleanOptionalAction)
    tensor_parallel_size: int = _f(1, "shard the model over N GPUs (or N CPU processes with --device cpu): one "
                                   "worker process per rank", flags=("-tp",), type=_positive_int)
    enable_expert_parallel: bool = _f(False, "with -tp N: partition the routed experts over the ranks instead of "
                                      "splitting each one", action="store_true")
    max_logprobs: int = _f(20, "most logprobs / top_logprobs a request may ask for", type=int)
    ssm_bf16_tau: float = _f(math.inf, "GDN heads with decay timescale <= TAU keep their recurrent state in bf16 "
                             "(default inf: all f32)", type=float, metavar="TAU")
    ssm_calibration: str | None = _f(None, "text for the tier-2 calibration of the f32/bf16 head split",
                                     metavar="TEXT_FILE")
    # ---- chat front end (the server and LLM.chat) -----------------------------------------------
    chat_template: str | None = _f(None, "chat template file (or the template text) to use instead of the "
                                   "checkpoint's own", "frontend")
    reasoning_parser: str | None = _f(None, "split <think>...</think> into reasoning_content ('qwen3', "
                                      "'deepseek_r1')", "frontend")
    tool_call_parser: str | None = _f(None, "parse tool calls out of the output: 'qwen3_coder' "
                                      "(<tool_call><function=...>) or 'hermes' (<tool_call>{json}</tool_call>)",
                                      "frontend")
    enable_auto_tool_choice: bool = _f(False, "let the model decide to call tools (tool_choice 'auto'); needs "
                                       "--tool-call-parser", "frontend", action="store_true")
    structured_outputs_config: dict | None = _f(None, "JSON object, vLLM's keys: 'backend' ('xgrammar' or 'auto'), "
                                                "'enable_in_reasoning' (true: constrain the <think> part too; "
                                                "default: the constraint starts after it)", "frontend",
                                                type=_json_dict)
    # vLLM flags we do not have: set by the parser only, refused in create_engine_config
    unsupported: dict[str, Any] = field(default_factory=dict, metadata={"cli": False})

    def __post_init__(self):
        if isinstance(self.served_model_name, str):  # LLM(..., served_model_name="x")
            self.served_model_name = [self.served_model_name]

    # ---- argparse -----------------------------------------------------------------------------
    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, overrides: dict[str, dict] | None = None,
                     skip: tuple[str, ...] = ()) -> argparse.ArgumentParser:
        """Add every engine flag, grouped. `overrides[name]` replaces argparse keywords of one flag (the
        bench CLI takes comma lists for --model); `skip` leaves flags out."""
        overrides = overrides or {}
        groups: dict[str, argparse._ArgumentGroup] = {}
        for f in dataclasses.fields(cls):
            if f.metadata.get("cli") is False or f.name in skip:
                continue
            md = f.metadata
            g = groups.get(md["group"])
            if g is None:
                g = groups[md["group"]] = parser.add_argument_group(md["group"])
            kw = dict(md["argparse"])
            kw.setdefault("default", f.default if f.default is not dataclasses.MISSING else None)
            kw["help"] = md["help"]
            kw.update(overrides.get(f.name, {}))
            g.add_argument("--" + f.name.replace("_", "-"), *md["flags"], dest=f.name, **kw)
        for flag in UNSUPPORTED_FLAGS:
            parser.add_argument(flag, dest="unsupported_" + flag[2:].replace("-", "_"), nargs="?", const=True,
                                default=None, help=argparse.SUPPRESS)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        kw = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
              if f.metadata.get("cli") is not False and hasattr(args, f.name)}
        unsupported = {flag: getattr(args, "unsupported_" + flag[2:].replace("-", "_"), None)
                       for flag in UNSUPPORTED_FLAGS}
        kw["unsupported"] = {k: v for k, v in unsupported.items() if v is not None}
        if kw.get("model") is None:
            kw["model"] = "default"
        return cls(**kw)

    # ---- -> EngineConfig ---------------------------------------------------------------------
    def create_engine_config(self) -> EngineConfig:
        """The EngineConfig, or ValueError with one line saying why a value cannot be honoured."""
        for flag in self.unsupported:
            raise ValueError(f"{flag} is not supported: {UNSUPPORTED_FLAGS[flag]}")
        dtype = DTYPE_ALIASES.get(self.dtype)
        if dtype is None:
            raise ValueError(f"--dtype {self.dtype!r} is not supported ({', '.join(DTYPE_ALIASES)})")
        if self.kv_cache_dtype.startswith("fp8"):
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: an fp8 KV cache is not implemented (the KV "
                             f"of the attention layers, 1 in 4, is kept in the model dtype)")
        if self.kv_cache_dtype not in ("auto",) and self.kv_cache_dtype != dtype:
            raise ValueError(f"--kv-cache-dtype {self.kv_cache_dtype}: the KV cache is kept in the model dtype "
                             f"(--dtype {dtype}); use 'auto'")
        if self.enable_chunked_prefill is False:
            raise ValueError("--no-enable-chunked-prefill: prefill is always chunked here; bound it with "
                             "--max-num-batched-tokens")
        if not 0 <= self.max_logprobs:
            raise ValueError(f"--max-logprobs must be >= 0, got {self.max_logprobs}")
        if self.enable_auto_tool_choice and not self.tool_call_parser:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (qwen3_coder or hermes)")
        max_model_len = _max_model_len(self.max_model_len) if isinstance(self.max_model_len, str) \
            else self.max_model_len
        return EngineConfig(
            model=self.model or "default", load_format=self.load_format, dtype=dtype, device=self.device,
            max_model_len=max_model_len, allow_long_max_model_len=self.allow_long_max_model_len,
            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=None if self.max_num_batched_tokens is None
            else max(human_int(self.max_num_batched_tokens), self.max_num_seqs),
            gpu_memory_utilization=self.gpu_memory_utilization, block_size=self.block_size,
            enforce_eager=self.enforce_eager, async_scheduling=self.async_scheduling, late_binding=self.late_binding,
            coalesce_bursts=self.coalesce_bursts, burst_head_start=self.burst_head_start,
            mixed_batch=self.mixed_batch,
            ssm_bf16_tau=float(self.ssm_bf16_tau),
            ssm_calibration=self.ssm_calibration, seed=self.seed, max_queue_len=self.max_queue_len,
            served_model_name=self.served_model_name[0] if self.served_model_name else None,
            num_kv_blocks=self.num_kv_blocks, tensor_parallel_size=self.tensor_parallel_size,
            enable_expert_parallel=self.enable_expert_parallel,
            enable_prefix_caching=bool(self.enable_prefix_caching), max_logprobs=self.max_logprobs,
            prefix_snapshot_fraction=self.prefix_snapshot_fraction, num_prefix_snapshots=self.num_prefix_snapshots,
            generation_config=self.generation_config,
            override_generation_config=dict(self.override_generation_config or {}),
            chat_template=self.chat_template, reasoning_parser=self.reasoning_parser,
            tool_call_parser=self.tool_call_parser, enable_auto_tool_choice=self.enable_auto_tool_choice,
            structured_outputs_enable_in_reasoning=_structured_outputs_config(self.structured_outputs_config))
