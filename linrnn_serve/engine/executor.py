"""Executor: the engine core's one handle on its workers (the Executor / Worker seam).

The engine core (scheduler + step loop, engine/llm_engine.py) decides *who* runs; an Executor makes
its workers (runner/worker.py, one per device) run it. The core only ever calls:

    ex = Executor.create(config, model_config, model_dir, device, dtype, max_model_len, ...)
    ex.budget                   # CacheBudget every worker holds (sizes the scheduler's allocators)
    ex.execute(plan)            # StepPlan -> StepResult (sampled ids of rank 0 / the driver worker)
    ex.execute_async(plan)      # launch; .result() -> StepResult later (ex.supports_async: overlapped steps)
    ex.describe()               # plain dict for logs and `LLMEngine.describe()`
    ex.check_health()           # raises if a worker is gone
    ex.shutdown()

Everything crossing the seam is plain data (EngineConfig, ModelConfig, CacheBudget, StepPlan,
StepResult, dicts), so an executor may keep its workers in other processes. Set-up order per
worker: load_model -> determine_budget -> (executor agrees on one budget: the minimum over ranks)
-> init_caches(budget) -> capture_graphs.

    UniProcExecutor   one in-process Worker (one GPU, or the CPU): the default
    MultiprocExecutor tensor / expert parallel (engine/multiproc_executor.py): rank 0 in process,
                      one Worker process per further GPU (or CPU rank); every rank gets the same
                      StepPlan, rank 0 returns the StepResult. Chosen when
                      config.tensor_parallel_size > 1.
    other kinds       `register_executor(name, cls)` then `EngineConfig.executor = name`, or
                      `EngineConfig.executor = "package.module:Class"` (e.g. the host-overhead
                      benchmark's stubbed forward, benchmarks/host_overhead.py).
"""
from __future__ import annotations

import abc
from typing import Callable

import torch

from linrnn_serve.cache.budget import CacheBudget
from linrnn_serve.config import EngineConfig, ModelConfig
from linrnn_serve.runner.plan import StepPlan, StepResult
from linrnn_serve.runner.worker import Worker


class Executor(abc.ABC):
    budget: CacheBudget

    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: str | None,
                 device: torch.device, dtype: torch.dtype, max_model_len: int,
                 calibration_tokens: list[int] | None = None, progress: bool = True):
        self.config, self.model_config, self.model_dir = config, model_config, model_dir
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.calibration_tokens, self.progress = calibration_tokens, progress

    @staticmethod
    def create(config: EngineConfig, model_config: ModelConfig, model_dir: str | None, device: torch.device,
               dtype: torch.dtype, max_model_len: int, calibration_tokens: list[int] | None = None,
               progress: bool = True, kind: str | None = None) -> "Executor":
        if kind is None:
            kind = config.executor
            if kind == "uniproc" and config.tensor_parallel_size > 1:
                kind = "multiproc"
        if kind == "multiproc" and kind not in _EXECUTORS:
            from linrnn_serve.engine.multiproc_executor import MultiprocExecutor

            register_executor("multiproc", MultiprocExecutor)
        if kind in _EXECUTORS:
            cls = _EXECUTORS[kind]
        elif ":" in kind:  # "package.module:Class"
            import importlib

            mod, _, name = kind.partition(":")
            cls = getattr(importlib.import_module(mod), name)
        else:
            raise ValueError(f"unknown executor {kind!r} (known: {', '.join(sorted(_EXECUTORS))}, or "
                             f"'package.module:Class')")
        return cls(config, model_config, model_dir, device, dtype, max_model_len, calibration_tokens, progress)

    # execute_async may return before the step's sampled ids reach the host, and the workers feed a decode
    # row whose DecodeRow.token_id is -1 from the device (overlapped steps, LLMEngine.async_scheduling)
    supports_async = False

    @abc.abstractmethod
    def execute(self, plan: StepPlan) -> StepResult: ...

    def execute_async(self, plan: StepPlan):
        """Launch a step; returns an object whose result() is its StepResult (here: run it now)."""
        return _Done(self.execute(plan))

    @abc.abstractmethod
    def describe(self) -> dict: ...

    def check_health(self) -> None:
        """Raise RuntimeError when a worker is gone (in-process workers cannot be)."""

    def shutdown(self) -> None:
        """Release the workers (in-process: nothing to do)."""


class UniProcExecutor(Executor):
    """One Worker in this process."""

    worker_cls = Worker
    supports_async = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        w = self.worker = self.worker_cls(self.config, self.model_config, self.model_dir, self.device, self.dtype,
                                 self.max_model_len, progress=self.progress)
        w.load_model(self.calibration_tokens)
        self.budget = w.determine_budget()
        w.init_caches(self.budget)
        w.capture_graphs()

    def execute(self, plan: StepPlan) -> StepResult:
        return self.worker.execute(plan)

    def execute_async(self, plan: StepPlan):
        return self.worker.execute_async(plan)

    def describe(self) -> dict:
        return self.worker.describe()


class _Done:
    """An executed step's result (the PendingStep interface of an executor that runs steps synchronously)."""

    def __init__(self, result: StepResult):
        self._r = result

    def done(self) -> bool:
        return True

    def result(self) -> StepResult:
        return self._r


_EXECUTORS: dict[str, Callable[..., Executor]] = {"uniproc": UniProcExecutor}


def register_executor(kind: str, cls: Callable[..., Executor]) -> None:
    """Make `Executor.create(..., kind=kind)` build `cls` (e.g. a tensor-parallel multiprocess executor)."""
    _EXECUTORS[kind] = cls
