"""Paged attention ops for the full-attention layers: KV write, varlen causal attention over pages."""
from linrnn_kernels.attention import naive

write_kv = naive.write_kv
paged_attention = naive.paged_attention
