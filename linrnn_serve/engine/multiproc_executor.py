"""MultiprocExecutor: tensor / expert parallel over N ranks (EngineConfig.tensor_parallel_size > 1).

Rank 0 is an in-process Worker of the engine core; ranks 1..N-1 are one spawned process each
(runner/worker_proc.py), joined in one torch.distributed group (NCCL on GPUs, rank r on cuda:r;
gloo on the CPU, over 127.0.0.1). Every step the core sends the StepPlan to every worker, then runs
it on rank 0; every rank computes the same full logits (the lm_head all-gathers) and samples the
same tokens; rank 0's StepResult is the step's result.

Failure: a worker that raises reports the error and exits; a worker that is killed closes its
sockets. A watcher thread notices (also between steps), and aborts an NCCL group so a collective in
flight raises (gloo raises by itself when the peer's socket closes; the group timeout is the
backstop); `execute` raises WorkerDiedError naming the rank and its exit status, and the engine
loop stops (the server answers 503, then exits).
"""
from __future__ import annotations

import dataclasses

import logging
import multiprocessing as mp
import os
import socket
import threading
import time
from multiprocessing.connection import wait

from linrnn_serve.engine.executor import Executor
from linrnn_serve.parallel import ParallelConfig
from linrnn_serve.runner.plan import StepPlan, StepResult
from linrnn_serve.runner.worker_proc import WorkerSpec, build_worker, worker_main

log = logging.getLogger(__name__)

GROUP_TIMEOUT_S = 120.0  # a collective waiting on a vanished peer fails after this (NCCL; gloo fails at once)
START_TIMEOUT_S = 600.0  # loading a shard + profiling + capturing graphs, per message


class WorkerDiedError(RuntimeError):
    """A tensor-parallel worker process exited or failed; the engine cannot go on."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocExecutor(Executor):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        c = self.config
        N = c.tensor_parallel_size
        self.parallel = ParallelConfig(N, c.enable_expert_parallel)
        if self.device.type == "cuda":
            import torch

            if torch.cuda.device_count() < N:
                raise ValueError(f"--tensor-parallel-size {N} needs {N} GPUs, {torch.cuda.device_count()} visible")
        self.spec = WorkerSpec(
            c, self.model_config, self.model_dir, self.device.type, self.dtype, self.max_model_len, N,
            f"tcp://127.0.0.1:{_free_port()}", "nccl" if self.device.type == "cuda" else "gloo", GROUP_TIMEOUT_S,
            self.calibration_tokens,
            cpu_threads=max(1, (os.cpu_count() or 1) // N) if self.device.type == "cpu" else None)
        ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        self.conns = []
        self._closing = False
        self._dead: str | None = None
        try:
            for rank in range(1, N):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(child, rank, self.spec), name=f"linrnn-tp-rank{rank}",
                                daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self.worker = build_worker(self.spec, 0, self.progress)
            self.worker.load_model(self.calibration_tokens)
            budgets = [self.worker.determine_budget()] + [self._recv(i, "budget") for i in range(N - 1)]
            self.budget = min(budgets, key=lambda b: (b.num_kv_blocks, b.num_state_slots))
            for conn in self.conns:
                conn.send(("budget", self.budget))
            self.worker.init_caches(self.budget)
            self.worker.capture_graphs()
            self.rank_info = [self.worker.describe()] + [self._recv(i, "ready") for i in range(N - 1)]
        except BaseException:
            self.shutdown()
            raise
        self._watcher = threading.Thread(target=self._watch, name="linrnn-tp-watch", daemon=True)
        self._watcher.start()
        log.info("tensor parallel: %s over %d %s ranks (%s); worker pids %s", self.parallel.describe(), N,
                 self.device.type, self.spec.backend, " ".join(str(p.pid) for p in self.procs))

    # ---- the seam ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        self.check_health()
        try:
            # the grammar-bitmask filler (structured output) is a host callback of the core: only rank 0, which
            # samples the tokens everyone continues from, applies it; the other ranks get the plain data
            sent = dataclasses.replace(plan, fill_bitmask=None) if plan.fill_bitmask is not None else plan
            for conn in self.conns:
                conn.send(("execute", sent))
            return self.worker.execute(plan)
        except WorkerDiedError:
            raise
        except Exception as e:  # a collective failed: which peer went away?
            time.sleep(0.2)
            self._poll_dead()
            if self._dead:
                raise WorkerDiedError(self._dead) from e
            raise

    def describe(self) -> dict:
        d = dict(self.worker.describe())
        d["parallel"] = self.parallel.describe()
        d["tensor_parallel_size"] = self.parallel.tensor_parallel_size
        d["expert_parallel"] = self.parallel.enable_expert_parallel
        d["comm_backend"] = self.spec.backend
        return d

    def check_health(self) -> None:
        self._poll_dead()
        if self._dead:
            raise WorkerDiedError(self._dead)

    def set_comm_timing(self, on: bool) -> None:
        """Time every collective (benchmarks): every rank decodes eagerly meanwhile and rank 0
        synchronises around each collective (runner/worker.py)."""
        for i in range(len(self.conns)):
            self._call(i, "set_comm_timing", on)
        self.worker.set_comm_timing(on)

    def comm_stats(self):
        """Rank 0's collective statistics since set_comm_timing(True)."""
        return self.worker.shard.comm.stats

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        for conn in self.conns:
            try:
                conn.send(("shutdown",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            p.join(max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(5)
        import torch.distributed as dist

        if dist.is_initialized():
            if self._dead:  # a dead peer: do not wait on it in a collective teardown
                return
            try:
                dist.destroy_process_group()
            except Exception:  # pragma: no cover - best effort at exit
                pass

    # ---- internals -----------------------------------------------------------------------------
    def _recv(self, i: int, want: str):
        """The next message of worker i+1, failing fast if it dies or reports an error."""
        conn, p = self.conns[i], self.procs[i]
        ready = wait([conn, p.sentinel], START_TIMEOUT_S)
        if conn in ready:
            try:
                msg = conn.recv()
            except EOFError:
                msg = None
            if msg is not None and msg[0] == want:
                return msg[1]
            if msg is not None and msg[0] == "error":
                raise WorkerDiedError(f"tensor-parallel worker {msg[1]}")
        p.join(1)
        if not ready:
            raise WorkerDiedError(f"tensor-parallel rank {i + 1} sent nothing for {START_TIMEOUT_S:.0f} s")
        raise WorkerDiedError(f"tensor-parallel rank {i + 1} exited (status {p.exitcode}) before '{want}'")

    def _call(self, i: int, method: str, *args):
        self.conns[i].send(("call", method, args))
        return self._recv(i, "ok")

    def _poll_dead(self) -> None:
        if self._dead or self._closing:
            return
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                err = ""
                if self.conns[i].poll():
                    try:
                        msg = self.conns[i].recv()
                        err = f": {msg[1]}" if msg[0] == "error" else ""
                    except (EOFError, OSError):
                        pass
                self._dead = f"tensor-parallel rank {i + 1} exited with status {p.exitcode}{err}"
                log.error("%s", self._dead)
                self._abort_collectives()
                return

    def _abort_collectives(self) -> None:
        """NCCL waits on a vanished peer until the group timeout: abort the group so a collective in
        flight on rank 0 raises now (gloo already raises when the peer's socket closes)."""
        if self.spec.backend != "nccl":
            return
        try:
            from torch.distributed.distributed_c10d import _abort_process_group

            _abort_process_group()
        except Exception as e:  # noqa: BLE001 -- private API: the group timeout remains the backstop
            log.warning("could not abort the NCCL group (%s); collectives end at the %d s timeout", e,
                        GROUP_TIMEOUT_S)

    def _watch(self) -> None:
        """Notice a dead worker while the engine is idle (so health checks say so before a step)."""
        while not self._closing and not self._dead:
            wait([p.sentinel for p in self.procs], 0.5)
            self._poll_dead()


__all__ = ["MultiprocExecutor", "WorkerDiedError"]
