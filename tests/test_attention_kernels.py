"""Triton paged attention kernels (kernels/attention/) against the naive reference.

CPU: TRITON_INTERPRET=1 on reduced shapes (D=32, Hq=4, Hkv=2); on a CUDA machine the same tests run
the compiled kernels (KERNEL_DEVICE). GPU (`-m gpu`): Qwen3.5-35B-A3B
shapes (Hq=16, Hkv=2, D=256, block_size 16), plus a CUDA-graph replay test of the decode kernel.
Caches and outputs are NaN-poisoned: unused blocks, slots past each sequence's end and the
dummy block's unwritten slots must never be read, and every output element must be written.
"""
from __future__ import annotations

import pytest
import torch

from helpers import KERNEL_DEVICE
from linrnn_kernels.attention import kv_write, naive
from linrnn_kernels.attention.common import LaunchConfig
from linrnn_kernels.attention.decode import MAX_SPLITS, decode_attention, decode_num_splits
from linrnn_kernels.attention.paged import paged_attention
from linrnn_kernels.attention.prefill import prefill_attention

TOL = {torch.float32: 1e-5, torch.float16: 3e-3, torch.bfloat16: 1e-2}
SMALL = dict(hq=4, hkv=2, d=32, bs=16)
FULL = dict(hq=16, hkv=2, d=256, bs=16)  # Qwen3.5-35B-A3B attention layer


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "output has NaN (unwritten element or poisoned cache read)"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


def make_batch(seqs, hq, hkv, d, bs, dtype, device=KERNEL_DEVICE, pad_rows=0, spare_blocks=3, table_width=None):
    """Paged batch for sequences given as (q_len, prior_len): prior_len context tokens already in
    the pages from earlier steps, q_len new tokens now. Pages are shuffled; everything not written
    (spare blocks, slots past each end, the dummy block 0 except slot 0) is NaN. Padded rows (at the
    end, as CUDA-graph buckets pad) have seq_len 1, a zero block table and slot 0.
    Returns dict with q, k_new, v_new, k_cache, v_cache (prior context written, new tokens not yet),
    slot_mapping, cu_seqlens, seq_lens, block_tables."""
    seqs = list(seqs) + [(1, 0)] * pad_rows
    n_real = len(seqs) - pad_rows
    blocks_per_seq = [-(-(q + p) // bs) for q, p in seqs[:n_real]]
    num_blocks = 1 + sum(blocks_per_seq) + spare_blocks
    perm = (torch.randperm(num_blocks - 1) + 1).tolist()
    width = table_width or max(blocks_per_seq + [1])
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype, device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    tables, slots, cu, lens = [], [], [0], []
    for i, (q_len, prior) in enumerate(seqs):
        if i < n_real:
            table = [perm.pop() for _ in range(blocks_per_seq[i])]
        else:
            table = []
        pos = range(prior, prior + q_len)
        slots += [table[p // bs] * bs + p % bs for p in pos] if table else [0] * q_len
        if prior:
            prior_slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(prior)], device=device)
            naive.write_kv(torch.randn(prior, hkv, d, device=device), torch.randn(prior, hkv, d, device=device),
                           k_cache, v_cache, prior_slots)
        tables.append(table + [0] * (width - len(table)))
        cu.append(cu[-1] + q_len)
        lens.append(prior + q_len)
    T = cu[-1]
    i32 = dict(dtype=torch.int32, device=device)
    return dict(
        q=torch.randn(T, hq, d, device=device).to(dtype),
        k_new=torch.randn(T, hkv, d, device=device).to(dtype),
        v_new=torch.randn(T, hkv, d, device=device).to(dtype),
        k_cache=k_cache, v_cache=v_cache,
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        cu_seqlens=torch.tensor(cu, **i32), seq_lens=torch.tensor(lens, **i32),
        block_tables=torch.tensor(tables, **i32),
    )


def attn_args(b, k_cache=None, v_cache=None):
    return (b["q"], b["k_cache"] if k_cache is None else k_cache, b["v_cache"] if v_cache is None else v_cache,
            b["cu_seqlens"], b["seq_lens"], b["block_tables"], b["q"].shape[-1] ** -0.5)


def assert_cache_written(cache, ref, slot_mapping, new):
    """cache == ref exactly outside the dummy block 0. Padded rows all write slot 0 at once, so what lands
    there is unspecified on a GPU, even element by element (the interpreter runs programs in order and
    matches the naive reference's last write): each element of a written dummy slot must come from one of
    the rows sent there (never NaN), the dummy's other slots stay as they were."""
    torch.testing.assert_close(cache[1:], ref[1:], rtol=0, atol=0, equal_nan=True)
    bs = cache.shape[1]
    dummy_rows = (slot_mapping >= 0) & (slot_mapping < bs)
    written = torch.zeros(bs, dtype=torch.bool, device=cache.device)
    written[slot_mapping[dummy_rows]] = True
    torch.testing.assert_close(cache[0, ~written], ref[0, ~written], rtol=0, atol=0, equal_nan=True)
    for s in written.nonzero().flatten().tolist():
        got = cache[0, s]
        assert not torch.isnan(got).any(), f"dummy slot {s} was written but holds NaN"
        sent = new[slot_mapping == s].to(cache.dtype)
        assert (sent == got).any(0).all(), f"dummy slot {s} holds values that no row wrote to it"


def write_new_tokens(b):
    """Triton write_kv of the new tokens into the batch's caches; checks it against naive.write_kv."""
    k_ref, v_ref = b["k_cache"].clone(), b["v_cache"].clone()
    naive.write_kv(b["k_new"], b["v_new"], k_ref, v_ref, b["slot_mapping"])
    kv_write.write_kv(b["k_new"], b["v_new"], b["k_cache"], b["v_cache"], b["slot_mapping"])
    assert_cache_written(b["k_cache"], k_ref, b["slot_mapping"], b["k_new"])
    assert_cache_written(b["v_cache"], v_ref, b["slot_mapping"], b["v_new"])


def nan_out(b):
    return torch.full_like(b["q"], float("nan"))


def check_prefill(b, dtype, config=None):
    write_new_tokens(b)
    ref = naive.paged_attention(*attn_args(b))
    assert b["q"].shape[0] != b["seq_lens"].shape[0]  # so the public entry must pick the prefill kernel
    out = paged_attention(*attn_args(b), prefill_config=config, out=nan_out(b))
    assert rel_err(out, ref) <= TOL[dtype]
    return out, ref


def check_decode(b, dtype, num_splits=None, config=None):
    write_new_tokens(b)
    ref = naive.paged_attention(*attn_args(b))
    # through the public Triton entry: T == B must pick the decode kernel
    out = paged_attention(*attn_args(b), decode_config=config, num_splits=num_splits, out=nan_out(b))
    assert rel_err(out, ref) <= TOL[dtype]
    return out, ref


# A mixed varlen batch: fresh prompts, chunked-prefill continuations over several pages, a
# decode-like row, lengths off block boundaries, an empty sequence, and padded rows at the end.
MIXED = [(37, 0), (5, 50), (1, 100), (64, 19), (0, 20), (17, 33), (16, 16)]
SMALL_PREFILL = LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)  # many tiles per sequence
SMALL_DECODE = LaunchConfig(block_n=16, num_warps=4, num_stages=1)


# ---------------------------------------------------------------- reduced shapes (interpreter on CPU)

@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                               (torch.float32, torch.bfloat16)])
def test_write_kv_strided_inputs(dtype, cache_dtype):
    hkv, d, bs, T = 2, 32, 16, 23
    k_cache = torch.full((6, bs, hkv, d), float("nan"), dtype=cache_dtype, device=KERNEL_DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    # v is a strided slice of a fused projection, as in the layer
    kv = torch.randn(T, 3 * hkv * d, device=KERNEL_DEVICE).to(dtype)
    k, v = kv[:, : hkv * d].view(T, hkv, d), kv[:, 2 * hkv * d:].view(T, hkv, d)
    slots = torch.randperm(6 * bs, device=KERNEL_DEVICE)[:T]
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    naive.write_kv(k, v, k_ref, v_ref, slots)
    kv_write.write_kv(k, v, k_cache, v_cache, slots)
    # same dtype: a pure copy; f32 -> bf16: one rounding (the interpreter truncates, GPUs round to nearest)
    rtol = 0 if dtype == cache_dtype else 2 ** -7
    torch.testing.assert_close(k_cache, k_ref, rtol=rtol, atol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, rtol=rtol, atol=0, equal_nan=True)


def test_write_kv_skips_negative_slots():
    k_cache = torch.full((2, 16, 2, 32), float("nan"), device=KERNEL_DEVICE)
    v_cache = torch.full_like(k_cache, float("nan"))
    k, v = torch.randn(2, 2, 32, device=KERNEL_DEVICE), torch.randn(2, 2, 32, device=KERNEL_DEVICE)
    kv_write.write_kv(k, v, k_cache, v_cache, torch.tensor([-1, 17], device=KERNEL_DEVICE))
    assert torch.equal(k_cache[1, 1], k[1]) and torch.equal(v_cache[1, 1], v[1])  # slot 17 = block 1, offset 1
    written = torch.zeros(2, 16, dtype=torch.bool, device=KERNEL_DEVICE)
    written[1, 1] = True
    assert torch.isnan(k_cache[~written]).all() and torch.isnan(v_cache[~written]).all()  # slot -1 skipped


@pytest.mark.parametrize("dtype,config", [(torch.float32, None), (torch.bfloat16, None), (torch.float16, None),
                                          (torch.float32, SMALL_PREFILL)],
                         ids=["f32-default", "bf16-default", "f16-default", "f32-small_tiles"])
def test_prefill_mixed_batch(dtype, config):
    b = make_batch(MIXED, **SMALL, dtype=dtype, pad_rows=2)
    check_prefill(b, dtype, config)


@pytest.mark.parametrize("hq,hkv", [(8, 1), (6, 2), (2, 2)])
def test_prefill_gqa_ratios(hq, hkv):
    b = make_batch([(20, 0), (9, 40), (1, 7)], hq=hq, hkv=hkv, d=32, bs=16, dtype=torch.float32)
    check_prefill(b, torch.float32, SMALL_PREFILL)


def test_prefill_long_chunk_over_many_pages():
    # a chunk continuing a 300-token context that spans 19 pages, tiles smaller than the chunk
    b = make_batch([(45, 300), (3, 0)], **SMALL, dtype=torch.float32, spare_blocks=5)
    check_prefill(b, torch.float32, SMALL_PREFILL)


def gate_view(b):
    """A fresh random output gate as the layer passes it: the strided second half of a [T, Hq, 2D] projection."""
    T, hq, d = b["q"].shape
    qg = torch.randn(T, hq, 2 * d, device=b["q"].device).to(b["q"].dtype)
    return qg[..., d:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("decode", [False, True])
def test_output_gate(dtype, decode):
    """o * sigmoid(gate) from the prefill kernel's epilogue (and the decode path's torch fallback) vs the naive
    reference with the gate, into a NaN-poisoned output; a gate of the wrong shape is refused."""
    seqs = [(1, c) for c in (0, 15, 90)] if decode else MIXED
    b = make_batch(seqs, **SMALL, dtype=dtype, pad_rows=0 if decode else 2)
    write_new_tokens(b)
    gate = gate_view(b)
    ref = naive.paged_attention(*attn_args(b), gate=gate)
    out = paged_attention(*attn_args(b), out=nan_out(b), gate=gate, prefill_config=SMALL_PREFILL if dtype ==
                          torch.float32 else None)
    assert rel_err(out, ref) <= TOL[dtype]
    assert rel_err(out, naive.paged_attention(*attn_args(b))) > 0.1  # the gate did change the output
    with pytest.raises(ValueError, match="gate must be"):
        paged_attention(*attn_args(b), gate=gate[:, :, :-1])


@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_decode(batch):
    # contexts 1..2000; batch 64 is kept shorter so the interpreter stays fast
    ctx = torch.randint(1, 2000 if batch < 64 else 400, (batch,)).tolist()
    if batch == 1:
        ctx = [1999]
    pad = 3 if batch >= 17 else 0
    seqs = [(1, c - 1) for c in ctx[: batch - pad]]
    b = make_batch(seqs, **SMALL, dtype=torch.float32, pad_rows=pad, table_width=2000 // 16 + 1)
    check_decode(b, torch.float32)


@pytest.mark.parametrize("dtype,num_splits", [(torch.float32, 1), (torch.float32, 4), (torch.float32, 16),
                                              (torch.bfloat16, 4)])
def test_decode_split_counts(dtype, num_splits):
    # lengths 1, short, off-boundary and multi-tile; more splits than tiles for the short ones
    b = make_batch([(1, 0), (1, 16), (1, 200), (1, 517)], **SMALL, dtype=dtype, pad_rows=1)
    check_decode(b, dtype, num_splits=num_splits, config=SMALL_DECODE)


def test_decode_and_prefill_kernels_agree():
    b = make_batch([(1, c) for c in (0, 15, 16, 90, 300)], **SMALL, dtype=torch.float32)
    out, _ = check_decode(b, torch.float32, num_splits=4)
    out_prefill = prefill_attention(*attn_args(b), out=nan_out(b))
    assert rel_err(out_prefill, out) <= 1e-5


def test_num_splits_depends_on_shapes_only():
    for batch in (1, 8, 32, 64, 128, 512):
        s = decode_num_splits(batch, 2, max_blocks=8192 // 16, block_size=16, block_n=64, sms=132)
        assert s & (s - 1) == 0 and 1 <= s <= MAX_SPLITS
        assert batch * 2 * s >= 2 * 132 or s == MAX_SPLITS
    assert decode_num_splits(1, 2, max_blocks=4, block_size=16, block_n=64, sms=132) == 1
    assert decode_num_splits(512, 2, max_blocks=4096, block_size=16, block_n=64, sms=132) == 1


def test_bad_inputs_are_named():
    b = make_batch([(3, 0)], **SMALL, dtype=torch.float32)
    q, kc, vc, cu, lens, bt, scale = attn_args(b)
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        prefill_attention(q[:, :3], kc, vc, cu, lens, bt, scale)
    with pytest.raises(ValueError, match="cu_seqlens"):
        prefill_attention(q, kc, vc, cu[:1], lens, bt, scale)
    with pytest.raises(ValueError, match="head_dim"):
        prefill_attention(q[..., :16], kc, vc, cu, lens, bt, scale)
    with pytest.raises(ValueError, match="block_tables"):
        prefill_attention(q, kc, vc, cu, lens, bt[0], scale)
    with pytest.raises(ValueError, match="num_splits"):
        decode_attention(q[:1], kc, vc, lens, bt, scale, num_splits=3)
    with pytest.raises(ValueError, match="k and v"):
        kv_write.write_kv(b["k_new"][:, :1], b["v_new"], kc, vc, b["slot_mapping"])


# ---------------------------------------------------------------- GPU, 35B-A3B shapes

GPU_MIXED = [(1000, 0), (300, 1200), (1, 2000), (77, 45), (513, 0), (16, 16)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_prefill_mixed_batch(dtype):
    b = make_batch(GPU_MIXED, **FULL, dtype=dtype, device="cuda", pad_rows=3)
    check_prefill(b, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3, 17, 64])
def test_gpu_decode(batch, dtype):
    ctx = torch.randint(1, 2048, (batch,)).tolist()
    if batch == 1:
        ctx = [2047]
    pad = 3 if batch >= 17 else 0
    b = make_batch([(1, c - 1) for c in ctx[: batch - pad]], **FULL, dtype=dtype, device="cuda",
                   pad_rows=pad, table_width=2048 // 16)
    check_decode(b, dtype)


@pytest.mark.gpu
def test_gpu_dispatch_uses_triton_and_matches_reference():
    import linrnn_kernels.attention as attn_ops
    from linrnn_kernels import reference_ops

    for seqs in (GPU_MIXED, [(1, c) for c in (5, 700, 1500)]):
        b = make_batch(seqs, **FULL, dtype=torch.bfloat16, device="cuda")
        k_ref, v_ref = b["k_cache"].clone(), b["v_cache"].clone()
        with reference_ops():
            attn_ops.write_kv(b["k_new"], b["v_new"], k_ref, v_ref, b["slot_mapping"])
            ref = attn_ops.paged_attention(*attn_args(b, k_ref, v_ref))
        attn_ops.write_kv(b["k_new"], b["v_new"], b["k_cache"], b["v_cache"], b["slot_mapping"])
        torch.testing.assert_close(b["k_cache"], k_ref, rtol=0, atol=0, equal_nan=True)
        out = attn_ops.paged_attention(*attn_args(b))
        assert rel_err(out, ref) <= TOL[torch.bfloat16]


@pytest.mark.gpu
def test_gpu_decode_cuda_graph_replays_with_new_seq_lens():
    batch, width = 24, 4096 // 16
    ctx = torch.randint(1, 4096, (batch,)).tolist()
    b = make_batch([(1, c - 1) for c in ctx], **FULL, dtype=torch.bfloat16, device="cuda", table_width=width)
    write_new_tokens(b)
    args = list(attn_args(b))
    seq_lens = b["seq_lens"]
    # capture with short contexts (only a few splits busy) ...
    seq_lens.copy_(torch.minimum(seq_lens, torch.full_like(seq_lens, 40)))
    torch.cuda.set_sync_debug_mode("error")  # the launch path must not sync the host
    try:
        paged_attention(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_graph = paged_attention(*args)
    # ... replay with the full and with other lengths (all within each sequence's written pages)
    full = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    for lens in (full, torch.clamp(full // 3, min=1), full):
        seq_lens.copy_(lens)
        args[0].normal_()
        graph.replay()
        eager = paged_attention(*args)
        assert torch.equal(out_graph, eager), "graph replay differs from an eager run on the same inputs"
        ref = naive.paged_attention(*args)
        assert rel_err(out_graph, ref) <= TOL[torch.bfloat16]
