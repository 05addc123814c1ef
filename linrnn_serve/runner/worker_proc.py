"""The body of one tensor-parallel worker process (ranks 1..N-1; rank 0 is the engine core's own
in-process Worker). Started by engine/multiproc_executor.py with the spawn method.

Protocol on the process's Pipe (plain picklable data):
    worker -> core   ("budget", CacheBudget)        after loading its shard
    core -> worker   ("budget", CacheBudget)        the one every rank uses (the minimum)
    worker -> core   ("ready", describe dict)       caches allocated, graphs captured
    core -> worker   ("execute", StepPlan)          every step: the same plan every rank runs
    core -> worker   ("call", method, args)         rare queries (describe, comm stats); replies ("ok", value)
    core -> worker   ("shutdown",)
    worker -> core   ("error", message)             then the process exits with status 1
A closed pipe (the core is gone) ends the worker too. Any exception ends the process at once
(os._exit): the peers' collectives then fail fast instead of waiting on a rank that will never come.
"""
from __future__ import annotations

import logging
import os
import traceback
from dataclasses import dataclass

import torch

from linrnn_serve.config import EngineConfig, ModelConfig
from linrnn_serve.parallel import Shard, init_process_group
from linrnn_serve.runner.worker import Worker

log = logging.getLogger(__name__)


@dataclass
class WorkerSpec:
    """What a worker process needs to build its Worker (plain data)."""

    config: EngineConfig
    model_config: ModelConfig
    model_dir: str | None
    device_type: str  # "cuda" | "cpu"; rank r uses cuda:r
    dtype: torch.dtype
    max_model_len: int
    world_size: int
    init_method: str
    backend: str
    timeout_s: float
    calibration_tokens: list[int] | None = None
    cpu_threads: int | None = None


def rank_device(device_type: str, rank: int) -> torch.device:
    return torch.device(f"cuda:{rank}") if device_type == "cuda" else torch.device("cpu")


def build_worker(spec: WorkerSpec, rank: int, progress: bool) -> Worker:
    """Join the group and build this rank's Worker (not loaded yet)."""
    device = rank_device(spec.device_type, rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    comm = init_process_group(rank, spec.world_size, spec.init_method, spec.backend, spec.timeout_s,
                              device if device.type == "cuda" else None)
    shard = Shard(rank, spec.world_size, spec.config.enable_expert_parallel, comm)
    return Worker(spec.config, spec.model_config, spec.model_dir, device, spec.dtype, spec.max_model_len,
                  progress=progress, shard=shard)


def worker_main(conn, rank: int, spec: WorkerSpec) -> None:
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    if spec.cpu_threads:
        torch.set_num_threads(spec.cpu_threads)
    try:
        w = build_worker(spec, rank, progress=False)
        w.load_model(spec.calibration_tokens)
        conn.send(("budget", w.determine_budget()))
        kind, budget = conn.recv()
        w.init_caches(budget)
        w.capture_graphs()
        conn.send(("ready", w.describe()))
        while True:
            msg = conn.recv()
            if msg[0] == "execute":
                w.execute(msg[1])
            elif msg[0] == "call":
                conn.send(("ok", _call(w, msg[1], msg[2])))
            elif msg[0] == "shutdown":
                break
        _close()
    except EOFError:  # the engine core is gone
        os._exit(0)
    except BaseException as e:  # noqa: BLE001 -- report, then leave without waiting on any peer
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


def _close() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


__all__ = ["WorkerSpec", "worker_main", "build_worker", "rank_device"]
