"""AsyncMPClient: the API server's handle on an engine core running in its own process.

    client = AsyncMPClient(EngineConfig(model="default"))   # spawns the core, waits until it is ready
    client = start_engine_client(config)   # the same, or in process with LINRNN_ENABLE_MULTIPROCESSING=0
    async for out in client.generate(prompt_ids, params, request_id):   # cumulative RequestOutputs
        ...
    await client.abort(request_id); client.stats(); client.is_running; await client.shutdown()

Same surface as the in-process AsyncLLMEngine (generate / abort / stats / tokenizer / shutdown), so the
server does not care which one it gets. Over ZeroMQ (ipc) with msgspec messages (engine/protocol.py):
requests go in, one StepOutputs message per engine step comes back.

This process (the API server's) never imports torch, the runner or the caches. It detokenizes:
a receiver thread decodes each step's message, appends every request's new tokens to its state and
runs its incremental detokenizer, then wakes the waiting consumers with one event-loop callback per
step. A consumer reads the newest cumulative output only (a slow consumer skips intermediate ones).

If the core process dies (killed, crashed, failed step) a watchdog thread sees its exit at once
(the process sentinel): every open stream ends with EngineDeadError (HTTP 503), new requests are
refused with it, and `is_running` turns False (so /health answers 503).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from typing import AsyncIterator

import zmq

from linrnn_serve.config import EngineConfig
from linrnn_serve.engine.errors import EngineDeadError, RequestError
from linrnn_serve.engine.outputs import RequestOutput
from linrnn_serve.engine.protocol import AbortRequest, AddRequest, Shutdown, encoder, outputs_decoder
from linrnn_serve.engine.request_state import RequestState, deliver, fail_all, outputs, rebuild_error
from linrnn_serve.engine.tokenizer import Tokenizer
from linrnn_serve.sampling_params import SamplingParams

log = logging.getLogger(__name__)

MULTIPROCESSING_ENV = "LINRNN_ENABLE_MULTIPROCESSING"  # 0: the core in the server's process (vLLM's
# VLLM_ENABLE_V1_MULTIPROCESSING=0 is read too), for debugging with one process


def core_in_own_process() -> bool:
    v = os.environ.get(MULTIPROCESSING_ENV, os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1"))
    return v.strip().lower() not in ("0", "false", "no", "off")


def start_engine_client(config: EngineConfig, log_level: int | None = None):
    """What the API server talks to: an AsyncMPClient (the engine core in its own process) by default,
    the in-process AsyncLLMEngine (a step-loop thread) with LINRNN_ENABLE_MULTIPROCESSING=0."""
    if core_in_own_process():
        return AsyncMPClient(config, log_level=log_level)
    from linrnn_serve.engine.async_engine import AsyncLLMEngine  # imports torch and the model

    log.info("%s=0: the engine core runs in this process", MULTIPROCESSING_ENV)
    return AsyncLLMEngine.from_config(config)


class AsyncMPClient:
    def __init__(self, config: EngineConfig, log_level: int | None = None, idle_integrity_check: bool = True):
        self._sockdir = tempfile.mkdtemp(prefix="linrnn-core-")
        in_addr, out_addr = f"ipc://{self._sockdir}/in", f"ipc://{self._sockdir}/out"
        self._ctx = zmq.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.bind(out_addr)
        self._send_lock = threading.Lock()
        self._states: dict[str, RequestState] = {}
        self._lock = threading.Lock()
        self._dead: BaseException | None = None
        self._stopping = False
        self._stats: dict = {}
        self._last_recv = 0.0
        self._ids = itertools.count()
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        cfg_path = os.path.join(self._sockdir, "config.pkl")
        with open(cfg_path, "wb") as f:
            pickle.dump(config, f)
        # a fresh interpreter (not multiprocessing): nothing of this process is inherited or re-imported
        # its own process group (not session: the kernel's CPU autogroups are per session): a terminal's
        # Ctrl-C reaches only this process, which then shuts the core down gracefully (in-flight requests
        # may finish); the core exits by itself if this process dies
        self.proc = subprocess.Popen([sys.executable, "-m", "linrnn_serve.engine.core", in_addr, out_addr, cfg_path,
                                      str(level), "1" if idle_integrity_check else "0"], process_group=0)
        try:
            facts = self._handshake()
        except BaseException:  # start-up failed or was interrupted (Ctrl-C): no orphaned core
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            raise
        self.config: EngineConfig = facts["config"]
        self.model_config = facts["model_config"]
        self.model_name: str = facts["model_name"]
        self.max_model_len: int = facts["max_model_len"]
        self.eos_token_ids: list[int] = facts["eos_token_ids"]
        self.kv_capacity_tokens: int = facts["kv_capacity_tokens"]
        self.core_description: dict = facts["describe"]
        self.default_sampling_params: dict = facts["default_sampling_params"]
        d = facts["tokenizer_dir"]
        self.tokenizer = Tokenizer.from_dir(d, self.model_config.eos_token_id) if d else None
        self._receiver = threading.Thread(target=self._receive, name="linrnn-core-receiver", daemon=True)
        self._receiver.start()
        self._watchdog = threading.Thread(target=self._watch, name="linrnn-core-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def from_config(cls, config: EngineConfig, **kwargs) -> "AsyncMPClient":
        return cls(config, **kwargs)

    def _handshake(self) -> dict:
        """Wait for the core's ready message (model loading may take minutes); its start-up error, if any."""
        while True:
            if self._pull.poll(200):
                msg = pickle.loads(self._pull.recv())
                if "error" in msg:
                    try:
                        self.proc.wait(10)
                    except subprocess.TimeoutExpired:
                        self.proc.kill()
                        self.proc.wait()
                    self._close_sockets()
                    e = rebuild_error(msg["error"])
                    raise (e if isinstance(e, (ValueError, RuntimeError)) else RuntimeError(str(e)))
                return msg
            if self.proc.poll() is not None:
                self._close_sockets()
                raise RuntimeError(f"the engine core process exited during start-up (exit code "
                                   f"{self.proc.returncode}); its log is above")

    # ---- what the server reads ---------------------------------------------------------------
    @property
    def is_running(self) -> bool:
        return self._dead is None and not self._stopping and self.proc.poll() is None

    def stats(self) -> dict:
        s = dict(self._stats)
        s["engine_running"] = self.is_running
        return s

    # ---- requests ------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        if not self.is_running:
            raise self._dead_error()
        params = params if params is not None else SamplingParams()
        text, ids = self._tokenize(prompt)  # the core validates the request (engine/validation.py)
        st = RequestState(asyncio.get_running_loop(), request_id, text, ids, params, time.monotonic(),
                          self.tokenizer)
        with self._lock:
            if request_id in self._states:
                raise RequestError(f"request id {request_id!r} is already in use", "request_id")
            self._states[request_id] = st
        finished = False
        try:
            if self._dead is not None:  # died between the check above and the registration
                raise self._dead_error()
            self._send(AddRequest(request_id, ids, params, st.arrival_time, text))
            async for out in outputs(st):
                finished = out.finished
                yield out
        except BaseException:
            finished = finished or st.error is not None  # a refused / failed request: nothing to abort
            raise
        finally:
            with self._lock:
                if self._states.get(request_id) is st:
                    del self._states[request_id]
            if not finished and self._dead is None:
                self._send(AbortRequest(request_id))

    async def abort(self, request_id: str) -> None:
        if self._dead is None:
            self._send(AbortRequest(request_id))

    def _tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer: give the prompt as token ids", "prompt")
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def _send(self, msg) -> None:
        data = encoder.encode(msg)
        with self._send_lock:
            try:
                self._push.send(data, zmq.NOBLOCK)
            except zmq.Again:  # the core is not reading (dead or stuck): refuse rather than block
                raise EngineDeadError("the engine core is not accepting requests") from None
            except zmq.ZMQError as e:
                raise EngineDeadError(f"the engine core channel is closed ({e})") from None

    def _dead_error(self) -> EngineDeadError:
        if self._dead is not None:
            return EngineDeadError(str(self._dead))
        return EngineDeadError("the engine is shutting down")

    # ---- background threads --------------------------------------------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        while self._dead is None:
            try:
                if not poller.poll(100):
                    continue
                msg = outputs_decoder.decode(self._pull.recv())
            except zmq.ZMQError:  # closed by shutdown
                return
            self._last_recv = time.monotonic()
            if msg.stats is not None:
                self._stats = msg.stats
            deliver(self._states, msg)
            if msg.dead is not None:
                self._on_death(f"the engine core failed: {msg.dead.kind}: {msg.dead.message}")
                return

    def _watch(self) -> None:
        code = self.proc.wait()
        if not self._stopping:
            self._on_death(f"the engine core process exited (exit code {code})")

    def _on_death(self, why: str, quiet: bool = False) -> None:
        if self._dead is not None:
            return
        log.log(logging.INFO if quiet else logging.ERROR, "%s", why)
        self._dead = EngineDeadError(why)
        with self._lock:
            states = list(self._states.values())
        fail_all(states, EngineDeadError(why))

    # ---- shutdown ------------------------------------------------------------------------------
    async def shutdown(self, mode: str = "abort", timeout: float = 30.0) -> None:
        """Refuse new requests; 'finish' lets in-flight requests run (up to timeout); then the core
        aborts the rest (their streams end with finish_reason 'abort') and exits."""
        if mode not in ("abort", "finish"):
            raise ValueError(f"shutdown mode must be 'abort' or 'finish', got {mode!r}")
        deadline = time.monotonic() + timeout
        self._stopping = True
        if mode == "finish":
            while time.monotonic() < deadline and self._states and self._dead is None:
                await asyncio.sleep(0.02)
        await asyncio.to_thread(self.shutdown_sync, max(1.0, deadline - time.monotonic()))

    def shutdown_sync(self, timeout: float = 30.0) -> None:
        self._stopping = True
        if self.proc.poll() is None and self._dead is None:
            try:
                self._send(Shutdown())
            except EngineDeadError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        deadline = time.monotonic() + 1.0  # let the receiver hand over the core's last (abort) deltas
        while self._dead is None and time.monotonic() < deadline and time.monotonic() - self._last_recv < 0.2:
            time.sleep(0.02)
        self._on_death("the engine was shut down", quiet=True)
        self._receiver.join(2)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._push, self._pull):
            s.close(linger=0)
        self._ctx.term()
        for name in ("in", "out", "config.pkl"):
            try:
                os.unlink(os.path.join(self._sockdir, name))
            except OSError:
                pass
        try:
            os.rmdir(self._sockdir)
        except OSError:
            pass
