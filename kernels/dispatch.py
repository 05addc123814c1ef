"""Choose between a Triton kernel and its naive reference."""
from __future__ import annotations

import contextlib
import os
import threading

import torch

_state = threading.local()


def _forced() -> bool:
    return getattr(_state, "force_reference", False) or os.environ.get("LINRNN_REFERENCE_OPS") == "1"


def use_triton(t: torch.Tensor) -> bool:
    """True when `t` lives on a CUDA device and the reference path is not forced.

    Under TRITON_INTERPRET=1 (CPU kernel tests) tests call the Triton launchers directly, or run whole
    models through them inside `triton_on("cpu")`; inside `triton_on("meta")` meta tensors take the
    Triton path (the CPU launch counter intercepts the launches).
    """
    return (t.is_cuda or t.device.type in getattr(_state, "triton_on", ())) and not _forced()


@contextlib.contextmanager
def triton_on(*device_types: str):
    """Route tensors of these non-CUDA device types through the Triton launchers."""
    prev = getattr(_state, "triton_on", ())
    _state.triton_on = tuple(device_types)
    try:
        yield
    finally:
        _state.triton_on = prev


@contextlib.contextmanager
def reference_ops(enabled: bool = True):
    """Run the naive reference ops even on CUDA tensors (for kernel-vs-reference checks)."""
    prev = getattr(_state, "force_reference", False)
    _state.force_reference = enabled
    try:
        yield
    finally:
        _state.force_reference = prev
