"""Late binding of overlapped steps (engine/step_clock.py, engine/core.py's arrival window).

The clock's predictions and deadlines on synthetic times; then the engine-core process with a paced stub
forward (benchmarks/handover.py: a virtual device on which a step lasts 60 ms): a request sent right
after a step's tokens reach the client runs in the step after the one in flight (its first token comes
with the running request's second token after that), one step sooner than with --no-late-binding."""
from __future__ import annotations

import argparse
import asyncio
import time

import pytest

from linrnn_serve.config import EngineConfig
from linrnn_serve.engine.step_clock import MARGIN_S, StepClock
from linrnn_serve.engine_args import EngineArgs
from linrnn_serve.sampling_params import SamplingParams


def _run(clock: StepClock, t: float, rows: int, tokens: int, seconds: float, host: float = 0.001,
         prefill_rows: int = 0) -> float:
    """Launch a step at t (host time `host`), the host blocks on it until it ends; returns its end."""
    clock.launched(rows, tokens, t, t + host, prefill_rows)
    clock.completed(t + host + seconds)
    return t + host + seconds


def test_clock_learns_decode_and_prefill_times_and_binds_before_the_predicted_end():
    c = StepClock()
    assert c.estimate(4, 0) is None and c.deadline() is None
    t = 0.0
    for _ in range(20):
        t = _run(c, t, 4, 0, 0.010)
    assert c.estimate(4, 0) == pytest.approx(0.010) and c.estimate(5, 0) == pytest.approx(0.010)  # nearest bucket
    assert c.estimate(4, 100) is None  # no prefill step measured yet
    for _ in range(20):
        t = _run(c, t, 4, 500, 0.010 + 500 * 20e-6, prefill_rows=4, host=0.003)
    assert c.per_token == pytest.approx(20e-6, rel=1e-3)
    assert c.estimate(4, 1000) == pytest.approx(0.030, rel=1e-3)
    assert c.host_per_row == pytest.approx(0.0005, rel=1e-3)  # (3 ms - 1 ms) / 4 rows
    # one step in flight, started when it was launched (the device was idle): bind at its end minus the lead
    c.launched(4, 0, 100.0, 100.001)
    assert c.deadline() == pytest.approx(100.001 + 0.010 - 2 * 0.001 - MARGIN_S)
    assert c.deadline(waiting_rows=2) == pytest.approx(100.001 + 0.010 - 2 * (0.001 + 2 * 0.0005) - MARGIN_S)
    c.seen_done(100.005)  # done earlier than predicted: schedule now, and learn from it
    assert c.deadline() is None
    c.launched(4, 0, 100.006, 100.007)  # queued behind nothing: starts at its launch
    assert c.deadline() is None  # two launched (the older not yet postprocessed): no window
    c.completed(None)
    assert c.estimate(4, 0) < 0.010  # the 4 ms step pulled the average down
    assert c.deadline() is not None


def test_clock_unseen_end_starts_the_next_step_at_its_launch():
    c = StepClock()
    t = 0.0
    for _ in range(5):
        t = _run(c, t, 2, 0, 0.008)
    n = c.measured
    c.launched(2, 0, 1.0, 1.001)
    c.launched(2, 0, 1.002, 1.050)  # a slow launch: the step before had ended, nobody saw when
    c.completed(None)
    assert c.measured == n  # not measured
    c.completed(1.058)
    assert c.measured == n + 1 and c.estimate(2, 0) == pytest.approx(0.008)  # 1.058 - its launch 1.050


def test_late_binding_flag_and_defaults():
    def config(*argv):
        p = EngineArgs.add_cli_args(argparse.ArgumentParser())
        return EngineArgs.from_cli_args(p.parse_args(list(argv))).create_engine_config()

    assert config("--no-late-binding").late_binding is False and config().late_binding is None


@pytest.fixture
def paced(monkeypatch):
    from linrnn_bench.handover import PACE_ENV

    monkeypatch.setenv(PACE_ENV, "60,50")  # the core process inherits it: 60 ms per step


def _first_token_step(late: bool) -> int:
    """How many of A's tokens after the one B was sent upon (10 ms later) B's first token comes with (2: the
    step after the one in flight; 3: one more)."""
    from linrnn_serve.engine.core_client import AsyncMPClient

    client = AsyncMPClient(EngineConfig(model="default", executor="linrnn_bench.handover:PacedStubExecutor",
                                        async_scheduling=True, late_binding=late, max_num_seqs=8,
                                        max_model_len=512))
    try:
        async def main():
            a_times: list[tuple[float, int]] = []
            sent = asyncio.get_running_loop().create_future()

            async def run_a():
                async for out in client.generate([300, 301, 302], SamplingParams(max_tokens=20, ignore_eos=True),
                                                 "a"):
                    n = len(out.outputs[0].token_ids)
                    a_times.append((time.monotonic(), n))
                    if n == 8 and not sent.done():  # the clock has measured decode steps by now
                        sent.set_result(n)

            async def run_b():
                n_sent = await sent
                await asyncio.sleep(0.01)  # well after the core's poll that follows a step's send, well before the end
                async for _ in client.generate([400, 401], SamplingParams(max_tokens=2, ignore_eos=True), "b"):
                    t_b = time.monotonic()
                    break
                await asyncio.sleep(0)
                return n_sent, t_b

            _, (n_sent, t_b) = await asyncio.gather(run_a(), run_b())
            with_b = max(n for t, n in a_times if t <= t_b + 0.02)  # A's tokens of the same step message
            return with_b - n_sent

        return asyncio.run(main())
    finally:
        client.shutdown_sync(timeout=10)


def test_core_binds_an_arrival_into_the_step_after_the_one_in_flight(paced):
    assert _first_token_step(late=True) == 2
    assert _first_token_step(late=False) == 3  # the control: the same arrival bound early waits a step more
