"""Device inputs, CUDA-graph capture/replay per batch bucket, and sampling."""
