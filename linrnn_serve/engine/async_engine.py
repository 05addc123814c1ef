"""AsyncLLMEngine: the engine core in a thread of this process (LINRNN_ENABLE_MULTIPROCESSING=0, debugging).

The EngineCore step loop (engine/core.py) runs in one background thread. The asyncio side talks to it
only through a command queue (add / abort) and per-request states (engine/request_state.py), the same
as AsyncMPClient's with the core in its own process:

    async for out in engine.generate(prompt, params, request_id):   # cumulative RequestOutputs
        ...                                                         # the last has finished=True
    await engine.abort(request_id)

Each step hands over per-request deltas (new tokens only: O(new tokens) per step); the consumer's
state detokenizes them and builds a cumulative output only when the consumer reads, so a slow
consumer skips intermediate ones. Leaving the `async for` early (client gone, task cancelled) aborts
the request. The request is validated (engine/validation.py) in the caller before anything is queued,
so `generate` raises RequestError (SamplingParamError, PromptTooLongError, ...) / EngineFullError at its
first iteration.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from typing import AsyncIterator

from linrnn_serve.config import EngineConfig
from linrnn_serve.engine_args import EngineArgs
from linrnn_serve.engine.core import EngineCore
from linrnn_serve.engine.errors import EngineDeadError, EngineFullError, RequestError
from linrnn_serve.engine.llm_engine import LLMEngine
from linrnn_serve.engine.outputs import RequestOutput
from linrnn_serve.engine.protocol import StepOutputs
from linrnn_serve.engine.request_state import RequestState, deliver, fail_all, outputs
from linrnn_serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_integrity_check: bool = True):
        self.engine = engine
        engine.detokenize_all = False  # the consumers' states detokenize (the engine: only for stop strings)
        self.core = EngineCore(engine)
        self.idle_integrity_check = idle_integrity_check
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._pending_adds = 0
        self._wake = threading.Event()
        self._stopping = False  # refuse new requests
        self._stop = False  # leave the loop once the command queue is drained
        self._dead: BaseException | None = None
        self._checked_idle = True
        self.integrity_failures = 0
        self._thread = threading.Thread(target=self._loop, name="linrnn-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> "AsyncLLMEngine":
        return cls(LLMEngine(config, progress=progress))

    @classmethod
    def from_engine_args(cls, model: str, progress: bool = True, **kwargs) -> "AsyncLLMEngine":
        return cls.from_config(EngineArgs(model=model, **kwargs).create_engine_config(), progress=progress)

    # ---- what the server reads ---------------------------------------------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def model_config(self):
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def default_sampling_params(self) -> dict:
        return self.engine.default_sampling_params

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def dead(self) -> BaseException | None:
        """Why the engine loop stopped on its own (an error, a lost worker); None while it runs or
        after a requested shutdown."""
        return self._dead

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    def stats(self) -> dict:
        for attempt in range(4):  # the engine thread may mutate a container mid-read: just retry
            try:
                s = self.engine.stats()
                break
            except RuntimeError:
                if attempt == 3:
                    raise
                time.sleep(0)
        s["integrity_failures_total"] = self.integrity_failures
        s["engine_running"] = self.is_running
        return s

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if self._dead is not None or self._stopping:
            raise EngineDeadError("the engine is shutting down" if self._dead is None else
                                  f"the engine loop stopped: {self._dead!r}")
        params = params if params is not None else SamplingParams()
        eng = self.engine
        text, ids = eng.tokenize_prompt(prompt)
        ids = eng.validate_request(ids, params)  # may compile a grammar (engine/validation.py)
        st = RequestState(asyncio.get_running_loop(), request_id, text, ids, params, time.monotonic(),
                          eng.tokenizer)
        with self._lock:
            if request_id in self._streams:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            if eng.scheduler.num_waiting_requests + self._pending_adds >= eng.config.max_queue_len:
                raise EngineFullError(f"the waiting queue is full ({eng.config.max_queue_len} requests); retry later")
            self._streams[request_id] = st
            self._pending_adds += 1
        self._cmds.put(("add", request_id, text, ids, params, st.arrival_time))
        self._wake.set()
        finished = False
        try:
            async for out in outputs(st):
                finished = out.finished
                yield out
        except BaseException:
            finished = finished or st.error is not None  # refused / failed: nothing to abort
            raise
        finally:
            if not finished:
                self._cmds.put(("abort", request_id))
                self._wake.set()
            with self._lock:
                if self._streams.get(request_id) is st:
                    del self._streams[request_id]

    async def abort(self, request_id: str) -> None:
        self._cmds.put(("abort", request_id))
        self._wake.set()

    async def shutdown(self, mode: str = "abort", timeout: float = 30.0) -> None:
        """Stop: refuse new requests; 'finish' lets in-flight requests run (up to timeout), then the
        rest are aborted (their streams end with finish_reason 'abort') and the loop exits."""
        if mode not in ("abort", "finish"):
            raise ValueError(f"shutdown mode must be 'abort' or 'finish', got {mode!r}")
        self._stopping = True
        deadline = time.monotonic() + timeout
        if mode == "finish":
            while time.monotonic() < deadline and self._thread.is_alive() and (
                    self.engine.has_unfinished_requests() or self._pending_adds):
                await asyncio.sleep(0.02)
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._cmds.put(("abort", rid))
        self._stop = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, max(1.0, deadline - time.monotonic()))

    def shutdown_sync(self, timeout: float = 30.0) -> None:
        """Abort everything and stop the loop from synchronous code."""
        self._stopping = True
        with self._lock:
            ids = list(self._streams)
        for rid in ids:
            self._cmds.put(("abort", rid))
        self._stop = True
        self._wake.set()
        self._thread.join(timeout)

    # ---- the engine thread ---------------------------------------------------------------------
    def _loop(self) -> None:
        eng = self.engine
        try:
            while True:
                self._drain()
                if eng.has_unfinished_requests():
                    self._checked_idle = False
                    self._deliver(self.core.step())
                    continue
                if self._stop:
                    break
                eng.check_health()  # a lost tensor-parallel worker stops the loop even while idle
                if not self._checked_idle:
                    self._checked_idle = True
                    if self.idle_integrity_check:
                        try:
                            eng.check_integrity()
                        except RuntimeError:  # a bookkeeping bug: loud, but keep serving
                            log.exception("idle integrity check failed")
                            self.integrity_failures += 1
                self._wake.wait(0.1)
                self._wake.clear()
        except BaseException as e:  # noqa: BLE001 -- every waiting client must hear about it
            log.exception("engine loop failed")
            self._dead = e
            with self._lock:
                states = list(self._streams.values())
            fail_all(states, EngineDeadError(f"the engine loop failed: {e!r}"))
        finally:
            self._stopping = True
            try:
                eng.shutdown()
            except Exception:  # noqa: BLE001 -- best effort: the loop is ending anyway
                log.exception("engine shutdown failed")

    def _drain(self) -> None:
        eng = self.engine
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, text, ids, params, arrival = cmd
                with self._lock:
                    self._pending_adds -= 1
                    live = rid in self._streams
                if not live:  # the client left before we got to it
                    continue
                try:
                    self.core.track(eng.add_validated_request(rid, text, ids, params, arrival), ids)
                except Exception as e:  # raced past the caller-side checks (e.g. queue filled up)
                    with self._lock:
                        st = self._streams.get(rid)
                    if st is not None:
                        fail_all([st], e)
            elif cmd[0] == "abort":
                d = self.core.abort(cmd[1])
                if d is not None:
                    self._deliver(StepOutputs([d]))

    def _deliver(self, out: StepOutputs) -> None:
        """One step's outputs to their consumers' states (the lock: consumers register and leave meanwhile)."""
        with self._lock:
            deliver(self._streams, out)
