"""Checkpoints: safetensors reading (sharded or not), HF tensor names -> model params, NVFP4/FP8
formats, the synthetic-checkpoint writer and the quantizer."""
from linrnn_serve.checkpoint.errors import CheckpointError

__all__ = ["CheckpointError"]
