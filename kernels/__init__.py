"""linrnn-serve kernels (import name `linrnn_kernels`): Triton kernels, thin launchers, and a naive
PyTorch reference (`naive.py`) beside each op. This package never imports `linrnn_serve`.

Each op package exposes dispatching functions: the Triton kernel for CUDA tensors, the naive
reference otherwise (CPU) or inside `reference_ops()`.
"""
from linrnn_kernels.dispatch import reference_ops, use_triton

__all__ = ["reference_ops", "use_triton"]
