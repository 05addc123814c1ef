"""Gated-DeltaNet ops: decode (one token per sequence), varlen chunked prefill, causal conv1d.

The Triton kernels replace the naive reference on CUDA tensors (see linrnn_kernels.dispatch).
"""
from linrnn_kernels.gdn import naive
from linrnn_kernels.gdn.naive import gdn_gates, l2norm  # noqa: F401  (shared helpers)

gdn_decode = naive.gdn_decode
gdn_prefill = naive.gdn_prefill
conv1d_decode = naive.conv1d_decode
conv1d_varlen = naive.conv1d_varlen
