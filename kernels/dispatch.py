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

    Under TRITON_INTERPRET=1 (CPU kernel tests) tests call the Triton launchers directly.
    """
    return t.is_cuda and not _forced()


@contextlib.contextmanager
def reference_ops(enabled: bool = True):
    """Run the naive reference ops even on CUDA tensors (for kernel-vs-reference checks)."""
    prev = getattr(_state, "force_reference", False)
    _state.force_reference = enabled
    try:
        yield
    finally:
        _state.force_reference = prev
