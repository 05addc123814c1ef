"""Prefix radix tree + snapshot pool (CPU, no model): matches at any depth, KV blocks that hold the
right tokens, reference counts, LRU eviction that spares locked nodes, integrity check, and
bit-exact state save / restore between the state pool and the snapshot pool."""
from __future__ import annotations

import random

import pytest
import torch

from linrnn_serve.cache import BlockAllocator, HybridStateCache, PrefixCache, SlotAllocator

BS = 4


def make(num_blocks=64, num_snaps=9):
    blocks = BlockAllocator(num_blocks)
    return PrefixCache(blocks, SlotAllocator(num_snaps), BS), blocks


class FakeKV:
    """Block contents as token ids per position: what a sequence wrote where."""

    def __init__(self):
        self.data: dict[int, list] = {}

    def write(self, block, off, tok):
        self.data.setdefault(block, [None] * BS)[off] = tok

    def copy(self, src, dst):
        self.data[dst] = list(self.data.get(src, [None] * BS))

    def read(self, table, n):
        return [self.data[table[p // BS]][p % BS] for p in range(n)]


def run_seq(pc: PrefixCache, blocks: BlockAllocator, kv: FakeKV, tokens, snap_at: list[int]):
    """What the scheduler does for one sequence: restore the deepest snapshot, share its blocks,
    copy-on-write the partly shared block, write the rest, snapshot at `snap_at` depths."""
    m = pc.match(tokens, len(tokens) - 1)
    if m.node is not None:
        assert kv.read(m.blocks, m.cached) == list(tokens[:m.cached])
    pc.lock(m.node)
    table = list(m.blocks)
    for b in table:
        blocks.share(b)
    for p in range(m.cached, len(tokens)):
        j = p // BS
        if j == len(table):
            table += blocks.alloc(1)
        elif blocks.refcount(table[j]) > 1:
            nb = blocks.alloc(1)[0]
            kv.copy(table[j], nb)
            blocks.free([table[j]])
            table[j] = nb
        kv.write(table[j], p % BS, tokens[p])
        if p + 1 in snap_at and not pc.has_snapshot(tokens[:p + 1]):
            s = pc.alloc_snapshot()
            if s is not None and not pc.insert(tokens[:p + 1], table, s):
                pc.snapshots.free(s)
    pc.unlock(m.node)
    blocks.free(table)
    return m


def test_match_at_any_depth_and_splits():
    pc, blocks = make()
    kv = FakeKV()
    a = list(range(100, 123))  # 23 tokens
    run_seq(pc, blocks, kv, a, [23])
    assert pc.match(a + [1]).cached == 23
    # a prompt sharing 10 tokens: no snapshot at or below 10 yet, matched tells the divergence point
    b = a[:10] + [7, 8, 9]
    m = pc.match(b, len(b) - 1)
    assert (m.node, m.cached, m.matched) == (None, 0, 10)
    run_seq(pc, blocks, kv, b, [10, 13])  # divergence snapshot at 10 (splits a's edge mid-block)
    for p in (10, 13, 23):
        assert pc.has_snapshot((a if p != 13 else b)[:p])
    c = a[:10] + [5]
    m = pc.match(c, len(c) - 1)
    assert m.cached == 10 and kv.read(m.blocks, 10) == a[:10]
    m = pc.match(a[:17] + [0], 17)
    assert m.cached == 10 and m.matched == 17
    pc.check_idle()
    assert pc.num_snapshots == 3 and pc.num_nodes == 3
    pc.clear()
    blocks.check_all_free()
    assert pc.snapshots.num_used == 0


def test_depth_one_and_block_boundaries():
    pc, blocks = make(num_snaps=3 * BS + 2)
    kv = FakeKV()
    base = list(range(50, 50 + 3 * BS + 1))
    run_seq(pc, blocks, kv, base, list(range(1, len(base) + 1)))
    for p in range(1, len(base) + 1):
        m = pc.match(base[:p] + [999], p)
        assert m.cached == p and kv.read(m.blocks, p) == base[:p]
        assert len(m.blocks) == -(-p // BS)
    pc.check_idle()


def test_lru_eviction_spares_locked_and_frees_blocks():
    pc, blocks = make(num_blocks=40, num_snaps=4)  # 3 snapshot slots
    kv = FakeKV()
    seqs = [[i] * 9 for i in range(1, 4)]
    for s in seqs:
        run_seq(pc, blocks, kv, s, [9])
    assert pc.snapshots.num_free == 0
    held = pc.match(seqs[0] + [0], 9)  # touch seq 0: seq 1 is now the least recent
    pc.lock(held.node)
    run_seq(pc, blocks, kv, [7] * 9, [9])  # needs a slot: evicts seq 1 with its blocks
    assert pc.match(seqs[1] + [0]).cached == 0
    assert pc.match(seqs[0] + [0]).cached == 9 and pc.match([7] * 9 + [0]).cached == 9
    assert not pc.evict_blocks(blocks.capacity)  # the locked one stays
    assert pc.match(seqs[0] + [0]).cached == 9 and pc.num_nodes == 1
    with pytest.raises(RuntimeError, match="locked"):
        pc.check_idle()
    pc.unlock(held.node)
    pc.clear()
    blocks.check_all_free()
    with pytest.raises(RuntimeError):
        pc.unlock(held.node)


def test_inner_snapshot_eviction_keeps_children():
    pc, blocks = make(num_snaps=3)
    kv = FakeKV()
    a = list(range(10, 30))
    run_seq(pc, blocks, kv, a, [6, 20])  # inner node at 6, leaf at 20
    pc.match(a + [0])  # touches 6 then 20: the inner one is older
    run_seq(pc, blocks, kv, [1, 2, 3, 4, 5], [5])  # evicts the inner snapshot only
    m = pc.match(a + [0])
    assert m.cached == 20 and kv.read(m.blocks, 20) == a
    assert pc.match(a[:6] + [0], 6).cached == 0
    pc.check_idle()


def test_random_workload_blocks_hold_the_right_tokens():
    rng = random.Random(0)
    pc, blocks = make(num_blocks=60, num_snaps=12)
    kv = FakeKV()
    convs = [[rng.randrange(3) for _ in range(rng.randrange(1, 12))] for _ in range(4)]
    for it in range(300):
        base = rng.choice(convs)
        t = base[:rng.randrange(0, len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        snaps = rng.sample(range(1, len(t) + 1), min(len(t), rng.randrange(0, 3))) + [len(t)]
        m = pc.match(t, len(t) - 1)
        if m.matched > m.cached:
            snaps.append(m.matched)
        need = -(-len(t) // BS) + 1
        if blocks.num_free < need:
            pc.evict_blocks(need)
        if blocks.num_free < need:
            continue
        run_seq(pc, blocks, kv, t, snaps)  # asserts the restored blocks' tokens
        if rng.random() < 0.3:
            convs[rng.randrange(len(convs))] = t
        pc.check_idle()
    assert pc.stats.snapshots_evicted > 0
    pc.clear()
    blocks.check_all_free()
    assert pc.snapshots.num_used == 0


def tiny_state_cfg():
    from linrnn_serve.config import ModelConfig
    from helpers import TINY

    return ModelConfig.from_dict(dict(TINY, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"]))


def test_snapshot_copy_is_bit_exact_and_layout_checked():
    cfg = tiny_state_cfg()
    hv = cfg.linear_num_value_heads
    heads = [[(h + l) % 2 == 0 for h in range(hv)] for l in range(len(cfg.gdn_layers))]
    state = HybridStateCache(cfg, 5, torch.float32, "cpu", heads)
    snaps = HybridStateCache(cfg, 4, torch.float32, "cpu", heads)
    g = torch.Generator().manual_seed(0)
    for t in state.ssm_f32 + state.ssm_bf16 + [state.conv]:
        t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
    for t in snaps.ssm_f32 + snaps.ssm_bf16 + [snaps.conv]:
        t.fill_(float("nan"))
    state.copy_to(snaps, [3, 1], [1, 2])
    state.copy_to(snaps, [], [])
    for s, d in zip(state.ssm_f32 + state.ssm_bf16, snaps.ssm_f32 + snaps.ssm_bf16):
        assert d.dtype == s.dtype and torch.equal(d[1], s[3]) and torch.equal(d[2], s[1])
    assert torch.equal(snaps.conv[:, 1], state.conv[:, 3])
    before = [t.clone() for t in state.ssm_f32 + state.ssm_bf16]
    snaps.copy_to(state, [1], [4])
    for b, t in zip(before, state.ssm_f32 + state.ssm_bf16):
        assert torch.equal(t[4], b[3]) and torch.equal(t[:4], b[:4])
    other = HybridStateCache(cfg, 4, torch.float32, "cpu", None)  # all f32: another tau
    with pytest.raises(RuntimeError, match="ssm_bf16_tau"):
        snaps.copy_to(other, [1], [1])
    pc = PrefixCache(BlockAllocator(4), SlotAllocator(4), BS, layout_key=snaps.layout_key)
    pc.check_layout(state.layout_key)
    with pytest.raises(RuntimeError, match="ssm_bf16_tau"):
        pc.check_layout(other.layout_key)


def test_common_prefix_length_matches_the_per_token_rule():
    """_common compares slices chunk by chunk: the same answer as a per-token loop at every mismatch
    position (chunk boundaries included), with limits inside the edge and empty ranges."""
    from linrnn_serve.cache.prefix_cache import COMMON_CHUNK, _common

    def naive(edge, tokens, start, limit):
        n = min(len(edge), limit - start)
        return next((k for k in range(n) if edge[k] != tokens[start + k]), n)

    rng = random.Random(11)
    for _ in range(400):
        edge = tuple(rng.randrange(50) for _ in range(rng.choice([1, 5, COMMON_CHUNK, COMMON_CHUNK + 1, 300])))
        start = rng.randrange(0, 40)
        tokens = [rng.randrange(50) for _ in range(start)] + list(edge) + [rng.randrange(50) for _ in range(20)]
        if rng.random() < 0.8:  # one mismatch, often right at a chunk boundary
            at = rng.choice([rng.randrange(len(edge)), min(len(edge) - 1, COMMON_CHUNK * rng.randrange(1, 5))])
            tokens[start + at] = 99
        limit = rng.choice([len(tokens), start + rng.randrange(0, len(edge) + 1)])
        assert _common(edge, tokens, start, limit) == naive(edge, tokens, start, limit)
