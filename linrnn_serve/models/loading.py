"""Build a model and fill its weights: from a checkpoint directory, or `--load-format dummy`
(random weights of the real shapes and formats, generated on the device, no download)."""
from __future__ import annotations

import logging

import torch

from linrnn_serve.config import ModelConfig
from linrnn_serve.models.registry import build_model

log = logging.getLogger(__name__)

_DTYPES = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32, "f32": torch.float32,
           "float16": torch.float16}


def resolve_device(device: str = "auto") -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda requested but no CUDA GPU is visible")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype = "auto", device: torch.device | str = "cpu") -> torch.dtype:
    """'auto' is bf16 on GPU and f32 on CPU (the CPU reference path is an oracle, kept exact)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"--dtype {dtype!r} is not supported (auto, bfloat16, float32)")
    return _DTYPES[dtype]


def quant_plan(cfg: ModelConfig):
    """The per-module storage formats a quantized checkpoint asks for (None: all dense)."""
    if not cfg.quantization:
        return None
    from linrnn_serve.checkpoint.quant_config import QuantPlan

    return QuantPlan.from_model_config(cfg)


def load_model(cfg: ModelConfig, model_dir: str | None, dtype: torch.dtype, device, load_format: str = "auto",
               progress: bool = True, seed: int = 0, shard=None):
    """The model, or with a parallel.Shard this rank's shard of it (loading only its slice)."""
    device = torch.device(device)
    model = build_model(cfg, dtype, device, quant_plan(cfg), shard=shard)
    if load_format == "dummy":
        from linrnn_serve.checkpoint.loader import load_tensors
        from linrnn_serve.checkpoint.synth import dummy_tensors

        load_tensors(model, dummy_tensors(cfg, device=device, dtype=dtype, seed=seed), "dummy weights",
                     progress=progress)
    elif load_format == "auto":
        if model_dir is None:
            raise ValueError("a checkpoint directory is needed unless --load-format dummy")
        from linrnn_serve.checkpoint.loader import load_checkpoint

        load_checkpoint(model, model_dir, progress=progress)
    else:
        raise ValueError(f"--load-format {load_format!r} is not supported (auto, dummy)")
    model.eval()
    return model
