"""GPU engine tests (run on the device machine: `pytest -m gpu tests/test_engine_gpu.py -x -q`).

CUDA graphs on vs enforce_eager must give byte-identical greedy token streams and bit-identical
logits (both run the same kernels at the same bucket sizes; see runner/cuda_graphs.py). Two engines
with the same weights run the same requests in lockstep and every step's logits rows are compared
bit for bit (bf16 bits, so NaNs would not slip through) for batches of 1, 3, 17 and 64 over 128
decode steps: on the tiny model and on a Qwen3.5-35B-A3B-shaped model with NVFP4 dummy experts,
cut to 4 layers (3 GDN + 1 attention) to fit two engines and keep the test short.
"""
from __future__ import annotations

import json
import os
import random

import pytest
import torch

pytestmark = pytest.mark.gpu

BATCHES = (1, 3, 17, 64)
STEPS = 128


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from engine_fixtures import make_tiny_model_dir

    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny_gpu"))


@pytest.fixture(scope="module")
def a3b_dir(tmp_path_factory):
    """Config-only directory: Qwen3.5-35B-A3B shapes, 4 layers, ModelOpt NVFP4 routed experts."""
    presets = pytest.importorskip("linrnn_serve.presets")
    pytest.importorskip("linrnn_serve.checkpoint.synth")
    hf = presets.PRESETS["qwen35moe-nvfp4"].hf_config()
    text = hf["text_config"]
    text["num_hidden_layers"] = 4
    text["layer_types"] = text["layer_types"][:4]
    d = tmp_path_factory.mktemp("a3b4")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(hf, f)
    return str(d)


def make(model, eager: bool, load_format="auto", **kw):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    kw.setdefault("max_num_seqs", 64)
    kw.setdefault("max_num_batched_tokens", 2048)
    kw.setdefault("max_model_len", 512)
    kw.setdefault("num_kv_blocks", 64 * 12 + 1)
    eng = LLMEngine(EngineConfig(model=model, load_format=load_format, dtype="bfloat16", device="cuda",
                                 enforce_eager=eager, **kw), progress=False)
    return eng


def lockstep(graph_eng, eager_eng, batch: int, sampled: bool = False, seed: int = 0) -> int:
    """Same requests into both engines; compare every step's logits bits and tokens. -> steps compared."""
    from linrnn_serve.sampling_params import SamplingParams

    rng = random.Random(seed + batch)
    V = graph_eng.model_config.vocab_size
    for i in range(batch):
        prompt = [rng.randrange(V) for _ in range(rng.randint(4, 48))]
        kw = dict(temperature=0.0)
        if sampled and i % 2:
            kw = dict(temperature=1.0, top_p=0.9 if i % 4 == 1 else 1.0, top_k=50 if i % 8 == 3 else 0, seed=i)
        p = SamplingParams(max_tokens=STEPS, ignore_eos=True, **kw)
        for eng in (graph_eng, eager_eng):
            eng.add_request(f"b{batch}-{i}", prompt, p)
    steps = 0
    while graph_eng.has_unfinished_requests() or eager_eng.has_unfinished_requests():
        outs_g = {o.request_id: [c.token_ids for c in o.outputs] for o in graph_eng.step()}
        outs_e = {o.request_id: [c.token_ids for c in o.outputs] for o in eager_eng.step()}
        assert outs_g == outs_e, f"token streams differ at step {steps}"
        lg, le = graph_eng.runner.last_logits(), eager_eng.runner.last_logits()
        assert lg.keys() == le.keys()
        for sid in lg:
            a, b = lg[sid], le[sid]
            assert a.dtype == b.dtype == torch.bfloat16
            assert torch.equal(a.view(torch.int16), b.view(torch.int16)), f"logits bits differ at step {steps}"
        steps += 1
        assert steps < 10 * STEPS
    graph_eng.check_integrity()
    eager_eng.check_integrity()
    return steps


@pytest.fixture(scope="module")
def tiny_pair(tiny_dir):
    g, e = make(tiny_dir, eager=False), make(tiny_dir, eager=True)
    assert g.runner.use_graphs, "CUDA graph capture failed (see the log): the comparison would be vacuous"
    assert not e.runner.use_graphs
    return g, e


@pytest.mark.parametrize("batch", BATCHES)
def test_graphs_vs_eager_tiny(tiny_pair, batch):
    assert lockstep(*tiny_pair, batch) >= STEPS


def test_graphs_vs_eager_tiny_sampled(tiny_pair):
    assert lockstep(*tiny_pair, 17, sampled=True) >= STEPS


@pytest.fixture(scope="module")
def a3b_pair(a3b_dir):
    g = make(a3b_dir, eager=False, load_format="dummy")
    e = make(a3b_dir, eager=True, load_format="dummy")
    assert g.runner.use_graphs, "CUDA graph capture failed (see the log): the comparison would be vacuous"
    w_g = dict(g.model.named_parameters())
    for n, p in e.model.named_parameters():  # dummy weights must be the same in both engines
        assert torch.equal(_bits(p), _bits(w_g[n])), n
    return g, e


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("batch", BATCHES)
def test_graphs_vs_eager_a3b_shaped(a3b_pair, batch):
    assert lockstep(*a3b_pair, batch) >= STEPS


def test_decode_step_is_one_sync_and_fast(tiny_pair):
    """Smoke: a 64-row greedy decode step replays graphs and runs well under 50 ms on the tiny model."""
    import time

    from linrnn_serve.sampling_params import SamplingParams

    g, _ = tiny_pair
    for i in range(64):
        g.add_request(f"t{i}", [1 + i, 2, 3], SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    for _ in range(5):
        g.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        g.step()
    dt = (time.perf_counter() - t0) / 20
    while g.has_unfinished_requests():
        g.step()
    g.check_integrity()
    assert dt < 0.05, f"{dt * 1e3:.1f} ms per decode step"
