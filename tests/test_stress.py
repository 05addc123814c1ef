"""Stress (CPU, tiny model): 200 requests with random lengths, arrival times, sampling parameters and
aborts, under a KV cache small enough to force preemption. Every request must end cleanly (finished
or aborted, outputs within their limits) and every state slot and KV block must come back."""
from __future__ import annotations

import random

import pytest
import torch

from engine_fixtures import make_tiny_model_dir
from linrnn_serve.sampling_params import SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def random_params(rng: random.Random) -> SamplingParams:
    kw = dict(max_tokens=rng.randint(1, 8), n=rng.choice([1, 1, 1, 2, 3]))
    if rng.random() < 0.5:
        kw.update(temperature=rng.choice([0.3, 1.0, 1.5]), top_k=rng.choice([0, 3, 50]),
                  top_p=rng.choice([1.0, 0.8]), min_p=rng.choice([0.0, 0.1]))
        if rng.random() < 0.5:
            kw["seed"] = rng.randrange(1 << 30)
    else:
        kw["temperature"] = 0.0
    if rng.random() < 0.2:
        kw.update(presence_penalty=rng.uniform(-1, 1), frequency_penalty=rng.uniform(-1, 1),
                  repetition_penalty=rng.uniform(0.8, 1.5))
    if rng.random() < 0.2:
        kw["stop"] = [rng.choice(["a", "e", "th", "\ufffd", "o w"])]
    if rng.random() < 0.2:
        kw["stop_token_ids"] = [rng.randrange(320) for _ in range(3)]
    if rng.random() < 0.2:
        kw["min_tokens"] = rng.randint(0, kw["max_tokens"])
    if rng.random() < 0.3:
        kw["ignore_eos"] = True
    if rng.random() < 0.15:
        kw["logprobs"] = rng.randint(0, 5)
    if rng.random() < 0.1:
        kw["prompt_logprobs"] = rng.randint(0, 3)
    return SamplingParams(**kw)


def test_stress_random_requests_and_aborts(tmp_path):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model=make_tiny_model_dir(tmp_path / "m"), max_num_seqs=16,
                                 max_num_batched_tokens=48, max_model_len=96, block_size=4, num_kv_blocks=40,
                                 max_queue_len=1000), progress=False)
    rng = random.Random(1234)
    n_req = 200
    arrivals: dict[int, list] = {}
    for i in range(n_req):
        plen = rng.choice([1, 2, 3, 5, 8, 13, 21, 40, 60])
        prompt = [rng.randrange(320) for _ in range(plen)] if rng.random() < 0.7 else \
            rng.choice(["hello world", "café", "你好，世界", "The capital of"])
        arrivals.setdefault(rng.randrange(120), []).append((f"q{i}", prompt, random_params(rng)))
    aborts: dict[int, list[str]] = {}
    for i in rng.sample(range(n_req), 40):
        aborts.setdefault(rng.randrange(160), []).append(f"q{i}")

    final, params = {}, {}
    step = 0
    while eng.has_unfinished_requests() or arrivals or any(k >= step for k in aborts):
        for rid, prompt, p in arrivals.pop(step, []):
            eng.add_request(rid, prompt, p)
            params[rid] = p
        for rid in aborts.get(step, []):
            out = eng.abort(rid)
            if out is not None:
                final[rid] = out
        for out in eng.step():
            if out.finished:
                assert out.request_id not in final
                final[out.request_id] = out
        step += 1
        assert step < 20_000

    eng.check_integrity()
    assert set(final) == set(params)
    stats = eng.stats()
    assert stats["num_preemptions_total"] > 0
    n_abort = 0
    for rid, out in final.items():
        p = params[rid]
        assert out.finished and len(out.outputs) == p.n
        for c in out.outputs:
            assert c.finish_reason in ("stop", "length", "abort")
            n_abort += c.finish_reason == "abort"
            assert len(c.token_ids) <= p.max_tokens
            assert all(0 <= t < 320 for t in c.token_ids)
            if c.finish_reason == "length":
                assert len(c.token_ids) == p.max_tokens or len(out.prompt_token_ids) + len(c.token_ids) == 96
            if c.finish_reason == "stop" and isinstance(c.stop_reason, str):
                assert c.stop_reason in p.stop
            if p.logprobs is not None and c.finish_reason != "abort":
                assert len(c.logprobs) == len(c.token_ids)
                assert all(t in d for t, d in zip(c.token_ids, c.logprobs))
    assert n_abort > 0
