"""Start-up warm-up (engine/warmup.py): it runs every prefill/decode/prefix-cache path, then leaves
nothing behind: counters at zero, the prefix cache empty, every slot and block free, and later
requests (greedy and seeded) produce exactly what they produce on an engine that never warmed up."""
from __future__ import annotations

import pytest
import torch

from engine_fixtures import make_tiny_model_dir
from linrnn_serve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


def engine(model_dir, monkeypatch, warm: bool, caching: bool):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    monkeypatch.setenv("LINRNN_WARMUP", "1" if warm else "0")
    return LLMEngine(EngineConfig(model=model_dir, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
                                  block_size=16, enable_prefix_caching=caching, seed=5), progress=False)


def generate(eng):
    outs = {}
    prompts = [[(11 * i + 3) % 300 for i in range(40)], [(5 * i + 1) % 300 for i in range(23)]]
    eng.add_request("g", prompts[0], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    eng.add_request("s", prompts[1], SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True))  # engine seed
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o.outputs[0].token_ids
    return outs


@pytest.mark.parametrize("caching", [True, False])
def test_warmup_leaves_nothing_behind(model_dir, monkeypatch, caching):
    torch.set_num_threads(1)
    warm = engine(model_dir, monkeypatch, True, caching)
    assert warm.num_steps == 0
    st = warm.stats()
    assert st["prompt_tokens_total"] == st["generation_tokens_total"] == st["prefill_tokens_total"] == 0
    assert st["prefix_cache_queries_total"] == st["prefix_cache_snapshots"] == st["prefix_cache_blocks"] == 0
    assert warm.metrics.ttft.count == 0
    warm.check_integrity()
    if caching:
        assert warm.prefix_cache.num_nodes == 0
    cold = engine(model_dir, monkeypatch, False, caching)
    assert generate(warm) == generate(cold)


def test_warmup_takes_every_prefix_path(model_dir, monkeypatch):
    """The warm-up's own requests hit: a restore, a copy-on-write divergence and a full hit; it runs a step of
    many prompts at the full token budget, one of as many restored rows, and one that fills the budget (64) beside a decode row (the eager
    path past the prefill graphs)."""
    from linrnn_serve.engine import warmup

    monkeypatch.setenv("LINRNN_WARMUP", "0")
    eng = engine(model_dir, monkeypatch, False, True)
    seen = {"restore": 0, "cow": 0, "cached": 0, "full budget, 4 prompts": 0, "full budget beside a decode": 0,
            "4 restored rows": 0}
    sched = eng.scheduler.schedule

    def spy(*a, **k):
        plan = sched(*a, **k)
        seen["restore"] += len(plan.snapshot_restores)
        seen["cow"] += len(plan.block_copies)
        seen["cached"] += len(plan.cached)
        # the many-prompt step at the full token budget (min(16, max_num_seqs) prompts)
        seen["full budget, 4 prompts"] += len(plan.prefill) == 4 and sum(len(r.token_ids) for r in plan.prefill) == 64
        seen["full budget beside a decode"] += bool(plan.decode) and plan.num_tokens == 64
        # the many-row step of restored rows (a multi-turn burst): each continues a snapshot with its own tokens
        seen["4 restored rows"] += len(plan.snapshot_restores) == 4 and len(plan.prefill) == 4
        return plan

    eng.scheduler.schedule = spy
    warmup.warm_up(eng)
    assert all(v > 0 for v in seen.values()), seen
    eng.check_integrity()
