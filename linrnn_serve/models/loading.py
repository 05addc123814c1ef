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


class InsufficientMemoryError(RuntimeError):
    """The model's weights cannot fit the device: refused before building it."""


GiB = 1 << 30
CPU_RUNTIME_BYTES = 512 << 20  # caches (budget.CPU_KV_BYTES), activations, allocator slack on the CPU


def weight_bytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """Exact bytes of the model's parameters and buffers, from a build on the meta device (no memory)."""
    with torch.device("meta"):
        model = build_model(cfg, dtype, torch.device("meta"), quant_plan(cfg))
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def cpu_available_bytes() -> int | None:
    """Memory a new allocation can get: MemAvailable, bounded by a cgroup v2 limit; None if unknown."""
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        return None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                left = int(limit) - int(f.read())
            avail = left if avail is None else min(avail, left)
    except (OSError, ValueError):
        pass
    return avail


def check_weights_fit(cfg: ModelConfig, dtype: torch.dtype, device: torch.device, name: str = "the model",
                      gpu_memory_utilization: float = 0.9, shards: int = 1) -> int:
    """Refuse (InsufficientMemoryError) a model whose weights cannot fit before spending minutes building
    it: on the CPU, weights + CPU_RUNTIME_BYTES against available RAM (every rank of a sharded model is
    on this machine); on a GPU, a 1/`shards` share of the weights (tensor parallel; replicated parts
    make the real share a little larger) against total * gpu_memory_utilization minus what is already
    in use. Returns the weight bytes."""
    need = weight_bytes(cfg, dtype)
    dt = str(dtype).replace("torch.", "")
    if device.type == "cuda":
        need = -(-need // max(shards, 1))
        free, total = torch.cuda.mem_get_info(device)
        usable = int(total * gpu_memory_utilization) - (total - free)
        if need > usable:
            raise InsufficientMemoryError(
                f"{name} needs {need / GiB:.1f} GiB for its weights ({dt}{f', 1/{shards} per GPU' if shards > 1 else ''}) but the GPU has {max(usable, 0) / GiB:.1f} "
                f"GiB usable ({total / GiB:.1f} GiB x gpu_memory_utilization {gpu_memory_utilization}, "
                f"{(total - free) / GiB:.1f} GiB already in use); use a smaller or quantized model or a larger GPU")
    elif device.type == "cpu":
        avail = cpu_available_bytes()
        if avail is not None and need + CPU_RUNTIME_BYTES > avail:
            raise InsufficientMemoryError(
                f"{name} needs {need / GiB:.1f} GiB for its weights ({dt} on the CPU) + "
                f"{CPU_RUNTIME_BYTES / GiB:.1f} GiB to run, but the machine has {avail / GiB:.1f} GiB available; "
                f"use a GPU (--device cuda) or a smaller model")
    return need


def quant_plan(cfg: ModelConfig):
    """The per-module storage formats a quantized checkpoint asks for (None: all dense)."""
    if not cfg.quantization:
        return None
    from linrnn_serve.checkpoint.quant_config import QuantPlan

    return QuantPlan.from_model_config(cfg)


def load_model(cfg: ModelConfig, model_dir: str | None, dtype: torch.dtype, device, load_format: str = "auto",
               progress: bool = True, seed: int = 0, shard=None, tick=None):
    """The model, or with a parallel.Shard this rank's shard of it (loading only its slice).
    `tick(what)`: a progress mark every few tensors (tensor-parallel ranks' hang watch)."""
    device = torch.device(device)
    model = build_model(cfg, dtype, device, quant_plan(cfg), shard=shard)
    if load_format == "dummy":
        from linrnn_serve.checkpoint.loader import load_tensors
        from linrnn_serve.checkpoint.synth import dummy_tensors

        load_tensors(model, dummy_tensors(cfg, device=device, dtype=dtype, seed=seed), "dummy weights",
                     progress=progress, tick=tick)
    elif load_format == "auto":
        if model_dir is None:
            raise ValueError("a checkpoint directory is needed unless --load-format dummy")
        from linrnn_serve.checkpoint.loader import load_checkpoint

        load_checkpoint(model, model_dir, progress=progress, tick=tick)
    else:
        raise ValueError(f"--load-format {load_format!r} is not supported (auto, dummy)")
    model.eval()
    return model
