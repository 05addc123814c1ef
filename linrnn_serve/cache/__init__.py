"""Cache pools (tensors) and their allocators (free lists, CPU-testable), kept apart.

`ModelCaches` hands each layer its view: `gdn_layer(n)` for the n-th GDN layer's recurrent-state
partitions and conv state, `attn_layer(n)` for the n-th full-attention layer's KV pages. With prefix caching, `snapshots` is a
second HybridStateCache holding recurrent-state snapshots, and `snapshot_logits` the logits row of
each snapshot's last token (prefix_cache.py decides which slot holds what).
"""
from linrnn_serve.cache.allocator import BlockAllocator, SlotAllocator
from linrnn_serve.cache.kv_pool import PagedKVCache
from linrnn_serve.cache.prefix_cache import PrefixCache
from linrnn_serve.cache.state_pool import HybridStateCache


class ModelCaches:
    def __init__(self, state: HybridStateCache, kv: PagedKVCache, snapshots: HybridStateCache | None = None,
                 snapshot_logits=None):
        self.state, self.kv = state, kv
        self.snapshots = snapshots  # prefix-cache state snapshots (same layout as `state`), or None
        # [snapshots, vocab]: the logits of each snapshot's last token (prompt ends, divergence points)
        self.snapshot_logits = snapshot_logits

    def gdn_layer(self, n: int):
        return self.state.layer(n)

    def attn_layer(self, n: int):
        return self.kv.layer(n)


__all__ = ["ModelCaches", "HybridStateCache", "PrefixCache", "PagedKVCache", "SlotAllocator", "BlockAllocator"]
