"""GPU: constrained decode keeps the whole-step CUDA graphs (the bitmask is applied by a captured
graph reading a static buffer, uploaded on a side stream), gives valid JSON, gives the same tokens as
graphs off (constrained and free rows), and adds no host synchronization to a decode step."""
from __future__ import annotations

import json

import pytest
import torch

import warnings

from linrnn_serve import LLM, SamplingParams, StructuredOutputsParams

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_constrained_decode_keeps_cuda_graphs():
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "s": {"type": "string", "maxLength": 6}}, "required": ["n", "s"]}
    so = StructuredOutputsParams(json=schema)
    outs = {}
    for eager in (False, True):
        llm = LLM("default", progress=False, enforce_eager=eager, max_num_seqs=8)
        assert llm.engine.describe()["cuda_graphs"] is (not eager)
        ps = [SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)] * 3 + \
             [SamplingParams(temperature=0, max_tokens=24)] * 3
        replays = []
        runner = llm.engine.runner
        orig = runner.graphs.replay
        runner.graphs.replay = lambda b, kind: (replays.append(kind), orig(b, kind))[1]
        res = llm.generate(["def f(x):"] * 6, ps, use_tqdm=False)
        outs[eager] = [o.outputs[0].text for o in res]
        for t in outs[eager][:3]:
            v = json.loads(t)
            assert 0 <= v["n"] <= 9 and len(v["s"]) <= 6
        if not eager:
            assert "mask" in replays and "step" in replays  # the masked step ran as graphs
        del llm
        torch.cuda.empty_cache()
    assert outs[False] == outs[True]  # free and constrained rows: graphs (side-stream mask upload) == eager


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_constrained_decode_step_adds_no_sync():
    """Synchronizing CUDA calls per decode step (torch's sync debug mode): a batch with every row under a
    grammar makes no more of them than the same batch free (the sampled ids' transfer is the one sync)."""
    llm = LLM("default", progress=False, max_num_seqs=8)
    eng = llm.engine
    so = StructuredOutputsParams(json={"type": "array", "items": {"type": "integer"}})  # never completes

    def syncs_per_step(constrained: bool) -> float:
        for i in range(8):
            eng.add_request(f"{constrained}-{i}", [11 + i, 12, 13], SamplingParams(
                temperature=0, max_tokens=64, ignore_eos=True, structured_outputs=so if constrained else None))
        while eng.scheduler.waiting or any(not s.decode_ready for s in eng.scheduler.running):
            eng.step()
        eng.step()
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(8):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        for i in range(8):
            eng.abort(f"{constrained}-{i}")
        eng.check_integrity()
        return sum("synchroniz" in str(x.message) for x in w) / 8

    free, constrained = syncs_per_step(False), syncs_per_step(True)
    assert eng.runner.use_graphs and constrained <= free, (free, constrained)
