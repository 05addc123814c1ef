"""Mixed batches (--mixed-batch, runner/model_runner.py): a step with prefill rows runs its decode rows inside
the prefill forward as one-token chunks. CPU, tiny f32 model: the same greedy tokens as separate decode +
prefill forwards and logits within the chunked-prefill tolerance (1e-4 relative), the same seeded draws,
penalties, n > 1, logprobs, stops, grammars, through preemption, prefix-cache restores, overlapped steps
(decode ids fed from the device) and the padded prefill layout the GPU captures. Each test also checks that
the mixed path really ran: steps with both kinds of rows ran no separate decode forward."""
from __future__ import annotations

import os

import pytest
import torch

from linrnn_serve.runner.model_runner import ModelRunner
from linrnn_serve.sampling_params import SamplingParams
from test_engine import drain, engines, make_engine, mixed_workload, model_dir, one_thread, tokens  # noqa: F401
from test_overlap import penalised_workload

REL = 1e-4


@pytest.fixture
def spy(monkeypatch):
    """Counts, per engine run: steps with decode and prefill rows, separate decode forwards in such steps,
    and decode rows fed from the device (token_id -1) in them."""
    seen = {"mixed_steps": 0, "separate": 0, "device_fed": 0, "padded": 0}
    run_decode, execute, stage = ModelRunner._run_decode, ModelRunner.execute_async, None

    def execute_async(self, plan):
        both = bool(plan.decode and plan.prefill)
        seen["mixed_steps"] += both
        seen["device_fed"] += both * sum(r.token_id == -1 for r in plan.decode)
        self._spy_both = both
        return execute(self, plan)

    def _run_decode(self, *a, **kw):
        seen["separate"] += self._spy_both
        return run_decode(self, *a, **kw)

    from linrnn_serve.runner.prefill_graphs import PrefillGraphs
    stage = PrefillGraphs.stage

    def staged(self, bucket, work, sel):
        seen["padded"] += any(len(w[0]) == 1 for w in work) and any(len(w[0]) > 1 for w in work)
        return stage(self, bucket, work, sel)

    monkeypatch.setattr(ModelRunner, "execute_async", execute_async)
    monkeypatch.setattr(ModelRunner, "_run_decode", _run_decode)
    monkeypatch.setattr(PrefillGraphs, "stage", staged)

    def take():
        out = dict(seen)
        seen.update({k: 0 for k in seen})
        return out

    return take


def _close(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        err = ((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item()
        assert err <= REL, (k, err)


def _check_mixed(on: dict, off: dict) -> None:
    assert on["mixed_steps"] > 3 and on["separate"] == 0  # decode rows rode in the prefill forward
    assert off["separate"] == off["mixed_steps"] > 3  # the reference ran them apart


def test_greedy_tokens_and_logits_equal_separate_forwards(make_engine, spy):
    out = {}
    for mixed in (False, True):
        eng = make_engine(device="cpu", mixed_batch=mixed, async_scheduling=False)
        assert eng.describe()["mixed_batch"] is mixed
        eng.capture_logits = True
        out[mixed] = tokens(drain(eng, mixed_workload())), dict(eng.logits_log), spy()
    assert out[True][0] == out[False][0]
    _close(out[True][1], out[False][1])
    _check_mixed(out[True][2], out[False][2])


def test_seeded_penalties_n_preemption_overlapped(make_engine, spy):
    """Sampled (seeded, top-k / top-p / min-p), penalised, n = 2, preempted, overlapped (decode ids still on the
    device when the mixed forward launches): the same tokens as separate forwards run synchronously."""
    ref = tokens(drain(make_engine(device="cpu", mixed_batch=False, async_scheduling=False, num_kv_blocks=16),
                       penalised_workload()))
    off = spy()
    eng = make_engine(device="cpu", mixed_batch=True, async_scheduling=True, num_kv_blocks=16)
    assert tokens(drain(eng, penalised_workload())) == ref
    on = spy()
    _check_mixed(on, off)
    assert on["device_fed"] > 10 and eng.stats()["num_preemptions_total"] > 0


def test_padded_prefill_layout_overlapped(make_engine, spy, monkeypatch):
    """The GPU's layout (prefill padded to token buckets, the CUDA-graph path) with decode rows in it."""
    monkeypatch.setenv("LINRNN_PREFILL_GRAPHS", "1")
    ref = tokens(drain(make_engine(device="cpu", mixed_batch=False, async_scheduling=False), mixed_workload(seed=7, sampled=True)))
    off = spy()
    eng = make_engine(device="cpu", mixed_batch=True, async_scheduling=True)
    assert eng.runner.prefill_graphs is not None
    assert tokens(drain(eng, mixed_workload(seed=7, sampled=True))) == ref
    on = spy()
    _check_mixed(on, off)
    assert on["padded"] > 3 and on["device_fed"] > 3


def test_logprobs_stops_and_n(make_engine, spy):
    """Decode rows' logprobs, stop strings / ids found a step late, min_tokens bans and n = 3 in mixed steps."""
    def reqs():
        arrive = [("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop_token_ids=[3])),
                  ("m", [5, 6, 7], SamplingParams(temperature=0.8, seed=2, max_tokens=20, min_tokens=12)),
                  ("n", [3, 1, 4, 1, 5] * 7, SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, logprobs=3)),
                  ("l", [2, 7, 1] * 11, SamplingParams(temperature=0, max_tokens=9, logprobs=2, ignore_eos=True)),
                  ("b", list(range(9, 60)), SamplingParams(temperature=0, max_tokens=6, logprobs=1, ignore_eos=True,
                                                           logit_bias={17: 3.0}))]
        return arrive

    def run(eng):
        out = {}
        for i, r in enumerate(reqs()):  # one arrival every two steps: each prefill meets running decodes
            eng.add_request(*r)
            for _ in range(2):
                out.update({o.request_id: o for o in eng.step() if o.finished})
        out.update(drain(eng))
        return {rid: [(c.token_ids, c.finish_reason, c.logprobs) for c in o.outputs] for rid, o in out.items()}

    ref = run(make_engine(device="cpu", mixed_batch=False, async_scheduling=False))
    off = spy()
    got = run(make_engine(device="cpu", mixed_batch=True, async_scheduling=True))
    on = spy()
    assert {k: [(t, f) for t, f, _ in v] for k, v in got.items()} == {k: [(t, f) for t, f, _ in v] for k, v in ref.items()}
    for k in ref:
        for (*_, lp_r), (*_, lp_g) in zip(ref[k], got[k]):
            assert (lp_r is None) == (lp_g is None)
            for dr, dg in zip(lp_r or [], lp_g or []):
                assert dr.keys() == dg.keys() and all(abs(dr[t] - dg[t]) < 1e-4 for t in dr)
    assert on["mixed_steps"] > 3 and on["separate"] == 0 and off["separate"] == off["mixed_steps"]


def test_prefix_cache_restores(make_engine, spy):
    """Requests restored from prefix-cache snapshots (and snapshots taken) in steps with decode rows."""
    prompt = list(range(40, 90))

    def reqs():
        return {0: [("q0", prompt + [0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))],
                3: [(f"q{i}", prompt + [i], SamplingParams(temperature=0.9, seed=i, max_tokens=9, ignore_eos=True))
                    for i in (1, 2)],
                9: [("full", list(prompt), SamplingParams(temperature=0, max_tokens=5)),
                    ("q3", prompt[:20] + [3, 4, 5], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]}

    kw = dict(enable_prefix_caching=True, num_prefix_snapshots=8)
    ref_eng = make_engine(device="cpu", mixed_batch=False, async_scheduling=False, **kw)
    ref_eng.capture_logits = True
    ref = tokens(drain(ref_eng, reqs()))
    off = spy()
    eng = make_engine(device="cpu", mixed_batch=True, async_scheduling=False, **kw)
    eng.capture_logits = True
    assert tokens(drain(eng, reqs())) == ref
    _close(eng.logits_log, ref_eng.logits_log)
    on = spy()
    assert eng.stats()["prefix_cache_hits_total"] > 0
    assert on["mixed_steps"] > 3 and on["separate"] == 0 and off["separate"] == off["mixed_steps"]
    # overlapped too
    assert tokens(drain(make_engine(device="cpu", mixed_batch=True, async_scheduling=True, **kw), reqs())) == ref


def test_structured_output(spy):
    """Grammar-constrained rows (JSON schema, regex, choice; greedy and seeded) decoding in mixed steps."""
    pytest.importorskip("xgrammar")
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine
    from test_structured_output import _constrained_workload

    outs, seen = {}, {}
    for mixed in (False, True):
        eng = LLMEngine(EngineConfig(model="tiny", device="cpu", mixed_batch=mixed, async_scheduling=mixed, max_num_seqs=8,
                                     max_model_len=128), progress=False)
        arrivals, final, step = _constrained_workload(), {}, 0
        while eng.has_unfinished_requests() or arrivals:
            for rid, prompt, p in arrivals.pop(step, []):
                eng.add_request(rid, prompt, p)
            final.update({o.request_id: o for o in eng.step() if o.finished})
            step += 1
            assert step < 1000
        eng.check_integrity()
        outs[mixed] = {rid: o.outputs[0].token_ids for rid, o in final.items()}
        seen[mixed] = spy()
    assert outs[True] == outs[False]
    assert seen[True]["mixed_steps"] > 3 and seen[True]["separate"] == 0


def test_engine_arg_and_default():
    import argparse

    from linrnn_serve.engine_args import EngineArgs
    from linrnn_serve.runner.model_runner import mixed_batch_default

    p = EngineArgs.add_cli_args(argparse.ArgumentParser())
    for argv, want in (([], None), (["--mixed-batch"], True), (["--no-mixed-batch"], False)):
        assert EngineArgs.from_cli_args(p.parse_args(argv)).create_engine_config().mixed_batch is want
    assert mixed_batch_default(torch.device("cpu")) is False


# ---- the runner with the Triton kernels (interpreter on the CPU) ------------------------------------------
def _kernel_plans():
    """Two prompts; then both decode (one id from the host, one still on the device) beside a new prompt and
    the second chunk of a third (its state continues, KV at start_pos > 0); then everyone decodes."""
    g = torch.Generator().manual_seed(4)

    def toks(n):
        return torch.randint(0, 128, (n,), generator=g).tolist()

    from linrnn_serve.runner.plan import DecodeRow, PrefillRow, SamplingRow, StepPlan
    s = SamplingRow
    c = toks(30)
    return [
        StepPlan(prefill=[PrefillRow(1, toks(5), 0, 1, [1], samples=[s(1, slot=1)]),
                          PrefillRow(2, toks(18), 0, 2, [2, 3], samples=[s(2, slot=2)]),
                          PrefillRow(4, c[:12], 0, 4, [6, 7])],
                 reset_slots=[1, 2, 4], block_table_updates=[(1, 0, [1]), (2, 0, [2, 3])]),
        StepPlan(decode=[DecodeRow(9, 5, 1, s(1, slot=1)), DecodeRow(-1, 18, 2, s(2, slot=2))],
                 prefill=[PrefillRow(3, toks(9), 0, 3, [4], samples=[s(3, slot=3)]),
                          PrefillRow(4, c[12:], 12, 4, [6, 7], samples=[s(4, slot=4)])],
                 reset_slots=[3], block_table_updates=[(3, 0, [4]), (4, 0, [6, 7])]),
        StepPlan(decode=[DecodeRow(-1, 6, 1, s(1, slot=1)), DecodeRow(-1, 19, 2, s(2, slot=2)),
                         DecodeRow(-1, 9, 3, s(3, slot=3)), DecodeRow(-1, 30, 4, s(4, slot=4))]),
    ]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter on CPU tensors "
                    "(a CUDA machine runs test_gpu_mixed_equals_separate_with_graphs instead)")
def test_runner_mixed_step_with_triton_kernels():
    """Varlen GDN / conv / attention kernels (interpreter) with one-token rows beside prompts, in the padded
    layout the GPU captures (the unpadded one runs the same kernels; the interpreter takes ~a minute per
    layout): mixed on vs off, the same ids, logits and live states within 1e-4, the decode rows fed from the
    device get the previous step's ids, and no slot or KV block outside the live ones is written (NaN)."""
    pad = True
    from helpers import make_hf_checkpoint, rel_err
    from linrnn_kernels.dispatch import triton_on
    from linrnn_serve.config import ModelConfig
    from linrnn_serve.models.loading import load_model
    from test_prefill_graphs import SLOTS, _runner
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = make_hf_checkpoint(d)
        model = load_model(ModelConfig.from_pretrained(path), str(path), torch.float32, "cpu", progress=False)
    runs = {}
    for mixed in (False, True):
        r = _runner(model, pad, dummy_nan=False)
        r.mixed_batch = mixed
        out = []
        for plan in _kernel_plans():
            with triton_on("cpu"):
                res = r.execute(plan)
            out.append((dict(res.sampled),
                        {k: v.clone() for k, v in r.last_logits().items()}))
        runs[mixed] = out, r
    (on, r_on), (off, r_off) = runs[True], runs[False]
    for (ids_a, lg_a), (ids_b, lg_b) in zip(on, off):
        assert ids_a == ids_b and lg_a.keys() == lg_b.keys()
        for k in lg_a:
            assert rel_err(lg_a[k], lg_b[k]) <= REL, k
    sa, sb = r_on.caches.state, r_off.caches.state
    for a, b in zip(sa.ssm_f32 + sa.ssm_bf16 + [sa.conv], sb.ssm_f32 + sb.ssm_bf16 + [sb.conv]):
        if a.numel() == 0:
            continue
        dim = 1 if a is sa.conv else 0
        live = torch.tensor([1, 2, 3, 4])
        assert rel_err(a.index_select(dim, live), b.index_select(dim, live)) <= REL
        assert torch.isnan(a.index_select(dim, torch.tensor(list(range(5, SLOTS)))).float()).all()
    kv = r_on.caches.kv.kv
    assert torch.isnan(kv[:, :, 8:]).all() and torch.isnan(kv[:, :, 5]).all()


# ---- the GPU: captured decode and prefill graphs ----------------------------------------------------------
@pytest.mark.gpu
def test_gpu_mixed_equals_separate_with_graphs(tmp_path, spy):
    """Tiny model in f32 on the GPU, CUDA graphs on (decode buckets + padded prefill graphs), requests arriving
    while others decode: mixed on vs off give the same greedy and seeded streams, logits rows within 1e-3
    relative (the kernels' matmuls may use TF32), no NaN; again with overlapped steps (logits capture makes
    steps synchronous); the mixed steps really ran."""
    import random

    from engine_fixtures import make_tiny_model_dir
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    d = make_tiny_model_dir(tmp_path / "tiny")

    def make(mixed):
        e = LLMEngine(EngineConfig(model=d, dtype="float32", device="cuda", mixed_batch=mixed, async_scheduling=True,
                                   max_num_seqs=64, max_num_batched_tokens=512, max_model_len=512), progress=False)
        assert e.runner.prefill_graphs.use_graphs and e.runner.use_graphs and e.async_scheduling
        return e

    rng = random.Random(5)
    arrivals = {}
    for i in range(48):
        prompt = [rng.randrange(300) for _ in range(rng.choice([1, 7, 16, 17, 60, 130]))]
        kw = dict(temperature=0.0) if i % 3 else dict(temperature=1.0, top_p=0.9, seed=i)
        arrivals.setdefault(rng.randrange(40), []).append((f"g{i}", prompt, SamplingParams(
            max_tokens=rng.randint(8, 40), ignore_eos=True, **kw)))
    engs, out, seen = {}, {}, {}
    for mixed in (False, True):
        e = engs[mixed] = make(mixed)
        e.capture_logits = True
        out[mixed] = tokens(drain(e, {k: list(v) for k, v in arrivals.items()}))
        seen[mixed] = spy()
    assert out[True] == out[False]
    _check_mixed(seen[True], seen[False])
    a, b = engs[True].logits_log, engs[False].logits_log
    assert a.keys() == b.keys()
    for k in a:
        assert not torch.isnan(a[k]).any()
        assert ((a[k].float() - b[k].float()).abs().max() / b[k].float().abs().max()).item() <= 1e-3, k
    for e in engs.values():
        e.check_integrity()
    del engs, e
    overlapped = make(True)
    assert tokens(drain(overlapped, {k: list(v) for k, v in arrivals.items()})) == out[False]
    on = spy()
    assert on["mixed_steps"] > 3 and on["separate"] == 0 and on["device_fed"] > 10
    overlapped.check_integrity()
