"""MultiprocExecutor: tensor / expert parallel over N ranks (EngineConfig.tensor_parallel_size > 1).

Rank 0 is an in-process Worker of the engine core; ranks 1..N-1 are one spawned process each
(runner/worker_proc.py), joined in one torch.distributed group (NCCL on GPUs, rank r on cuda:r;
gloo on the CPU, over 127.0.0.1). Every rank runs the same start-up (worker_proc.start_up), then
every step the core sends the StepPlan to every worker and runs it on rank 0; every rank computes
the same full logits (the lm_head all-gathers) and samples the same tokens; rank 0's StepResult is
the step's result.

Single-GPU test mode (env LINRNN_TP_SINGLE_DEVICE=1 with a CUDA device): every rank on cuda:0, gloo
with CUDA tensors staged through the host, CUDA graphs off, each rank sizing its caches from a
1/N share of the GPU: the whole multi-process CUDA path (spawn, device selection, sharded loading,
the NVFP4 repack, the step loop) but NCCL itself runs on one GPU.

Diagnosis (runner/rank_watch.py): every rank logs its start-up stages with rank and time and keeps
a stage log in the dump directory (env LINRNN_TP_DUMP_DIR, default a fresh temporary folder, named
in the log); a rank busy without progress for LINRNN_TP_HANG_S seconds (default 300) dumps the
Python stacks of all ranks there and the engine fails with an error naming the rank and the stage.
NCCL runs with NCCL_DEBUG=WARN and a collective timeout that aborts instead of hanging
(parallel.NCCL_ENV_DEFAULTS; a value already set is kept).

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
import signal
import socket
import tempfile
import threading
import time
from multiprocessing.connection import wait

from linrnn_serve.engine.executor import Executor
from linrnn_serve.parallel import ParallelConfig, leave_process_group, set_nccl_env_defaults
from linrnn_serve.runner.plan import StepPlan, StepResult
from linrnn_serve.runner.rank_watch import DUMP_DIR_ENV, RankWatch, hang_seconds
from linrnn_serve.runner.worker_proc import HANG_EXIT_STATUS, WorkerSpec, build_worker, start_up, worker_main

log = logging.getLogger(__name__)

# a collective waiting on a vanished or stuck peer fails after this (NCCL: the c10d watchdog aborts;
# gloo fails at once when the peer's socket closes); longer than the default hang watch, which dumps first
GROUP_TIMEOUT_S = 600.0
START_TIMEOUT_S = 1800.0  # backstop per start-up message (the hang watch normally ends a stuck start first)
SINGLE_DEVICE_ENV = "LINRNN_TP_SINGLE_DEVICE"


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
        cuda = self.device.type == "cuda"
        single = cuda and os.environ.get(SINGLE_DEVICE_ENV, "0") not in ("", "0")
        if single:  # the multi-process CUDA path on one GPU: gloo over host copies, no graphs
            c = self.config = dataclasses.replace(c, enforce_eager=True)
        elif cuda:
            import torch

            if torch.cuda.device_count() < N:
                raise ValueError(f"--tensor-parallel-size {N} needs {N} GPUs, {torch.cuda.device_count()} visible "
                                 f"({SINGLE_DEVICE_ENV}=1 runs all ranks on one GPU for testing)")
        backend = "nccl" if cuda and not single else "gloo"
        if backend == "nccl":
            set_nccl_env_defaults()  # inherited by the spawned ranks
        dump_dir = os.environ.get(DUMP_DIR_ENV) or tempfile.mkdtemp(prefix="linrnn-tp-")
        os.makedirs(dump_dir, exist_ok=True)
        self.spec = WorkerSpec(
            c, self.model_config, self.model_dir, self.device.type, self.dtype, self.max_model_len, N,
            f"tcp://127.0.0.1:{_free_port()}", backend, GROUP_TIMEOUT_S, self.calibration_tokens,
            cpu_threads=max(1, (os.cpu_count() or 1) // N) if self.device.type == "cpu" else None,
            single_device=single, dump_dir=dump_dir, hang_s=hang_seconds())
        ctx = mp.get_context("spawn")
        self.procs: list[mp.Process] = []
        self.conns = []
        self._closing = False
        self._dead: str | None = None
        self._steps = 0
        log.info("tensor parallel: starting %s over %d %s ranks (%s%s); stage logs and stacks of a hang in %s",
                 self.parallel.describe(), N, self.device.type, backend, ", one GPU" if single else "", dump_dir)
        self._started: list[int] = []  # pids of the workers that answer SIGUSR1 (a stacks dump)
        self.watch = RankWatch(0, dump_dir, self.spec.hang_s, peers=lambda: list(self._started),
                               on_hang=self._on_hang, own_process=False)
        try:
            for rank in range(1, N):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(child, rank, self.spec), name=f"linrnn-tp-rank{rank}",
                                daemon=True)
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
            self.watch.stage(f"spawned ranks 1..{N - 1}: pids {' '.join(str(p.pid) for p in self.procs)}")
            self.watch.idle()  # importing takes what it takes on a cold machine; a death is seen at once
            for i in range(N - 1):  # every worker runs before rank 0 waits for it in the rendezvous
                self._started.append(self._recv(i, "started"))
            self.watch.busy("start-up")
            # a worker dying during start-up aborts rank 0's collectives at once (NCCL would wait on it)
            self._watcher = threading.Thread(target=self._watch, name="linrnn-tp-watch", daemon=True)
            self._watcher.start()
            self.worker = build_worker(self.spec, 0, self.progress, self.watch)
            start_up(self.worker, self.spec, self.watch, self._agree_budget)
            self.budget = self._agreed
            self.watch.stage("waiting for the other ranks to be ready")
            self.rank_info = [self.worker.describe()] + [self._recv(i, "ready") for i in range(N - 1)]
            self.watch.stage("all ranks ready")
            self.watch.idle()
        except BaseException as e:
            self.watch.stage(f"start-up failed: {type(e).__name__}: {e}")
            self.shutdown()
            raise
        log.info("tensor parallel: %s over %d %s ranks (%s); worker pids %s", self.parallel.describe(), N,
                 self.device.type, self.spec.backend, " ".join(str(p.pid) for p in self.procs))

    def _agree_budget(self, mine):
        """Rank 0's side of the budget exchange: every rank's, the minimum to all."""
        budgets = [mine] + [self._recv(i, "budget") for i in range(len(self.conns))]
        self._agreed = min(budgets, key=lambda b: (b.num_kv_blocks, b.num_state_slots))
        for conn in self.conns:
            conn.send(("budget", self._agreed))
        return self._agreed

    # ---- the seam ------------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        self.check_health()
        try:
            # the grammar-bitmask filler (structured output) is a host callback of the core: only rank 0, which
            # samples the tokens everyone continues from, applies it; the other ranks get the plain data
            sent = dataclasses.replace(plan, fill_bitmask=None) if plan.fill_bitmask is not None else plan
            self._steps += 1
            self.watch.busy(f"step {self._steps}")
            for conn in self.conns:
                conn.send(("execute", sent))
            result = self.worker.execute(plan)
            self.watch.idle()
            return result
        except WorkerDiedError:
            self.watch.idle()
            raise
        except Exception as e:  # a collective failed: which peer went away?
            self.watch.idle()
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
        self.check_health()
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
        try:  # never waits on a peer (NCCL: abort; every worker has exited by now)
            leave_process_group(self.spec.backend)
        except Exception as e:  # noqa: BLE001 -- best effort at exit
            log.warning("leaving the process group: %s: %s", type(e).__name__, e)
        self.watch.close()

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
            raise WorkerDiedError(f"tensor-parallel rank {i + 1} sent nothing for {START_TIMEOUT_S:.0f} s "
                                  f"(stage logs: {self.spec.dump_dir})")
        if self._dead:  # rank 0's hang watch ended it
            raise WorkerDiedError(self._dead)
        last = self._last_log_line(i + 1)
        raise WorkerDiedError(f"tensor-parallel rank {i + 1} exited (status {p.exitcode}) before '{want}'; its last "
                              f"stage: {last} (stage logs and stacks: {self.spec.dump_dir})")

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
                if p.exitcode == HANG_EXIT_STATUS:
                    err = f": {self._last_log_line(i + 1)}"
                self._dead = (f"tensor-parallel rank {i + 1} exited with status {p.exitcode}{err} "
                              f"(stage logs and stacks: {self.spec.dump_dir})")
                log.error("%s", self._dead)
                self._dump_all_stacks(f"TP rank 0 stacks: rank {i + 1} is gone")
                self._abort_collectives()
                return

    def _last_log_line(self, rank: int) -> str:
        try:
            with open(os.path.join(self.spec.dump_dir, f"rank{rank}.log")) as f:
                return f.read().strip().splitlines()[-1]
        except (OSError, IndexError):
            return "no stage log"

    def _dump_all_stacks(self, why: str) -> None:
        """Rank 0's Python stacks into its stacks file, and SIGUSR1 to the live workers (theirs)."""
        self.watch.dump_stacks(why)
        for p in self.procs:
            if p.is_alive() and p.pid in self._started:
                try:
                    os.kill(p.pid, signal.SIGUSR1)
                except OSError:
                    pass

    def _on_hang(self, reason: str) -> None:
        """Rank 0 made no progress (its stacks and the workers' are dumped): end the workers, so a
        collective rank 0 waits in is aborted and the engine raises WorkerDiedError; if the engine
        is still stuck a minute later, exit the process with the reason."""
        self._dead = self._dead or reason
        for p in self.procs:
            if p.is_alive():
                p.kill()
        self._abort_collectives()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._closing:
                return
            time.sleep(1.0)
        if not self._closing and self.watch.busy_since is not None:
            log.critical("%s; the engine is still stuck: exiting", reason)
            os._exit(HANG_EXIT_STATUS)

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
