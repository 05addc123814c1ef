"""Exact prefix caching for hybrid GDN + attention models: a radix tree over token ids whose nodes
hold the attention layers' paged-KV blocks and, at chosen depths, recurrent-state snapshots.

Plain Python (no tensors): the tree decides which blocks and snapshot slots hold what; the tensors
live in the pools (kv_pool.py, and a second HybridStateCache as the snapshot pool) and the runner
copies state between a sequence's slot and a snapshot slot when the scheduler says so.

Why snapshots: a GDN layer's state after p tokens summarises the whole prefix, and it cannot be
rebuilt from KV. A request can only skip the tokens before a depth q where a snapshot exists; it
restores the state at q, shares the KV blocks of [0, q) and prefills from q. Snapshots are taken
(by the scheduler) at the end of every prompt, when a request finishes (prompt + output fed), and at
divergence points: a request sharing p tokens with a cached path whose deepest snapshot is at q < p
prefills q..p as a chunk that ends exactly at p and snapshots p, so the next request with that
prefix hits at p, whatever p is (no block alignment).

Tree invariants
- A node's `tokens` is its edge label; `depth` = tokens from the root to the node's end.
- `blocks` maps KV block index j -> block id for every j the edge touches
  (parent.depth // block_size <= j < ceil(depth / block_size)); each entry holds one reference in
  the BlockAllocator. Along a root-to-node path the deepest entry for index j holds correct KV for
  the path's tokens [j * bs, min((j + 1) * bs, depth)); positions past that are another path's (or
  garbage) and are never read by a sequence whose context ends before them. A sequence sharing a
  partly valid block writes into it only after copy-on-write (scheduler: refcount > 1).
- `snapshot` is a slot of the snapshot pool holding the state after exactly `depth` tokens;
  `logits` says whether the slot's logits row (the prediction after those tokens) is kept too (it is
  for snapshots taken at the end of a prefill chunk), so a prompt that ends exactly there needs no
  forward at all.
- `lock` counts running sequences that restored from this node (or its descendants): a locked node
  and its snapshot are never evicted.
- Eviction is LRU over unlocked nodes holding a snapshot: a leaf goes with its KV blocks (and any
  ancestors left as snapshot-less leaves, whose KV alone is useless); an inner node loses only its
  snapshot.

A snapshot pool is tied to one f32/bf16 head map (`layout_key`): snapshots live only in memory of
the engine that took them, so one taken under one `--ssm-bf16-tau` is never restored under another;
`PrefixCache.check_layout` makes that explicit.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from linrnn_serve.cache.allocator import BlockAllocator, SlotAllocator


class Node:
    __slots__ = ("parent", "tokens", "depth", "children", "blocks", "snapshot", "logits", "lock", "last_access")

    def __init__(self, parent: "Node | None", tokens: tuple[int, ...], depth: int):
        self.parent, self.tokens, self.depth = parent, tokens, depth
        self.children: dict[int, Node] = {}
        self.blocks: dict[int, int] = {}
        self.snapshot: int | None = None
        self.logits = False  # the snapshot slot also holds the logits of token depth-1
        self.lock = 0
        self.last_access = 0

    def __repr__(self) -> str:
        return f"Node(depth={self.depth}, edge={len(self.tokens)}, snapshot={self.snapshot}, lock={self.lock})"


@dataclass
class PrefixMatch:
    """What a request can reuse: restore `node.snapshot` (state after `cached` tokens) and share
    `blocks` (KV of [0, cached), the last one maybe partly valid); `matched` >= cached tokens are on
    a cached path (a divergence snapshot at `matched` is worth taking when matched > cached)."""

    node: Node | None = None
    cached: int = 0
    matched: int = 0
    blocks: list[int] = field(default_factory=list)


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up (vLLM: prefix_cache_queries)
    hits: int = 0  # of which served from the cache (vLLM: prefix_cache_hits)
    snapshots_taken: int = 0
    snapshots_evicted: int = 0
    nodes_evicted: int = 0
    snapshot_alloc_failures: int = 0


class PrefixCache:
    def __init__(self, blocks: BlockAllocator, snapshots: SlotAllocator, block_size: int, layout_key=None):
        self.blocks, self.snapshots, self.block_size = blocks, snapshots, block_size
        self.layout_key = layout_key
        self.root = Node(None, (), 0)
        self.stats = PrefixCacheStats()
        self._clock = itertools.count(1)

    # ---- lookups ------------------------------------------------------------------------------
    def check_layout(self, layout_key) -> None:
        if layout_key != self.layout_key:
            raise RuntimeError(f"snapshot layout {self.layout_key!r} cannot be restored into a state pool of "
                               f"layout {layout_key!r} (another ssm_bf16_tau / head map)")

    def _walk(self, tokens, limit: int) -> tuple[list[Node], int]:
        """Nodes fully matched (root excluded) and the number of tokens matched (<= limit)."""
        node, i, path = self.root, 0, []
        while i < limit:
            child = node.children.get(tokens[i])
            if child is None:
                break
            m = _common(child.tokens, tokens, i, limit)
            i += m
            if m < len(child.tokens):
                break
            path.append(child)
            node = child
        return path, i

    def match(self, tokens, limit: int | None = None, touch: bool = True) -> PrefixMatch:
        """The deepest snapshot on `tokens[:limit]`'s cached path (LRU-touched root to leaf)."""
        limit = len(tokens) if limit is None else min(limit, len(tokens))
        path, matched = self._walk(tokens, limit)
        out = PrefixMatch(matched=matched)
        k = max((i for i, n in enumerate(path) if n.snapshot is not None), default=-1)
        if k < 0:
            return out
        node = path[k]
        table: dict[int, int] = {}
        for n in path[:k + 1]:
            table.update(n.blocks)
            if touch:
                n.last_access = next(self._clock)
        out.node, out.cached = node, node.depth
        out.blocks = [table[j] for j in range(-(-node.depth // self.block_size))]
        return out

    def has_snapshot(self, tokens) -> bool:
        path, matched = self._walk(tokens, len(tokens))
        return matched == len(tokens) and bool(path) and path[-1].depth == len(tokens) and \
            path[-1].snapshot is not None

    # ---- locks -----------------------------------------------------------------------------------
    def lock(self, node: Node | None) -> None:
        if node is not None:
            node.lock += 1

    def unlock(self, node: Node | None) -> None:
        if node is not None:
            if node.lock <= 0:
                raise RuntimeError(f"prefix-cache node {node} unlocked more often than locked")
            node.lock -= 1

    # ---- inserts -----------------------------------------------------------------------------------
    def insert(self, tokens, blocks: list[int], snapshot: int, logits: bool = False) -> bool:
        """Attach `snapshot` (state after all of `tokens`) to the node at depth len(tokens), creating
        or splitting nodes; KV of the new part comes from `blocks` (a sequence's block table, shared).
        False (nothing changed, the caller frees `snapshot`) if that node already has a snapshot."""
        D = len(tokens)
        if D == 0:
            raise ValueError("cannot snapshot an empty prefix")
        if len(blocks) < -(-D // self.block_size):
            raise ValueError(f"{len(blocks)} blocks cannot hold the KV of {D} tokens")
        node, i = self.root, 0
        while i < D:
            child = node.children.get(tokens[i])
            if child is None:
                break
            m = _common(child.tokens, tokens, i, D)
            if m < len(child.tokens):
                node = self._split(child, m)
                i += m
                break
            node, i = child, i + m
        if i < D:
            bs = self.block_size
            leaf = Node(node, tuple(tokens[i:D]), D)
            for j in range(i // bs, -(-D // bs)):
                self.blocks.share(blocks[j])
                leaf.blocks[j] = blocks[j]
            node.children[tokens[i]] = leaf
            node = leaf
        if node.snapshot is not None:
            node.last_access = next(self._clock)
            return False
        node.snapshot, node.logits = snapshot, logits
        node.last_access = next(self._clock)
        self.stats.snapshots_taken += 1
        return True

    def _split(self, child: Node, m: int) -> Node:
        """Cut `child`'s edge after m tokens; returns the new middle node (depth parent.depth + m)."""
        bs = self.block_size
        parent = child.parent
        mid = Node(parent, child.tokens[:m], parent.depth + m)
        mid.last_access = child.last_access
        d = mid.depth
        for j in range(parent.depth // bs, -(-d // bs)):
            b = child.blocks[j]
            if j >= d // bs:  # straddles the cut: both halves keep it
                self.blocks.share(b)
            else:
                del child.blocks[j]
            mid.blocks[j] = b
        child.tokens = child.tokens[m:]
        child.parent = mid
        mid.children[child.tokens[0]] = child
        parent.children[mid.tokens[0]] = mid
        return mid

    # ---- eviction -----------------------------------------------------------------------------------
    def alloc_snapshot(self) -> int | None:
        """A free snapshot slot, evicting the least recently used unlocked snapshot if needed."""
        s = self.snapshots.alloc()
        if s is None and self._evict_one(leaves_only=False):
            s = self.snapshots.alloc()
        if s is None:
            self.stats.snapshot_alloc_failures += 1
        return s

    def evict_blocks(self, num_free: int) -> bool:
        """Evict LRU unlocked leaves until `num_free` KV blocks are free; False if it cannot."""
        while self.blocks.num_free < num_free:
            if not self._evict_one(leaves_only=True):
                return False
        return True

    def _evict_one(self, leaves_only: bool) -> bool:
        best = None
        for n in self._nodes():
            if n.lock or n.snapshot is None or (leaves_only and n.children):
                continue
            if best is None or n.last_access < best.last_access:
                best = n
        if best is None:
            return False
        self.snapshots.free(best.snapshot)
        best.snapshot, best.logits = None, False
        self.stats.snapshots_evicted += 1
        n = best
        while n is not self.root and not n.children and n.snapshot is None and not n.lock:
            parent = n.parent
            self._remove_leaf(n)
            n = parent
        return True

    def _remove_leaf(self, n: Node) -> None:
        if n.blocks:
            self.blocks.free(list(n.blocks.values()))
            n.blocks = {}
        del n.parent.children[n.tokens[0]]
        self.stats.nodes_evicted += 1

    def clear(self) -> None:
        """Drop every unlocked entry (leaves first, repeatedly)."""
        while self._evict_one(leaves_only=True):
            pass

    # ---- introspection ------------------------------------------------------------------------------
    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    @property
    def num_nodes(self) -> int:
        return sum(1 for _ in self._nodes())

    @property
    def num_snapshots(self) -> int:
        return sum(n.snapshot is not None for n in self._nodes())

    def block_refs(self) -> dict[int, int]:
        """KV block -> references the tree holds."""
        refs: dict[int, int] = {}
        for n in self._nodes():
            for b in n.blocks.values():
                refs[b] = refs.get(b, 0) + 1
        return refs

    def cache_only_blocks(self) -> int:
        """KV blocks no sequence holds (only tree entries): evictable."""
        return sum(self.blocks.refcount(b) == n for b, n in self.block_refs().items())

    def check_idle(self) -> None:
        """With no sequence running: no locks, the block allocator's references are exactly the
        tree's, and the snapshot slots in use are exactly the nodes' snapshots."""
        locked = [n for n in self._nodes() if n.lock]
        if locked:
            raise RuntimeError(f"prefix-cache nodes still locked: {locked[:5]}")
        refs = self.block_refs()
        held = self.blocks.refcounts()
        if refs != held:
            extra = {b: c for b, c in held.items() if refs.get(b) != c}
            raise RuntimeError(f"KV blocks leaked or miscounted (allocator vs prefix tree): "
                               f"{dict(list(extra.items())[:8])} vs {dict(list(refs.items())[:8])}")
        snaps = sorted(n.snapshot for n in self._nodes() if n.snapshot is not None)
        used = sorted(self.snapshots.used_slots())
        if snaps != used:
            raise RuntimeError(f"snapshot slots leaked: allocator {used[:8]} vs tree {snaps[:8]}")
        for n in self._nodes():  # the path's blocks cover every node's KV
            if n.snapshot is not None:
                table: dict[int, int] = {}
                p = n
                while p is not self.root:
                    for j, b in p.blocks.items():
                        table.setdefault(j, b)
                    p = p.parent
                missing = [j for j in range(-(-n.depth // self.block_size)) if j not in table]
                if missing:
                    raise RuntimeError(f"prefix-cache node {n} misses KV blocks {missing[:8]}")


COMMON_CHUNK = 64


def _common(edge: tuple[int, ...], tokens, start: int, limit: int) -> int:
    """Length of the common prefix of `edge` and tokens[start:limit]. Slices compare in C, chunk by chunk,
    then one chunk token by token: a 3k-token edge costs ~20 us, not the ~1 ms of a per-token loop (the
    core looks up every arriving request: a turn of 24 at once on the H200)."""
    n = min(len(edge), limit - start)
    tokens = tuple(tokens[start:start + n])
    k = 0
    while k < n and edge[k:k + COMMON_CHUNK] == tokens[k:k + COMMON_CHUNK]:
        k += COMMON_CHUNK
    if k >= n:
        return n
    for j in range(k, min(k + COMMON_CHUNK, n)):
        if edge[j] != tokens[j]:
            return j
    return min(k + COMMON_CHUNK, n)
