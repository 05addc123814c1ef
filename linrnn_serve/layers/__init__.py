"""One sublayer per module, each owning its weights and choosing its kernels."""
