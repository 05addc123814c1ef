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
