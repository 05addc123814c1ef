"""The body of one tensor-parallel worker process (ranks 1..N-1; rank 0 is the engine core's own
in-process Worker), and the start-up sequence every rank runs. Started by
engine/multiproc_executor.py with the spawn method.

Start-up, the same on every rank (`start_up`), each stage logged with rank and time (rank_watch.py):
    pick the device (torch.cuda.set_device before anything touches CUDA) -> join the group (NCCL
    bound to the rank's device) -> load this rank's shard -> warm up and check the collectives ->
    measure the budget -> agree on one budget (the minimum) -> allocate caches -> capture graphs
Every rank issues the same collectives in the same order: the profile run and the graph capture
run the same shapes everywhere, and a failure of either on one rank is fatal (a rank that went on
eagerly while the others captured would leave them waiting in a collective).

Protocol on the process's Pipe (plain picklable data):
    worker -> core   ("started", pid)               first thing (a worker that cannot even start fails fast)
    worker -> core   ("budget", CacheBudget)        after loading its shard
    core -> worker   ("budget", CacheBudget)        the one every rank uses (the minimum)
    worker -> core   ("ready", describe dict)       caches allocated, graphs captured
    core -> worker   ("execute", StepPlan)          every step: the same plan every rank runs
    core -> worker   ("call", method, args)         rare queries (describe, comm stats); replies ("ok", value)
    core -> worker   ("shutdown",)
    worker -> core   ("error", message)             then the process exits with status 1
A closed pipe (the core is gone) ends the worker too. Any exception ends the process at once
(os._exit): the peers' collectives then fail fast instead of waiting on a rank that will never come.
A worker that makes no progress for `hang_s` while busy dumps its stacks and exits with status 3.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass
from typing import Callable

import torch

from linrnn_serve.cache.budget import CacheBudget
from linrnn_serve.config import EngineConfig, ModelConfig
from linrnn_serve.parallel import Shard, init_process_group, leave_process_group
from linrnn_serve.runner.rank_watch import DEFAULT_HANG_S, RankWatch
from linrnn_serve.runner.worker import Worker

log = logging.getLogger(__name__)

HANG_EXIT_STATUS = 3


@dataclass
class WorkerSpec:
    """What a worker process needs to build its Worker (plain data)."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: str | None
    device_type: str  # "cuda" | "cpu"; rank r uses cuda:r (cuda:0 for all with single_device)
    dtype: torch.dtype
    max_model_len: int
    world_size: int
    init_method: str
    backend: str
    timeout_s: float
    calibration_tokens: list[int] | None = None
    cpu_threads: int | None = None
    # every rank on cuda:0 (gloo over host copies, no CUDA graphs): the multi-process CUDA path on one GPU
    single_device: bool = False
    dump_dir: str = "/tmp"  # the ranks' stage logs and stacks (rank_watch.py)
    hang_s: float = DEFAULT_HANG_S


def rank_device(spec: WorkerSpec, rank: int) -> torch.device:
    if spec.device_type != "cuda":
        return torch.device("cpu")
    return torch.device("cuda:0" if spec.single_device else f"cuda:{rank}")


def build_worker(spec: WorkerSpec, rank: int, progress: bool, watch: RankWatch) -> Worker:
    """Select the device, join the group and build this rank's Worker (not loaded yet)."""
    device = rank_device(spec, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before the group: NCCL and every default allocation use it
    watch.stage(f"joining the {spec.backend} group of {spec.world_size} on {device} ({spec.init_method})")
    comm = init_process_group(rank, spec.world_size, spec.init_method, spec.backend, spec.timeout_s,
                              device if device.type == "cuda" else None)
    watch.stage("group joined")
    shard = Shard(rank, spec.world_size, spec.config.enable_expert_parallel, comm)
    return Worker(spec.config, spec.model_config, spec.model_dir, device, spec.dtype, spec.max_model_len,
                  progress=progress, shard=shard, device_share=spec.world_size if spec.single_device else 1)


def start_up(w: Worker, spec: WorkerSpec, watch: RankWatch, agree: Callable[[CacheBudget], CacheBudget]) -> None:
    """Load, check the collectives, agree on the cache budget (`agree`: this rank's -> everyone's),
    allocate the caches and capture the graphs, logging each stage."""
    w.note = watch.note
    watch.stage("loading weights (this rank's shard)")
    w.load_model(spec.calibration_tokens)
    watch.stage(f"weights loaded: {w.weight_bytes / (1 << 30):.2f} GiB in {w.weights_seconds:.1f} s; "
                f"checking the collectives")
    dt = w.shard.comm.warm_up(w.device)
    watch.stage(f"collectives checked ({dt * 1e3:.1f} ms); measuring the cache budget")
    mine = w.determine_budget()
    watch.stage(f"budget {mine.num_state_slots} state slots / {mine.num_kv_blocks} KV blocks; agreeing")
    budget = agree(mine)
    watch.stage(f"allocating caches ({budget.num_state_slots} state slots, {budget.num_kv_blocks} KV blocks)")
    w.init_caches(budget)
    watch.stage("capturing CUDA graphs" if w.device.type == "cuda" and not w.config.enforce_eager
                else "no CUDA graphs")
    w.capture_graphs()
    d = w.describe()
    watch.stage(f"ready ({d['num_graphs']} CUDA graphs in {d['graph_capture_seconds']:.1f} s)")


def worker_main(conn, rank: int, spec: WorkerSpec) -> None:
    watch = RankWatch(rank, spec.dump_dir, spec.hang_s, peers=lambda: [os.getppid()])
    # imported, running and answering SIGUSR1 with its stacks: the core joins the group only after this
    conn.send(("started", os.getpid()))
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    logging.getLogger("linrnn_serve.tp").setLevel(logging.INFO)  # the start-up stages of every rank
    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    try:
        w = build_worker(spec, rank, False, watch)

        def agree(mine: CacheBudget) -> CacheBudget:
            conn.send(("budget", mine))
            watch.idle()  # waiting on the core (which watches itself)
            kind, budget = conn.recv()
            watch.busy("start-up")
            return budget

        start_up(w, spec, watch, agree)
        conn.send(("ready", w.describe()))
        watch.idle()
        steps = 0
        while True:
            msg = conn.recv()
            if msg[0] == "execute":
                steps += 1
                watch.busy(f"step {steps}")
                w.execute(msg[1])
                watch.idle()
            elif msg[0] == "call":
                watch.busy(f"call {msg[1]}")
                conn.send(("ok", _call(w, msg[1], msg[2])))
                watch.idle()
            elif msg[0] == "shutdown":
                break
        watch.stage("shutting down")
        leave_process_group(spec.backend)
    except EOFError:  # the engine core is gone
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 -- report, then leave without waiting on any peer
        watch.stage(f"failed: {type(e).__name__}: {e}")
        try:
            conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"))
        except Exception:
            pass
        os._exit(1)
    os._exit(0)


def _call(w: Worker, method: str, args: tuple):
    if method == "describe":
        return w.describe()
    if method == "comm_stats":
        comm = w.shard.comm
        return comm.stats if comm is not None else None
    if method == "set_comm_timing":
        w.set_comm_timing(bool(args[0]))
        return None
    raise ValueError(f"unknown worker call {method!r}")


__all__ = ["WorkerSpec", "worker_main", "build_worker", "start_up", "rank_device", "HANG_EXIT_STATUS"]
