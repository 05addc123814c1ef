"""GPU: constrained decode keeps the whole-step CUDA graphs (the bitmask is applied by a captured
graph reading a static buffer), gives valid JSON, and leaves free rows bit-identical to graphs off."""
from __future__ import annotations

import json

import pytest
import torch

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
    assert outs[False][3:] == outs[True][3:]
