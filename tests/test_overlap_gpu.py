"""Overlapped steps on the GPU (`pytest -m gpu tests/test_overlap_gpu.py -x -q` on the device machine).

1. No blocking device sync in a steady-state decode step: with torch.cuda.set_sync_debug_mode("error")
   every synchronizing call (.item(), .tolist() / .cpu() of a device tensor, a copy from pageable memory,
   stream or device synchronize) raises. The window covers greedy and seeded rows, block-table growth
   (a block boundary is crossed) and new sequences' first decode steps (slot parameters uploaded). The
   one wait left is the CUDA event of the previous step's pinned id copy (what the host needs).
2. Overlapped == synchronous greedy and seeded token streams, CUDA graphs on, batches 1 / 3 / 17 / 64,
   on the tiny model and on a 4-layer Qwen3.5-35B-A3B-shaped NVFP4 dummy model.
"""
from __future__ import annotations

import random

import pytest
import torch

from test_engine_gpu import a3b_dir, tiny_dir  # noqa: F401

pytestmark = pytest.mark.gpu


def make(model, async_scheduling: bool, load_format="auto", **kw):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("num_kv_blocks", 64 * 12 + 1)
    return LLMEngine(EngineConfig(model=model, load_format=load_format, dtype="bfloat16", device="cuda",
                                  async_scheduling=async_scheduling, **kw), progress=False)


def requests(V: int, batch: int, seed: int = 0, max_tokens: int = 64):
    from linrnn_serve.sampling_params import SamplingParams

    rng = random.Random(seed + batch)
    out = []
    for i in range(batch):
        prompt = [rng.randrange(V) for _ in range(rng.randint(4, 48))]
        kw = dict(temperature=0.0)
        if i % 2:
            kw = dict(temperature=1.0, top_p=0.9 if i % 4 == 1 else 1.0, top_k=50 if i % 8 == 3 else 0, seed=i)
        out.append((f"b{batch}-{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)))
    return out


def drain(eng, reqs):
    for rid, prompt, p in reqs:
        eng.add_request(rid, prompt, p)
    final = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = [c.token_ids for c in o.outputs]
    return final


@pytest.mark.parametrize("which", ["tiny", "a3b"])
def test_steady_state_decode_step_has_no_blocking_sync(which, tiny_dir, a3b_dir):
    model, fmt = (tiny_dir, "auto") if which == "tiny" else (a3b_dir, "dummy")
    eng = make(model, True, fmt)
    assert eng.async_scheduling and eng.describe()["cuda_graphs"]
    V = eng.model_config.vocab_size
    reqs = requests(V, 12, max_tokens=200)
    for rid, prompt, p in reqs[:8]:
        eng.add_request(rid, prompt, p)
    sch = eng.scheduler
    while sch.waiting or any(not s.decode_ready for s in sch.running):
        eng.step()
    for _ in range(3):
        eng.step()
    # four more requests: their prefill and first decode steps (slot parameters) happen outside the window
    for rid, prompt, p in reqs[8:]:
        eng.add_request(rid, prompt, p)
    while sch.waiting or any(not s.decode_ready for s in sch.running):
        eng.step()
    eng.step()
    torch.cuda.synchronize()
    pos0 = {s.seq_id: s.num_computed for s in sch.running}
    decode_only = 0
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(24):
            eng.step()
            p = eng.last_plan
            assert p.decode and not p.prefill and not p.cached
            decode_only += 1
            assert any(r.token_id == -1 for r in p.decode)  # fed from the device
    finally:
        torch.cuda.set_sync_debug_mode(0)
    # the window crossed a KV block boundary for some sequence (a block-table upload ran inside it)
    bs = eng.config.block_size
    assert any(s.num_computed // bs != pos0[s.seq_id] // bs for s in sch.running)
    assert decode_only == 24
    for rid, _, _ in reqs:
        eng.abort(rid)
    eng.check_integrity()


@pytest.mark.parametrize("which", ["tiny", "a3b"])
def test_overlapped_equals_sync_with_graphs(which, tiny_dir, a3b_dir):
    model, fmt = (tiny_dir, "auto") if which == "tiny" else (a3b_dir, "dummy")
    sync, over = make(model, False, fmt), make(model, True, fmt)
    assert over.async_scheduling and not sync.async_scheduling
    assert sync.describe()["cuda_graphs"] and over.describe()["cuda_graphs"]
    V = sync.model_config.vocab_size
    for batch in (1, 3, 17, 64):
        reqs = requests(V, batch, seed=1, max_tokens=48)
        assert drain(over, reqs) == drain(sync, reqs), f"batch {batch}"
    over.check_integrity()


def test_admission_and_short_prefill_steps_have_no_blocking_sync(tiny_dir):
    """Steps that admit requests (fresh-slot resets, prefix-cache restores and snapshots), prefill short
    prompts (graph-captured), sample first tokens and run penalised rows (device statistics per slot)
    make no blocking sync either: their small uploads go through pinned memory."""
    from linrnn_serve.sampling_params import SamplingParams

    eng = make(tiny_dir, True, enable_prefix_caching=True, num_prefix_snapshots=32)
    V = eng.model_config.vocab_size
    shared = [random.Random(3).randrange(V) for _ in range(40)]

    def batch(tag: str, k: int):
        rng = random.Random(tag)
        out = []
        for i in range(k):
            prompt = (shared if i % 3 == 0 else []) + [rng.randrange(V) for _ in range(rng.randint(4, 40))]
            kw = dict(temperature=0.0) if i % 2 else dict(temperature=1.0, seed=i)
            if i % 4 < 2:
                kw.update(presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2)
            out.append((f"{tag}-{i}", prompt, SamplingParams(max_tokens=16 if tag != "long" else 400,
                                                            ignore_eos=True, **kw)))
        return out

    drain(eng, batch("warm", 8))  # pinned host blocks, penalty state, prefix snapshots exist now
    for rid, prompt, p in batch("long", 4):
        eng.add_request(rid, prompt, p)
    for _ in range(6):
        eng.step()
    torch.cuda.synchronize()
    kinds = {"prefill": 0, "reset": 0, "restore": 0, "penalised": 0}
    torch.cuda.set_sync_debug_mode("error")
    try:
        for k in range(3):
            for rid, prompt, p in batch(f"new{k}", 6):
                eng.add_request(rid, prompt, p)
            for _ in range(8):
                eng.step()
                pl = eng.last_plan
                kinds["prefill"] += bool(pl.prefill)
                kinds["reset"] += bool(pl.reset_slots)
                kinds["restore"] += bool(pl.snapshot_restores)
                kinds["penalised"] += any(r.sampling.presence_penalty for r in pl.decode)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert all(kinds.values()), kinds
    for rid in list(eng.scheduler.requests):
        eng.abort(rid)
    eng.drain()
    eng.check_integrity()
