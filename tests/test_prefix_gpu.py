"""Prefix caching on the GPU (device machine: `pytest -m gpu tests/test_prefix_gpu.py -x -q`):
lossless snapshot restore on a Qwen3.5-35B-A3B-shaped dummy (bf16, NVFP4 dummy experts, cut to 4
layers: 3 GDN + 1 attention), CUDA graphs on, all-f32 state and the hybrid state at tau = 16: a
request served from a snapshot at p gives bit-identical logits and greedy tokens to an uncached
request whose prefill is split at p, for p in {1, 15, 16, 17, 63, 64, 65, 1000}."""
from __future__ import annotations

import math

import pytest

from test_engine_gpu import a3b_dir  # noqa: F401 (fixture)
from test_prefix_engine import check_lossless

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("tau", [math.inf, 16.0])
def test_restore_is_lossless_a3b_bf16(a3b_dir, tau):  # noqa: F811
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    def make(**kw):
        e = LLMEngine(EngineConfig(model=a3b_dir, load_format="dummy", dtype="bfloat16", device="cuda",
                                   max_num_seqs=8, max_num_batched_tokens=1100, max_model_len=1100,
                                   num_kv_blocks=8 * 70 + 1, ssm_bf16_tau=tau, seed=0, **kw), progress=False)
        e.capture_logits = True
        return e

    cached, plain = make(enable_prefix_caching=True, num_prefix_snapshots=64), make()
    assert cached.runner.use_graphs and plain.runner.use_graphs
    check_lossless(cached, plain, hybrid=tau != math.inf, vocab=cached.model_config.vocab_size)
    cached.check_integrity()
    plain.check_integrity()
