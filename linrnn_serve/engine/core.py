"""The engine core: the scheduler + executor step loop, emitting per-step deltas.

    EngineCore(engine)          wraps an LLMEngine (scheduler + Executor); add / abort -> a delta,
                                step -> the step's StepOutputs (deltas + the decode rows' token columns)
                                (also the in-process AsyncLLMEngine's, in its engine thread)
    run_engine_core(...)        the core process's main: ZeroMQ in (AddRequest / AbortRequest /
                                Shutdown), one StepOutputs message out per step (engine/protocol.py)

Process layout (one core per node):

    API server process                          engine core process (this module)
    ------------------                          ---------------------------------
    HTTP, chat templates, tokenize,   --add-->  scheduler -> Executor -> Worker(s) (one per GPU;
    detokenize (engine/core_client.py) <-step-- runner/worker.py; engine/executor.py is the seam)

The core never detokenizes except for requests with stop strings (finish detection needs text).
It imports nothing of the server; the server imports nothing of it but the spawn target.
"""
from __future__ import annotations

import gc
import logging
import math
import os
import pickle
import time

import msgspec

from linrnn_serve.engine.metrics import Histogram
from linrnn_serve.engine.protocol import (
    STATS_FRESH_S, STATS_INTERVAL_S, AbortRequest, AddRequest, ErrorInfo, RequestDelta, SeqDelta, Shutdown, StepOutputs,
    client_decoder, encoder,
)

log = logging.getLogger(__name__)

# host time per decode step (with the forward on a GPU, what the GPU waits for when it is not hidden)
STEP_BUCKETS = (0.0001, 0.0002, 0.0003, 0.0004, 0.0005, 0.00075, 0.001, 0.0015, 0.002, 0.003, 0.005, 0.0075, 0.01,
                0.02, 0.05, 0.1)


def error_info(e: BaseException) -> ErrorInfo:
    return ErrorInfo(type(e).__name__, str(e), getattr(e, "param", None), getattr(e, "code", None))


class EngineCore:
    """Per-step deltas over an LLMEngine: each sequence's tokens are sent once."""

    def __init__(self, engine):
        self.engine = engine
        self._sent: dict[str, list[int]] = {}  # request id -> tokens sent per sample
        self._plp_sent: dict[str, int] = {}  # request id -> prompt-logprob entries sent
        self._new_prompt: dict[str, list[int]] = {}  # request id -> its prompt ids as the engine runs them

        # wall time of the core loop's iterations that ran a step with decode rows only (receive,
        # schedule, execute, postprocess, deltas, send): with a stubbed forward, the host time per step;
        # apart, those at the full batch (max_num_seqs rows: a benchmark's B, not its ramp up and down)
        self.full_batch = engine.config.max_num_seqs
        self.loop_stats = {"core_decode_steps_total": 0, "core_decode_rows_total": 0,
                           "core_decode_step_seconds_total": 0.0, "core_full_decode_steps_total": 0,
                           "core_full_decode_step_seconds_total": 0.0, "integrity_failures_total": 0,
                           # late binding: iterations that waited for arrivals before scheduling, the time waited,
                           # and the requests that came in meanwhile (they run one step sooner)
                           "core_bind_windows_total": 0, "core_bind_window_seconds_total": 0.0,
                           "core_bind_window_arrivals_total": 0,
                           # burst coalescing: time the core waited, with nothing else to run, for the rest of a
                           # burst of arrivals (engine/burst.py), and the scheduling decisions that held admission
                           "core_burst_idle_seconds_total": 0.0, "core_burst_holds_total": 0,
                           "core_burst_head_starts_total": 0}
        self.step_hist = Histogram(STEP_BUCKETS)
        self.full_step_hist = Histogram(STEP_BUCKETS)

    @property
    def stats(self) -> dict:
        burst = self.engine.burst
        if burst is not None:
            self.loop_stats["core_burst_holds_total"] = burst.holds
            self.loop_stats["core_burst_head_starts_total"] = burst.head_starts
        return {**self.loop_stats, "core_decode_step_seconds": self.step_hist.snapshot(),
                "core_full_decode_step_seconds": self.full_step_hist.snapshot()}

    def observe_loop(self, t0: float, t1: float) -> None:
        p = self.engine.last_plan
        if p is not None and p.decode and not p.prefill:
            st = self.loop_stats
            st["core_decode_steps_total"] += 1
            st["core_decode_rows_total"] += len(p.decode)
            st["core_decode_step_seconds_total"] += t1 - t0
            self.step_hist.observe(t1 - t0)
            if len(p.decode) == self.full_batch:
                st["core_full_decode_steps_total"] += 1
                st["core_full_decode_step_seconds_total"] += t1 - t0
                self.full_step_hist.observe(t1 - t0)

    def add(self, msg: AddRequest) -> RequestDelta | None:
        """Queue a request; a delta carrying the error when it is refused."""
        try:
            req = self.engine.add_request(msg.request_id, msg.prompt if msg.prompt is not None else
                                          msg.prompt_token_ids, msg.params, arrival_time=msg.arrival_time,
                                          prompt_token_ids=msg.prompt_token_ids)
        except Exception as e:  # a refusal the client turns back into the same exception type
            return RequestDelta(msg.request_id, [], finished=True, error=error_info(e))
        self.track(req, msg.prompt_token_ids)
        return None

    def track(self, req, sent_prompt_ids: list[int]) -> None:
        """Follow a request queued in the engine (its deltas start empty). `sent_prompt_ids`: the prompt
        the client knows (the first delta carries the engine's when it differs: truncate_prompt_tokens)."""
        rid = req.request_id
        self._sent[rid] = [0] * req.params.n
        self._plp_sent[rid] = 1  # entry 0 (None) is implied
        if req.prompt_token_ids != sent_prompt_ids:
            self._new_prompt[rid] = req.prompt_token_ids

    def abort(self, request_id: str) -> RequestDelta | None:
        req = self.engine.abort_request(request_id)
        return None if req is None else self.delta(req)

    def step(self, out: StepOutputs | None = None) -> StepOutputs:
        """One engine step's outputs, added to `out` (a new StepOutputs if None): a running single-sample
        request's one new token (no logprobs, its first delta sent) in the two token columns, every other
        request with new output as a RequestDelta."""
        out = StepOutputs([]) if out is None else out
        deltas, rids, toks, sent_of = out.deltas, out.token_request_ids, out.token_ids, self._sent
        for req in self.engine.step_requests():
            seqs = req.seqs
            if len(seqs) == 1 and req.prompt_logprobs is None:
                s = seqs[0]
                sent = sent_of.get(req.request_id)
                if s.finish_reason is None and s.logprobs is None and sent is not None and sent[0] and \
                        len(s.token_ids) - s.prompt_len == sent[0] + 1:
                    sent[0] += 1
                    rids.append(req.request_id)
                    toks.append(s.token_ids[-1])
                    continue
            deltas.append(self.delta(req))
        return out

    def delta(self, req) -> RequestDelta:
        rid = req.request_id
        sent = self._sent.get(rid)
        if sent is None:
            sent = self._sent[rid] = [0] * len(req.seqs)
        seqs = []
        finished = True
        for s in req.seqs:
            k = sent[s.index]
            start = s.prompt_len + k
            n = len(s.token_ids) - s.prompt_len
            reason = s.finish_reason
            if reason is None:
                finished = False
                if n == k:
                    continue
            seqs.append(SeqDelta(s.index, s.token_ids[start:], s.logprobs[k:] if s.logprobs is not None else None,
                                 reason, s.stop_reason, len(s.text) if isinstance(s.stop_reason, str) else None))
            sent[s.index] = n
        plp = None
        if req.prompt_logprobs is not None:
            k = self._plp_sent.get(rid, 1)
            if len(req.prompt_logprobs) > k:
                plp = req.prompt_logprobs[k:]
                self._plp_sent[rid] = len(req.prompt_logprobs)
        if finished:
            self._sent.pop(rid, None)
            self._plp_sent.pop(rid, None)
        return RequestDelta(rid, seqs, finished, plp, req.first_token_time, req.finished_time,
                            prompt_token_ids=self._new_prompt.pop(rid, None) if self._new_prompt else None,
                            num_cached_tokens=req.num_cached_tokens)


def run_engine_core(config, input_addr: str, output_addr: str, log_level: int = logging.INFO,
                    idle_integrity_check: bool = True) -> None:
    """Main of the engine-core process: build the engine, say ready, then loop until Shutdown, the
    parent's death, or an error (reported to the client as StepOutputs.dead before exiting)."""
    import zmq

    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.connect(input_addr)
    push = ctx.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 2000)
    push.connect(output_addr)
    parent = os.getppid()
    try:
        from linrnn_serve.engine.llm_engine import LLMEngine

        engine = LLMEngine(config, progress=False)
    except BaseException as e:  # noqa: BLE001 -- the client raises it as a start-up error
        push.send(pickle.dumps({"error": error_info(e)}))
        push.close()
        pull.close(linger=0)
        ctx.term()
        return
    engine.detokenize_all = False
    if config.coalesce_bursts is not False:
        from linrnn_serve.engine.burst import BurstHold

        engine.burst = BurstHold()
        engine.burst_head_start = config.burst_head_start is not False
    if engine.device.type == "cpu":  # leave a core to the API server: spinning OpenMP threads starve it
        import torch

        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 2) - 1)))
    tok = engine.tokenizer
    push.send(pickle.dumps({
        "model_name": engine.model_name, "model_config": engine.model_config, "config": engine.config,
        "max_model_len": engine.max_model_len, "tokenizer_dir": getattr(tok, "path", None) if tok else None,
        "eos_token_ids": engine.eos_token_ids, "kv_capacity_tokens": engine.scheduler.kv_capacity_tokens,
        "describe": engine.describe(), "pid": os.getpid(),
        "default_sampling_params": engine.default_sampling_params}))
    core = EngineCore(engine)
    gc.collect()
    gc.freeze()  # the model and caches' Python objects never become garbage: keep them out of every GC pass
    poller = zmq.Poller()
    poller.register(pull, zmq.POLLIN)
    next_stats = last_stats = 0.0
    last_queues = (0, 0)
    checked_idle = True
    stop = False
    try:
        while not stop:
            t_loop = time.perf_counter()
            stepped = False
            busy = engine.has_unfinished_requests()
            hold = engine.idle_hold_until() if busy else None  # only held arrivals: wait for the rest of the burst
            out = StepOutputs([])  # this iteration's message: add refusals, abort deltas, then the step's
            deltas = out.deltas
            wait_ms = 100 if not busy else 0 if hold is None else max(1, math.ceil(1e3 * (hold - time.monotonic())))
            if poller.poll(wait_ms):
                stop = receive(pull, core, deltas)
            if hold is not None:
                core.loop_stats["core_burst_idle_seconds_total"] += time.perf_counter() - t_loop
                hold = None if stop else engine.idle_hold_until()  # the burst's rest may have come
            deadline = None if stop else engine.bind_deadline()
            if deadline is not None:  # late binding: take arrivals until just before the step in flight ends
                t_window = time.perf_counter()
                waiting = engine.scheduler.num_waiting_requests
                while deadline is not None and not engine.inflight_done():
                    left = deadline - time.monotonic()
                    if left <= 0:
                        break
                    if poller.poll(1 if left > 0.0015 else 0):  # (whole ms) the last one in 0.1 ms sleeps
                        stop = receive(pull, core, deltas)
                        deadline = None if stop else engine.bind_deadline()  # arrivals: a longer host lead
                    elif left <= 0.0015:
                        time.sleep(0.0001)
                waited = time.perf_counter() - t_window
                t_loop += waited  # waiting, not host work (observe_loop)
                st = core.loop_stats
                st["core_bind_windows_total"] += 1
                st["core_bind_window_seconds_total"] += waited
                st["core_bind_window_arrivals_total"] += max(engine.scheduler.num_waiting_requests - waiting, 0)
            if hold is not None:
                pass  # nothing to run until the hold ends or more arrive
            elif not stop and engine.has_unfinished_requests():
                checked_idle = False
                n_before = len(deltas)
                core.step(out)
                stepped = len(deltas) > n_before or bool(out.token_ids)
            elif not stop:
                engine.check_health()  # a lost tensor-parallel worker stops the core even while idle
                if not checked_idle:
                    checked_idle = True
                    if idle_integrity_check:
                        try:
                            engine.check_integrity()
                        except RuntimeError:  # a bookkeeping bug: loud, but keep serving
                            log.exception("idle integrity check failed")
                            core.loop_stats["integrity_failures_total"] += 1
            now = time.monotonic()
            stats = None
            sched = engine.scheduler
            queues = (sched.num_waiting_requests, sched.num_running_seqs)
            if queues != last_queues:  # queue gauges follow a change within STATS_FRESH_S
                next_stats = min(next_stats, last_stats + STATS_FRESH_S)
                last_queues = queues
            if now >= next_stats:
                stats = engine.stats()
                stats.update(core.stats)
                last_stats, next_stats = now, now + STATS_INTERVAL_S
            if deltas or out.token_ids or stats is not None:
                out.stats = stats
                push.send(encoder.encode(out))
            if stepped:
                core.observe_loop(t_loop, time.perf_counter())
            if os.getppid() != parent:  # nobody reads our outputs any more
                log.warning("the API server process is gone; the engine core exits")
                break
    except BaseException as e:  # noqa: BLE001 -- every waiting client must hear about it
        log.exception("engine core loop failed")
        try:
            push.send(encoder.encode(StepOutputs([], None, error_info(e))))
        except Exception:  # pragma: no cover
            pass
        raise
    finally:
        st = core.loop_stats
        if engine.late_binding:
            log.info("late binding: %d windows (%.2f ms mean), %d requests arrived in them, %d steps timed",
                     st["core_bind_windows_total"], 1e3 * st["core_bind_window_seconds_total"] /
                     max(st["core_bind_windows_total"], 1), st["core_bind_window_arrivals_total"], engine.clock.measured)
        if engine.burst is not None:
            b = engine.burst
            log.info("burst coalescing: %d holds, %.1f ms waited with nothing else to run, %d head starts; %d bursts "
                     "came back whole, first -> last arrival %.1f ms on average", b.holds,
                     1e3 * st["core_burst_idle_seconds_total"], b.head_starts, b.spreads[0],
                     1e3 * b.spreads[1] / max(b.spreads[0], 1))
        try:
            engine.shutdown()  # stops tensor-parallel worker processes
        except Exception:  # noqa: BLE001 -- best effort: the core is exiting anyway
            log.exception("engine shutdown failed")
        push.close()
        pull.close(linger=0)
        ctx.term()


def receive(pull, core: EngineCore, deltas: list) -> bool:
    """Handle every client message waiting on `pull` (deltas for refusals and aborts go to `deltas`); True
    after a Shutdown (every request aborted)."""
    import zmq

    stop = False
    while True:
        try:
            data = pull.recv(zmq.NOBLOCK)
        except zmq.Again:
            return stop
        try:
            msg = client_decoder.decode(data)
        except msgspec.ValidationError as e:  # a malformed message must not take the core down
            d = undecodable(data, e)
            if d is not None:
                deltas.append(d)
            continue
        d = None
        if isinstance(msg, AddRequest):
            d = core.add(msg)
        elif isinstance(msg, AbortRequest):
            d = core.abort(msg.request_id)
        elif isinstance(msg, Shutdown):
            stop = True
            for rid in list(core.engine.scheduler.requests):
                a = core.abort(rid)
                if a is not None:
                    deltas.append(a)
        if d is not None:
            deltas.append(d)


def undecodable(data: bytes, e: Exception) -> RequestDelta | None:
    """A client message that does not fit the protocol (a client bug): its request, if it names one, is
    refused with the decoding error; the core keeps serving."""
    log.error("undecodable client message: %s", e)
    try:
        raw = msgspec.msgpack.decode(data)
    except msgspec.DecodeError:
        return None
    if isinstance(raw, list) and len(raw) > 1 and raw[0] == "add" and isinstance(raw[1], str):
        return RequestDelta(raw[1], [], finished=True, error=ErrorInfo("RequestError", f"malformed request: {e}"))
    return None


def main(argv: list[str] | None = None) -> None:
    """`python -m linrnn_serve.engine.core IN_ADDR OUT_ADDR CONFIG_PICKLE LOG_LEVEL INTEGRITY` (core_client.py
    starts it; a fresh interpreter, so nothing of the server process is inherited or re-imported)."""
    import sys

    a = sys.argv[1:] if argv is None else argv
    with open(a[2], "rb") as f:
        config = pickle.load(f)
    run_engine_core(config, a[0], a[1], int(a[3]), a[4] == "1")


if __name__ == "__main__":
    main()
