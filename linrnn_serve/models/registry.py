"""Architecture name -> model class. Both families share one implementation (SPEC §1)."""
from __future__ import annotations

import torch

from linrnn_serve.config import ModelConfig


def model_class(cfg: ModelConfig):
    from linrnn_serve.models.qwen3_5_moe import HybridMoEForCausalLM

    return HybridMoEForCausalLM


def build_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str = "cpu", quant=None, shard=None):
    """Construct the model (this rank's shard of it, given a parallel.Shard) with uninitialised
    weights directly on `device` (no init compute)."""
    with torch.device(device):
        if shard is None:
            return model_class(cfg)(cfg, dtype, quant=quant)
        return model_class(cfg)(cfg, dtype, quant=quant, shard=shard)
