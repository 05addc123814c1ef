"""Burst coalescing (engine/burst.py): new prompts wait for the rest of their burst so that it prefills in one step.

BurstHold's rules on synthetic times; the scheduler's admit=False; then the engine-core process with a paced stub
forward (benchmarks/handover.py's virtual device): six closed-loop clients whose first requests end together send
their next ones 0, 2, ..., 10 ms later, and those six prefill in one step (the control, --no-coalesce-bursts,
starts the first arrival alone at once); a lone client's requests are never held."""
from __future__ import annotations

import asyncio
import time

import pytest

from linrnn_serve.config import EngineConfig
from linrnn_serve.engine.burst import BURST_MIN, GAP_S, MAX_HOLD_S, OWED_S, BurstHold
from linrnn_serve.sampling_params import SamplingParams


def never():
    raise AssertionError("finishing_soon() is not needed here")


def test_a_lone_request_is_never_held():
    h = BurstHold()
    h.finished(1, 10.0)  # concurrency 1: its previous request ended, it comes back
    h.arrived(10.005)
    assert h.until(10.005, 10.005, 1, lambda: 0) is None
    assert h.holds == 0


def test_a_burst_is_waited_for_until_every_client_is_back():
    h = BurstHold()
    h.finished(8, 1.0)
    for i in range(7):
        h.arrived(1.004 + 0.001 * i)
        assert h.until(1.004 + 0.001 * i, 1.004, i + 1, never) == pytest.approx(1.0 + OWED_S)  # the owed expire then
    h.arrived(1.012)  # the eighth: all back, no gap wait after a whole burst came back
    assert h.until(1.012, 1.004, 8, lambda: 0) is None
    assert h.holds == 7


def test_the_hold_is_bounded():
    h = BurstHold()
    h.finished(8, 1.0)
    h.arrived(1.03)
    assert h.until(1.03, 1.03, 1, never) == pytest.approx(1.0 + OWED_S)
    assert h.until(1.0 + OWED_S + 1e-4, 1.03, 1, lambda: 0) is None  # the other clients did not come back in time
    h = BurstHold()
    h.finished(8, 1.0)
    h.arrived(1.001)
    assert h.until(1.001 + MAX_HOLD_S, 1.001, 1, never) is None  # the oldest waiter's limit
    h = BurstHold()
    h.finished(BURST_MIN - 1, 1.0)  # not a burst
    h.arrived(1.001)
    assert h.until(1.001, 1.001, 1, lambda: 0) is None


def test_arrivals_close_together_and_a_burst_about_to_end_are_waited_for():
    h = BurstHold()
    h.arrived(5.0)
    assert h.until(5.0, 5.0, 1, lambda: 0) is None  # one waiting: a lone arrival
    h.arrived(5.0004)
    assert h.until(5.0005, 5.0, 2, never) == pytest.approx(5.0004 + GAP_S)  # a second close behind: more may come
    assert h.until(5.0004 + GAP_S + 1e-4, 5.0, 2, lambda: 0) is None
    # a lone arrival while a burst of running sequences is about to reach its length limit: wait for it
    assert h.until(6.0, 6.0, 1, lambda: BURST_MIN) == pytest.approx(6.0 + MAX_HOLD_S)
    assert h.until(6.0, 6.0, 1, lambda: BURST_MIN - 1) is None


def test_scheduler_holds_admission_but_keeps_decoding():
    from linrnn_serve.cache import BlockAllocator, SlotAllocator
    from linrnn_serve.runner.plan import StepResult
    from linrnn_serve.scheduler import Request, Scheduler, SchedulerConfig

    sch = Scheduler(SchedulerConfig(4, 64, 64, 4), SlotAllocator(5), BlockAllocator(64))
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    sch.add_request(Request("a", [1, 2, 3], p, 0))
    plan = sch.schedule()
    sch.postprocess(plan, StepResult({r.samples[0].seq_id: 7 for r in plan.prefill}))
    sch.add_request(Request("b", [4, 5], p, 0))
    assert sch.oldest_waiting_arrival == sch.requests["b"].arrival_time
    assert sch.num_finishing_within(1) == 0 and sch.num_finishing_within(2) == 1  # a: 2 more tokens to go
    held = sch.schedule(admit=False)
    assert len(held.decode) == 1 and not held.prefill and sch.num_waiting_seqs == 1
    sch.postprocess(held, StepResult({r.sampling.seq_id: 8 for r in held.decode}))
    plan = sch.schedule()
    assert len(plan.decode) == 1 and len(plan.prefill) == 1 and sch.num_waiting_seqs == 0


@pytest.fixture
def paced(monkeypatch):
    from linrnn_bench.handover import PACE_ENV

    monkeypatch.setenv(PACE_ENV, "10,50,2")  # the core process inherits it: 10 ms per decode step


def _run_clients(coalesce: bool, clients: int, spread_s: float) -> tuple[list[list[float]], dict]:
    """`clients` closed-loop clients, two requests each (the second sent i * spread_s after the first ended);
    per round the first-token times (the core's clock: one value per step that produced them) and the core's
    stats at the end."""
    from linrnn_serve.engine.core_client import AsyncMPClient

    client = AsyncMPClient(EngineConfig(model="default", executor="linrnn_bench.handover:PacedStubExecutor",
                                        async_scheduling=True, coalesce_bursts=coalesce, max_num_seqs=8,
                                        max_num_batched_tokens=256, max_model_len=256))
    try:
        async def one(rid: str, prompt: list[int]) -> float:
            first = None
            async for out in client.generate(prompt, SamplingParams(max_tokens=4, ignore_eos=True), rid):
                first = first or out.metrics["first_token_time"]
            return first

        async def user(i: int) -> list[float]:
            a = await one(f"u{i}-0", [300 + i, 301, 302])
            await asyncio.sleep(i * spread_s)
            return [a, await one(f"u{i}-1", [400 + i, 401])]

        async def main():
            return await asyncio.wait_for(asyncio.gather(*(user(i) for i in range(clients))), 60)

        firsts = asyncio.run(main())
        deadline = time.monotonic() + 2  # the stats after the last step (sent within STATS_FRESH_S of the change)
        while time.monotonic() < deadline and client.stats().get("num_requests_running", 1):
            time.sleep(0.02)
        time.sleep(0.3)
        return [sorted(f[k] for f in firsts) for k in (0, 1)], client.stats()
    finally:
        client.shutdown_sync(timeout=10)


def test_the_successors_of_a_burst_prefill_in_one_step(paced):
    (_, second), stats = _run_clients(True, 6, 0.002)
    assert len(set(second)) == 1, second  # one step gave all six their first token
    assert stats["core_burst_holds_total"] > 0
    (_, second), _ = _run_clients(False, 6, 0.002)
    assert len(set(second)) > 1, second  # the control: the first one back started alone


def test_a_lone_client_is_never_held(paced):
    _, stats = _run_clients(True, 1, 0.0)
    assert stats["core_burst_holds_total"] == 0 and stats["core_burst_idle_seconds_total"] == 0


def test_head_start_rules():
    from linrnn_serve.engine.burst import HEAD_START_AFTER_S, HEAD_START_MIN_SPREAD_S, HEAD_START_MIN_TOKENS

    h = BurstHold()
    buckets = [16, 32, 64, 128, 256, 512, 1024, 1280, 1536, 2048]
    assert HEAD_START_MIN_TOKENS == 1024
    assert h.head_start(1.0, 1.0, [128] * 12, buckets) is None  # the first arrival just came: the rest may be close
    t = 1.0 + HEAD_START_AFTER_S + 1e-6
    assert h.head_start(t, 1.0, [128] * 7, buckets) is None  # too little to be worth a forward of its own
    assert h.head_start(t, 1.0, [128] * 11, buckets) == 1280  # whole prompts up to the largest bucket they fill
    assert h.head_start(t, 1.0, [600, 600, 400], buckets) == 1200  # in queue order, whole: 1200 of 1536 (sum 1600)
    assert h.head_start(t, 1.0, [900, 900], buckets) is None  # the first alone is under the minimum
    # the spread of the last burst that came back whole decides whether a head start pays
    h.finished(4, 2.0)
    for k in range(4):
        h.arrived(2.01 + k * (HEAD_START_MIN_SPREAD_S - 0.001) / 3)  # all back within the minimum spread
    assert h.last_spread == pytest.approx(HEAD_START_MIN_SPREAD_S - 0.001)
    assert h.head_start(t, 1.0, [128] * 11, buckets) is None
    h.finished(4, 3.0)
    for k in range(4):
        h.arrived(3.01 + k * (HEAD_START_MIN_SPREAD_S + 0.003) / 3)  # spread out
    assert h.head_start(t, 1.0, [128] * 11, buckets) == 1280


def test_scheduler_head_start_whole_prompts_and_parked_rows():
    from linrnn_serve.cache import BlockAllocator, SlotAllocator
    from linrnn_serve.runner.plan import StepResult
    from linrnn_serve.scheduler import Request, Scheduler, SchedulerConfig

    sch = Scheduler(SchedulerConfig(4, 64, 64, 4), SlotAllocator(5), BlockAllocator(64))
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    for rid, n in (("a", 5), ("b", 5), ("c", 5)):
        sch.add_request(Request(rid, list(range(1, n + 1)), p, 0))
    plan = sch.schedule(admit_tokens=12)  # a and b fit whole; c would be chunked: it waits
    assert [len(r.token_ids) for r in plan.prefill] == [5, 5] and sch.num_waiting_seqs == 1
    sch.postprocess(plan, StepResult({r.samples[0].seq_id: 7 for r in plan.prefill}))
    plan = sch.schedule(parked={"a", "b"})  # the rest prefills; the head start does not decode meanwhile
    assert not plan.decode and len(plan.prefill) == 1
    sch.postprocess(plan, StepResult({r.samples[0].seq_id: 7 for r in plan.prefill}))
    plan = sch.schedule()
    assert len(plan.decode) == 3  # the whole burst decodes together


@pytest.fixture(scope="module")
def offline_engine():
    from linrnn_serve.llm import LLM

    return LLM("default", progress=False).engine


@pytest.mark.parametrize("head_start", [True, False])
def test_a_held_burst_gets_a_head_start_and_still_decodes_as_one(head_start, monkeypatch, offline_engine):
    """Twelve requests of a finished burst come back: after 8 (>= HEAD_START_MIN_TOKENS) and HEAD_START_AFTER_S those 8
    prefill while the other 4 are on their way; the 4 prefill next while the 8 wait; then all 12 decode together
    and end in the same step. The control (no head start) holds all 12 and prefills them in one step."""
    from linrnn_serve.engine import burst, llm_engine
    from linrnn_serve.engine.burst import HEAD_START_AFTER_S

    for mod, name in ((burst, "OWED_S"), (burst, "MAX_HOLD_S"), (llm_engine, "MAX_HOLD_S")):
        monkeypatch.setattr(mod, name, 30.0)  # CPU forwards are slow: no hold may expire in this test
    monkeypatch.setattr(burst, "HEAD_START_MIN_TOKENS", 64)  # small prompts: 8 x 16 tokens make a head start
    eng = offline_engine
    eng.burst, eng.burst_head_start = BurstHold(), head_start
    V = eng.model_config.vocab_size
    p = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    eng.burst.finished(12, time.monotonic())
    for i in range(8):
        eng.add_request(f"r{i}", [(31 * i + j) % V for j in range(16)], p)
    time.sleep(HEAD_START_AFTER_S + 0.001)
    assert (eng.idle_hold_until() is None) == head_start  # the core steps for a head start, else waits
    eng.step_requests()
    assert len(eng.last_plan.prefill) == (8 if head_start else 0) and not eng.last_plan.decode
    eng.step_requests()  # the rest is still on its way: nothing runs (the 8 do not decode ahead)
    assert not eng.last_plan.prefill and not eng.last_plan.decode
    assert eng.idle_hold_until() is not None
    for i in range(8, 12):
        eng.add_request(f"r{i}", [(31 * i + j) % V for j in range(16)], p)
    eng.step_requests()  # the burst is in: its rest prefills (all 12 without a head start), nobody decodes
    assert len(eng.last_plan.prefill) == (4 if head_start else 12) and not eng.last_plan.decode
    ended = {}
    while eng.has_unfinished_requests():
        for req in eng.step_requests():
            if req.finished_time is not None:
                ended[req.request_id] = eng.num_steps
        assert eng.last_plan.empty or len(eng.last_plan.decode) == 12
    assert len(ended) == 12 and len(set(ended.values())) == 1  # one wave: all end in one step
    assert eng.burst.head_starts == int(head_start)
    eng.check_integrity()
