"""Worker: everything one device holds — the model (or, with tensor parallelism, its shard), the
recurrent-state and paged-KV caches, the ModelRunner and its CUDA graphs.

The engine core never touches a worker's tensors: it talks to its workers through an Executor
(engine/executor.py), in this order:

    w = Worker(config, model_config, model_dir, device, dtype, rank=0, world_size=1)
    w.load_model()                          # weights (this rank's shard), f32/bf16 head map
    budget = w.determine_budget()           # cache sizes this device can hold (profile run on GPU)
    w.init_caches(budget)                   # the executor passes the budget every rank agrees on
    w.capture_graphs()
    result = w.execute(plan)                # StepPlan -> StepResult, every step
    pending = w.execute_async(plan)         # or: launch now, pending.result() once the ids are needed

Everything crossing that boundary is plain data (EngineConfig, ModelConfig, CacheBudget, StepPlan,
StepResult), so a worker can live in another process (one per GPU) with the same interface.
"""
from __future__ import annotations

import logging
import time

import torch

from linrnn_serve.cache import HybridStateCache, ModelCaches, PagedKVCache
from linrnn_serve.cache.budget import CacheBudget, compute_budget
from linrnn_serve.classifier import build_head_map
from linrnn_serve.config import EngineConfig, ModelConfig
from linrnn_serve.models.loading import load_model
from linrnn_serve.runner.model_runner import ModelRunner, mixed_batch_default, prefill_padding_default
from linrnn_serve.runner.prefill_graphs import prefill_graph_max_tokens
from linrnn_serve.runner.plan import StepPlan, StepResult

log = logging.getLogger(__name__)


class Worker:
    def __init__(self, config: EngineConfig, model_config: ModelConfig, model_dir: str | None,
                 device: torch.device, dtype: torch.dtype, max_model_len: int, rank: int = 0, world_size: int = 1,
                 progress: bool = True, shard=None, device_share: int = 1):
        """`shard` (parallel.Shard): this rank's place in a tensor-parallel group; the worker then
        holds the model's shard and caches of its heads (model.local_cfg). `device_share`: ranks on
        this device (the single-GPU test mode of the multi-process path): each sizes its caches
        from a 1/device_share share of the GPU's memory."""
        self.config, self.model_config, self.model_dir = config, model_config, model_dir
        self.device, self.dtype, self.max_model_len = device, dtype, max_model_len
        self.shard = shard
        if shard is not None:
            rank, world_size = shard.rank, shard.world_size
        self.rank, self.world_size, self.progress = rank, world_size, progress
        self.device_share = device_share
        self.note = lambda what: None  # fine-grained progress marks (rank_watch.RankWatch.note under TP)
        self.model = None
        self.bf16_heads = None
        self.head_map_description = ""
        self.caches: ModelCaches | None = None
        self.runner: ModelRunner | None = None
        self.weights_seconds = 0.0
        self.weight_bytes = 0

    # ---- set-up, in order ----------------------------------------------------------------------
    def load_model(self, calibration_tokens: list[int] | None = None) -> None:
        c = self.config
        t0 = time.perf_counter()
        if calibration_tokens and self.world_size > 1:
            raise ValueError("--ssm-calibration is not supported with tensor parallelism yet (the weights-only "
                             "head map is)")
        self.model = load_model(self.model_config, self.model_dir, self.dtype, self.device, c.load_format,
                                progress=self.progress, seed=c.seed, shard=self.shard, tick=self.note)
        self.weights_seconds = time.perf_counter() - t0
        self.weight_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.bf16_heads, self.head_map_description = build_head_map(self.model, c.ssm_bf16_tau, self.model_dir,
                                                                    calibration_tokens)

    def determine_budget(self) -> CacheBudget:
        c = self.config
        peak = self._profile_activation_peak() if self.device.type == "cuda" and c.num_kv_blocks is None else None
        mem_info = None
        if self.device.type == "cuda" and self.device_share > 1:
            # ranks sharing one GPU (all loaded: start-up's collective check came first): an equal share
            # of the memory and of what is in use each
            free, total = torch.cuda.mem_get_info(self.device)
            n = self.device_share
            mem_info = (total // n - (total - free) // n, total // n)
        return compute_budget(
            self.local_config, device=self.device, act_dtype=self.dtype, kv_dtype=self.dtype,
            max_num_seqs=c.max_num_seqs, max_model_len=self.max_model_len, block_size=c.block_size,
            gpu_memory_utilization=c.gpu_memory_utilization, bf16_heads=self.bf16_heads,
            num_kv_blocks=c.num_kv_blocks, activation_peak=peak, max_num_batched_tokens=c.max_num_batched_tokens,
            enforce_eager=c.enforce_eager,
            prefix_snapshot_fraction=c.prefix_snapshot_fraction if c.enable_prefix_caching else 0.0,
            num_prefix_snapshots=c.num_prefix_snapshots if c.enable_prefix_caching else None, mem_info=mem_info,
            prefill_graph_tokens=(min(c.max_num_batched_tokens, prefill_graph_max_tokens())
                                  if prefill_padding_default(self.model, self.device) else 0))

    def init_caches(self, budget: CacheBudget) -> None:
        c = self.config
        state = HybridStateCache(self.local_config, budget.num_state_slots, self.dtype, self.device, self.bf16_heads)
        kv = PagedKVCache(self.local_config, budget.num_kv_blocks, c.block_size, self.dtype, self.device)
        snapshots = snapshot_logits = None
        if c.enable_prefix_caching:  # prefix-cache state snapshots + their last-token logits rows
            snapshots = HybridStateCache(self.local_config, budget.num_snapshots, self.dtype, self.device,
                                         self.bf16_heads)
            snapshot_logits = torch.zeros(budget.num_snapshots, self.model_config.vocab_size, dtype=self.dtype,
                                          device=self.device)
        self.caches = ModelCaches(state, kv, snapshots, snapshot_logits)
        self.runner = ModelRunner(self.model, self.caches, max_num_seqs=c.max_num_seqs,
                                  max_model_len=self.max_model_len, block_size=c.block_size,
                                  enforce_eager=c.enforce_eager, progress=self.progress,
                                  max_num_batched_tokens=c.max_num_batched_tokens,
                                  mixed_batch=mixed_batch_default(self.device) if c.mixed_batch is None
                                  else c.mixed_batch)

    @property
    def local_config(self) -> ModelConfig:
        """The config of the part this worker holds (the whole model unless tensor parallel)."""
        return getattr(self.model, "local_cfg", self.model_config)

    def capture_graphs(self) -> None:
        # under tensor parallelism a failed capture is fatal: a rank that fell back to eager decode while
        # the others went on capturing would leave them waiting in a collective
        self.runner.capture_graphs(strict=self.world_size > 1, note=self.note)

    def set_comm_timing(self, on: bool) -> None:
        """Time each collective (parallel.Communicator.stats). A replayed CUDA graph runs no Python,
        so decode runs eagerly meanwhile (the same kernels and collectives, launched one by one)."""
        comm = self.shard.comm if self.shard is not None else None
        if comm is None:
            return
        comm.timed = on
        comm.stats.reset()
        if on:
            self._graphs_were_on, self.runner.use_graphs = self.runner.use_graphs, False
        else:
            self.runner.use_graphs = getattr(self, "_graphs_were_on", self.runner.use_graphs)

    # ---- every step ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.runner.execute(plan)

    def execute_async(self, plan: StepPlan):
        """Launch the step; a PendingStep whose result() is the StepResult (overlapped steps)."""
        return self.runner.execute_async(plan)

    def last_logits(self) -> dict[int, torch.Tensor]:
        return self.runner.last_logits()

    def describe(self) -> dict:
        r = self.runner
        return {"rank": self.rank, "device": str(self.device), "cuda_graphs": bool(r and r.use_graphs),
                "mixed_batch": bool(r and r.mixed_batch),
                "num_graphs": len(r.graphs.graphs) if r else 0,
                "graph_capture_seconds": r.graphs.capture_seconds if r else 0.0,
                "graph_capture_bytes": r.graphs.capture_bytes if r else 0,
                "state_f32_fraction": self.caches.state.f32_fraction() if self.caches else 1.0,
                "state_bytes_per_seq": self.caches.state.bytes_per_seq() if self.caches else 0,
                # what a state slot's bytes mean (head map, dtypes): prefix-cache snapshots are
                # only ever restored into a pool of the same layout
                "state_layout": self.caches.state.layout_key if self.caches else None,
                "head_map": self.head_map_description, "weight_bytes": self.weight_bytes,
                "weights_seconds": self.weights_seconds}

    @torch.inference_mode()
    def _profile_activation_peak(self) -> int | None:
        """Peak scratch memory of a max_num_batched_tokens prefill (with a temporary small cache): one prompt of
        that many tokens, or as many prompts of max_model_len tokens as a step can hold when it is shorter."""
        c = self.config
        L = min(c.max_num_batched_tokens, self.max_model_len)
        n = min(-(-c.max_num_batched_tokens // L), c.max_num_seqs)
        T = min(c.max_num_batched_tokens, n * L)
        try:
            from linrnn_serve.runner.session import Session

            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            base = torch.cuda.memory_allocated(self.device)
            s = Session(self.model, n, L, c.block_size)
            cache_bytes = torch.cuda.memory_allocated(self.device) - base
            # the same ids on every rank (a fixed generator): the same shapes and collectives everywhere
            g = torch.Generator().manual_seed(0)
            ids = torch.randint(0, self.model_config.vocab_size, (T,), generator=g).tolist()
            self.note(f"profile forward ({T} tokens, {n} prompt{'s' if n > 1 else ''})")
            s.forward([s.new_seq() for _ in range(n)], [ids[i * L:(i + 1) * L] for i in range(n)])
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device) - base - cache_bytes
            del s
            torch.cuda.empty_cache()
            return int(peak * 1.1) + (64 << 20)
        except Exception as e:  # the estimate is used instead (alone: with peers, a rank must not skip collectives)
            if self.world_size > 1:
                raise
            log.warning("profile run failed (%s: %s); using an activation-memory estimate", type(e).__name__, e)
            torch.cuda.empty_cache()
            return None
