"""Overlapped steps (LLMEngine.async_scheduling, vLLM's async scheduling) on the CPU.

Step N+1 is scheduled and launched before step N's sampled ids are postprocessed: a decode row whose
token is still "on the device" has DecodeRow.token_id == -1 and the runner feeds the slot's last
sampled id. Greedy and seeded outputs must equal the synchronous loop's, stops found a step late
drop the extra token, preemption and aborts leave nothing behind. The same code path runs on the
CPU (the runner's copies are synchronous there), so these tests cover it.

Two levels: the scheduler with the fake runner of test_scheduler (history-hash "model" that checks
every slot's state and KV at every step), and the engine with the tiny model.
"""
from __future__ import annotations

import pytest

from linrnn_serve.runner.plan import StepResult
from linrnn_serve.sampling_params import SamplingParams
from linrnn_serve.scheduler import Request
from test_engine import drain, engines, make_engine, mixed_workload, model_dir, one_thread, tokens  # noqa: F401
from test_scheduler import EOS, FakeRunner, make, outputs, req, run, workload


# ---- the scheduler, overlapped ------------------------------------------------------------------
class DeviceIdsRunner(FakeRunner):
    """FakeRunner that keeps each slot's last sampled id "on the device" and feeds it to decode rows
    whose token the host has not seen (token_id == -1)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.last: dict[int, int] = {}
        self.device_fed = 0

    def execute(self, plan) -> StepResult:
        for row in plan.decode:
            if row.token_id == -1:
                row.token_id = self.last[row.slot]
                self.device_fed += 1
        res = super().execute(plan)
        for row in plan.decode:
            self.last[row.slot] = res.sampled[row.sampling.seq_id]
        for row in plan.prefill:
            for s in row.samples:
                self.last[s.slot] = res.sampled[s.seq_id]
        for row in plan.cached:
            for s in row.samples:
                self.last[s.slot] = res.sampled[s.seq_id]
        return res


def run_overlapped(sch, runner, arrivals=None, max_steps=10_000, abort_at=None):
    """test_scheduler.run with step N+1 scheduled (and "launched") before step N is postprocessed."""
    arrivals = dict(arrivals or {})
    done, step, inflight = {}, 0, None
    while sch.has_unfinished() or arrivals or inflight is not None:
        for r in arrivals.pop(step, []):
            sch.add_request(r)
        for rid in (abort_at or {}).get(step, []):
            r = sch.abort_request(rid)
            if r is not None:
                done[rid] = r
        plan = sch.schedule()
        launched = None if plan.empty else (plan, runner.execute(plan))
        if inflight is not None:
            for r in sch.postprocess(*inflight):
                if r.finished:
                    done[r.request_id] = r
        inflight = launched
        step += 1
        assert step < max_steps, "no progress"
    sch.check_idle_integrity()
    return done


def fresh(arrivals):
    return {k: [Request(r.request_id, r.prompt_token_ids, r.params, r.seed) for r in v] for k, v in arrivals.items()}


def overlapped_make(**kw):
    sch, r = make(**kw)
    return sch, DeviceIdsRunner(len(r.tables), r.num_blocks, r.bs, len(r.tables[0]))


@pytest.mark.parametrize("num_blocks", [None, 24])
def test_scheduler_overlapped_equals_sync(num_blocks):
    """Same outputs with and without overlap, also with preemption by a small KV cache."""
    ref = outputs(run(*make(max_num_seqs=16, budget=24, num_blocks=num_blocks), workload()))
    sch, runner = overlapped_make(max_num_seqs=16, budget=24, num_blocks=num_blocks)
    assert outputs(run_overlapped(sch, runner, workload())) == ref
    assert runner.device_fed > 50  # decode rows really were fed from the device
    if num_blocks:
        assert sch.stats.num_preemptions > 0


def test_scheduler_overlapped_stops_drop_the_extra_token():
    """EOS, stop ids and stop strings found a step late: the token sampled meanwhile is dropped."""
    arr = {0: [req(f"e{k}", 5, max_tokens=30) for k in range(24)],  # EOS not ignored
           1: [req("s", 7, max_tokens=12, ignore_eos=True, stop=["c"]),
               req("t", 9, max_tokens=12, ignore_eos=True, stop_token_ids=[10, 20, 30, 40]),
               req("n", 6, n=3, seed=5, temperature=1.0, max_tokens=9, stop_token_ids=[7, 8, 9])]}
    ref = run(*make(max_num_seqs=16, budget=64), fresh(arr))
    got = run_overlapped(*overlapped_make(max_num_seqs=16, budget=64), fresh(arr))
    assert outputs(got) == outputs(ref)
    reasons = {rid: [(s.finish_reason, s.stop_reason, s.text) for s in r.seqs] for rid, r in ref.items()}
    assert reasons == {rid: [(s.finish_reason, s.stop_reason, s.text) for s in r.seqs] for rid, r in got.items()}
    assert any(s.finish_reason == "stop" and s.output_token_ids[-1] == EOS for r in got.values() for s in r.seqs)


def test_scheduler_overlapped_aborts_and_forks_leave_nothing():
    sch, runner = overlapped_make(max_num_seqs=4, budget=4, num_blocks=8, block_size=4)
    sch.add_request(req("a", 6, max_tokens=20, ignore_eos=True))
    sch.add_request(req("b", 12, n=2, max_tokens=4, ignore_eos=True))
    sch.add_request(req("c", 3, max_tokens=40, ignore_eos=True))
    done = run_overlapped(sch, runner, abort_at={5: ["a"], 9: ["c"]})  # check_idle_integrity inside
    assert done["a"].seqs[0].finish_reason == "abort" and done["c"].seqs[0].finish_reason == "abort"
    assert [s.finish_reason for s in done["b"].seqs] == ["length", "length"]


def test_scheduler_overlapped_max_tokens_is_not_overshot():
    """A sequence whose last token is in flight is not scheduled again (no wasted step or block)."""
    sch, runner = overlapped_make()
    sch.add_request(req("m", 4, max_tokens=3, ignore_eos=True))
    plans = []
    inflight = None
    while sch.has_unfinished() or inflight is not None:
        plan = sch.schedule()
        plans.append(plan)
        launched = None if plan.empty else (plan, runner.execute(plan))
        if inflight is not None:
            sch.postprocess(*inflight)
        inflight = launched
    assert sum(len(p.decode) for p in plans) == 2  # prefill samples token 1, two decodes sample 2 and 3


# ---- the engine, overlapped (tiny model) -----------------------------------------------------------
def test_engine_greedy_overlapped_equals_sync_with_preemption(make_engine):
    ref = tokens(drain(make_engine(async_scheduling=False), mixed_workload()))
    eng = make_engine(async_scheduling=True, num_kv_blocks=12)
    assert eng.async_scheduling
    fed = []
    orig = eng.executor.execute_async
    eng.executor.execute_async = lambda plan: (fed.append(sum(r.token_id == -1 for r in plan.decode)), orig(plan))[1]
    assert tokens(drain(eng, mixed_workload())) == ref
    assert eng.stats()["num_preemptions_total"] > 0
    assert sum(fed) > 50


def test_engine_seeded_overlapped_is_batch_invariant(make_engine):
    """Seeded sampling: each request alone (synchronous) == all of them batched, overlapped, preempted."""
    work = mixed_workload(seed=3, sampled=True)
    solo = make_engine(async_scheduling=False)
    ref = {}
    for reqs in work.values():
        for r in reqs:
            ref.update(tokens(drain(solo, {0: [r]})))
    eng = make_engine(async_scheduling=True, num_kv_blocks=16)
    assert tokens(drain(eng, mixed_workload(seed=3, sampled=True))) == ref
    assert eng.stats()["num_preemptions_total"] > 0


def penalised_workload(seed=7):
    """mixed_workload with presence / frequency / repetition penalties on most requests (and n > 1)."""
    work = mixed_workload(seed=seed, sampled=True)
    for k, reqs in work.items():
        for j, (rid, prompt, p) in enumerate(reqs):
            if int(rid[1:]) % 4 != 3:
                p.presence_penalty, p.frequency_penalty = 0.7, 0.4 if j % 2 else -0.3
                p.repetition_penalty = 1.3 if int(rid[1:]) % 3 else 1.0
            if rid == "r5":
                p.n, p.seed = 2, 77
    return work


def test_engine_penalties_overlapped_equal_sync_and_solo(make_engine):
    """Penalties run overlapped now (device statistics per slot): the same tokens as the synchronous loop
    and as each request alone, through preemption (a preempted sequence's statistics are rebuilt)."""
    solo = make_engine(async_scheduling=False)
    ref = {}
    for reqs in penalised_workload().values():
        for r in reqs:
            ref.update(tokens(drain(solo, {0: [r]})))
    sync = make_engine(async_scheduling=False, num_kv_blocks=16)
    assert tokens(drain(sync, penalised_workload())) == ref
    eng = make_engine(async_scheduling=True, num_kv_blocks=16)
    fed = []
    orig = eng.executor.execute_async
    eng.executor.execute_async = lambda plan: (fed.append(sum(r.token_id == -1 for r in plan.decode)), orig(plan))[1]
    assert tokens(drain(eng, penalised_workload())) == ref
    assert eng.stats()["num_preemptions_total"] > 0 and sync.stats()["num_preemptions_total"] > 0
    assert sum(fed) > 20  # penalised rows were fed from the device (overlapped)


def _final(eng, reqs):
    out = drain(eng, {0: reqs})
    return {rid: [(c.token_ids, c.text, c.finish_reason, c.stop_reason, c.logprobs) for c in o.outputs]
            for rid, o in out.items()}


def test_engine_overlapped_stops_logprobs_and_n(make_engine):
    """Stop strings / stop ids / EOS found a step late, n > 1, logprobs, min_tokens: same as synchronous."""
    sync = make_engine(async_scheduling=False)
    probe = drain(sync, {0: [("p", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]})
    toks, text = probe["p"].outputs[0].token_ids, probe["p"].outputs[0].text
    stop_str = text[len(text) // 3: len(text) // 3 + 2] or "e"
    reqs = [("s", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_str])),
            ("t", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[toks[5]])),
            ("m", [5, 6, 7], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[toks[2]], min_tokens=6)),
            ("e", [9, 8], SamplingParams(temperature=0.9, seed=4, max_tokens=40)),  # EOS may come
            ("n", [3, 1, 4, 1, 5], SamplingParams(n=3, temperature=1.0, seed=9, max_tokens=10, logprobs=3)),
            ("l", [2, 7, 1], SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True))]
    ref = _final(sync, [(a, list(b), c) for a, b, c in reqs])
    got = _final(make_engine(async_scheduling=True), [(a, list(b), c) for a, b, c in reqs])
    # logprob values may differ in the last bits: a sequence that stopped a step late still fills a decode
    # row, so other rows can run in another bucket size (the CPU reference ops are not batch-invariant in
    # the last ulp); tokens, text and finish reasons are exact
    strip = lambda r: {k: [(t, x, f, s, [sorted(d) for d in lp] if lp else lp) for t, x, f, s, lp in v]  # noqa: E731
                       for k, v in r.items()}
    assert strip(got) == strip(ref)
    for k in ref:
        for (*_, lp_r), (*_, lp_g) in zip(ref[k], got[k]):
            for dr, dg in zip(lp_r or [], lp_g or []):
                assert all(abs(dr[t] - dg[t]) < 1e-4 for t in dr)
    assert ref["s"][0][2] == "stop" and ref["t"][0][2] == "stop" and ref["t"][0][0][-1] == toks[5]


def test_engine_overlapped_with_prefix_caching(make_engine):
    prompt = list(range(40, 90))
    reqs = lambda: [(f"q{i}", prompt + [i], SamplingParams(temperature=0, max_tokens=9, ignore_eos=True))  # noqa: E731
                    for i in range(4)] + [("full", list(prompt), SamplingParams(temperature=0, max_tokens=5))]
    ref = tokens(drain(make_engine(async_scheduling=False, enable_prefix_caching=True, num_prefix_snapshots=8),
                       {0: reqs()[:1], 3: reqs()[1:3], 9: reqs()[3:]}))
    eng = make_engine(async_scheduling=True, enable_prefix_caching=True, num_prefix_snapshots=8)
    assert tokens(drain(eng, {0: reqs()[:1], 3: reqs()[1:3], 9: reqs()[3:]})) == ref
    assert eng.stats()["prefix_cache_hits_total"] > 0


def test_engine_overlapped_aborts_leave_no_leaked_slots(make_engine):
    eng = make_engine(async_scheduling=True, max_num_seqs=8)
    for i in range(20):
        eng.add_request(f"d{i}", [1 + i, 2, 3], SamplingParams(temperature=0.8, seed=i, max_tokens=60,
                                                               ignore_eos=True))
    for k in range(40):
        eng.step()
        if k % 2 == 0:
            eng.abort(f"d{k // 2}")  # running ones mid-flight, with a step in flight
    assert eng.stats()["num_preemptions_total"] >= 0
    drain(eng)
    assert not eng.has_unfinished_requests()
    eng.check_integrity()
    assert eng.scheduler.slots.num_used == 0


def test_core_deltas_overlapped_equal_sync(make_engine):
    """The core's per-step deltas concatenate to the same streams (what the server sends)."""
    from linrnn_serve.engine.core import EngineCore
    from linrnn_serve.engine.protocol import AddRequest

    def streams(eng):
        core = EngineCore(eng)
        for i, (rid, prompt, p) in enumerate(r for v in mixed_workload(seed=5, sampled=True).values() for r in v):
            core.add(AddRequest(rid, prompt, p, 0.0))
        got: dict[str, list[int]] = {}
        while eng.has_unfinished_requests():
            out = core.step()
            for d in out.deltas:
                for s in d.seqs:
                    got.setdefault(f"{d.request_id}/{s.index}", []).extend(s.token_ids)
            for rid, t in zip(out.token_request_ids, out.token_ids):
                got[f"{rid}/0"].append(t)
        return got

    assert streams(make_engine(async_scheduling=True)) == streams(make_engine(async_scheduling=False))


def test_engine_overlapped_with_padded_prefill(make_engine, monkeypatch):
    """The GPU's default prefill layout (padded to token buckets, prefill_graphs.py) with overlapped steps."""
    monkeypatch.setenv("LINRNN_PREFILL_GRAPHS", "1")
    ref = tokens(drain(make_engine(async_scheduling=False), mixed_workload(seed=7, sampled=True)))
    eng = make_engine(async_scheduling=True)
    assert eng.runner.prefill_graphs is not None
    assert tokens(drain(eng, mixed_workload(seed=7, sampled=True))) == ref
