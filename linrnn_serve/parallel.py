"""Tensor / expert parallelism: which slice of the model this rank holds, and its collectives.

One process per GPU (or CPU rank) holds a shard of every layer (DESIGN "Processes"):

  attention   q heads split; kv heads split, or each rank keeps the one kv head of its q heads when
              the world size exceeds the kv heads (replicated); o_proj row-parallel -> all-reduce
  GDN         k heads split, each rank keeps the whole v-head groups of its k heads (v head h uses
              k head h // (Hv / Hk)); past Hk ranks a group's v heads are split and its k head is
              replicated. Each rank keeps its slice of the recurrent + conv state pool and of the f32/bf16
              head map; out_proj row-parallel -> all-reduce
  MoE         tensor parallel (default): every expert's intermediate split, or expert parallel
              (`--enable-expert-parallel`): experts partitioned, every rank sees every token and
              combines only its own experts' contributions (the all-reduce of the sum is the
              reduce-scatter + all-gather of the token exchange, fused); the shared expert and the
              dense MLP are intermediate-split either way. One all-reduce per MoE sublayer.
  embedding   vocab-parallel rows, out-of-range ids give zeros -> all-reduce
  lm_head     vocab-parallel rows -> all-gather of the logits (every rank gets the full row)

`local_config(cfg, shard)` is the config of one rank's slice (heads, intermediate sizes, vocab rows
and experts divided), from which the layers, the caches and the loader's shape checks are built
unchanged; `ExpertShard` and the `Communicator` carry what a local config cannot say.

The collectives are in-place on static tensors and read nothing back on the host, so a decode step
with its all-reduces is captured in one CUDA graph (NCCL on GPU, gloo on CPU, where no graphs run).
"""
from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass, field

import torch

from linrnn_serve.config import ConfigError, ModelConfig


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False

    def describe(self) -> str:
        if self.tensor_parallel_size == 1:
            return "TP1"
        return f"TP{self.tensor_parallel_size}" + (f"/EP{self.tensor_parallel_size}" if self.enable_expert_parallel
                                                  else "")


@dataclass
class CommStats:
    """Collectives issued while `Communicator.timed` is on: count, bytes and wall time."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0
    by_op: dict[str, list[float]] = field(default_factory=dict)  # op -> [calls, bytes, seconds]

    def reset(self) -> None:
        self.calls, self.bytes, self.seconds, self.by_op = 0, 0, 0.0, {}


class Communicator:
    """The collectives of one tensor-parallel group (torch.distributed; the default group unless
    given). With `timed` on, each collective is synchronised and timed (benchmarks; never inside a
    CUDA-graph capture). `stage_on_host`: the backend takes CPU tensors only (gloo under the
    single-GPU test mode): CUDA tensors go through host copies (eager only, never captured)."""

    def __init__(self, rank: int, world_size: int, group=None, stage_on_host: bool = False):
        self.rank, self.world_size, self.group = rank, world_size, group
        self.stage_on_host = stage_on_host
        self.timed = False
        self.stats = CommStats()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place; returns x."""
        import torch.distributed as dist

        t0 = self._start(x)
        if self.stage_on_host and x.is_cuda:
            h = x.cpu()
            dist.all_reduce(h, group=self.group)
            x.copy_(h)
        else:
            dist.all_reduce(x, group=self.group)
        self._stop("all_reduce", x, t0)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., world * n], rank-major along the last dim."""
        import torch.distributed as dist

        t0 = self._start(x)
        x = x.contiguous()
        flat = x.reshape(-1, x.shape[-1])
        host = self.stage_on_host and x.is_cuda
        src = flat.cpu() if host else flat
        out = torch.empty((self.world_size * flat.shape[0], x.shape[-1]), dtype=x.dtype, device=src.device)
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.12
        gather(out, src, group=self.group)
        if host:
            out = out.to(x.device)
        self._stop("all_gather", x, t0)
        out = out.view(self.world_size, flat.shape[0], x.shape[-1]).transpose(0, 1)
        return out.reshape(*x.shape[:-1], self.world_size * x.shape[-1])

    def warm_up(self, device: torch.device) -> float:
        """One all-reduce and one all-gather on `device`, checked, before anything is captured: the
        communicator's first use (connection set-up, NCCL's lazy buffers) happens eagerly here, and a
        group whose sums are wrong fails now with a clear error. Every rank calls it at the same
        point of start-up (it is also the first sync point after loading). Returns seconds."""
        t0 = time.perf_counter()
        x = torch.full((8,), float(self.rank + 1), dtype=torch.float32, device=device)
        self.all_reduce(x)
        g = self.all_gather_last(torch.full((2, 1), float(self.rank), dtype=torch.float32, device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        want = self.world_size * (self.world_size + 1) / 2
        got_g = g[0].tolist()
        if x.tolist() != [want] * 8 or got_g != [float(r) for r in range(self.world_size)]:
            raise RuntimeError(f"tensor-parallel rank {self.rank}: the collectives give wrong results "
                               f"(all-reduce {x.tolist()[0]} != {want}, all-gather {got_g})")
        return time.perf_counter() - t0

    def _start(self, x: torch.Tensor) -> float | None:
        if not self.timed:
            return None
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        return time.perf_counter()

    def _stop(self, op: str, x: torch.Tensor, t0: float | None) -> None:
        if t0 is None:
            return
        if x.is_cuda:
            torch.cuda.synchronize(x.device)
        dt = time.perf_counter() - t0
        nbytes = x.numel() * x.element_size()
        s = self.stats
        s.calls, s.bytes, s.seconds = s.calls + 1, s.bytes + nbytes, s.seconds + dt
        rec = s.by_op.setdefault(op, [0, 0, 0.0])
        rec[0], rec[1], rec[2] = rec[0] + 1, rec[1] + nbytes, rec[2] + dt


@dataclass
class Shard:
    """This rank's place in the tensor-parallel group."""

    rank: int = 0
    world_size: int = 1
    expert_parallel: bool = False
    comm: Communicator | None = None

    @property
    def parallel(self) -> bool:
        return self.world_size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return self.comm.all_reduce(x) if self.parallel else x

    def span(self, total: int) -> tuple[int, int]:
        """[start, end) of this rank's equal share of `total` items."""
        n = total // self.world_size
        return self.rank * n, (self.rank + 1) * n


SINGLE = Shard()


@dataclass(frozen=True)
class ExpertShard:
    """Routed experts held here: global ids [first, first + count) of `total`."""

    first: int
    count: int
    total: int

    @property
    def partitioned(self) -> bool:
        return self.count != self.total


def kv_head_span(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """[start, end) of the kv heads this rank keeps: its share, or the single kv head its q heads use
    when the world size exceeds the kv heads (replicated)."""
    hkv, N = cfg.num_key_value_heads, shard.world_size
    if hkv >= N:
        return shard.span(hkv)
    q0 = shard.rank * (cfg.num_attention_heads // N)
    h = q0 // (cfg.num_attention_heads // hkv)
    return h, h + 1


def gdn_key_head_span(cfg: ModelConfig, shard: Shard) -> tuple[int, int]:
    """[start, end) of the GDN k heads this rank keeps: its share (with their whole v-head groups),
    or, when the world size exceeds the k heads, the one k head its share of v heads uses."""
    hk, hv, N = cfg.linear_num_key_heads, cfg.linear_num_value_heads, shard.world_size
    if hk >= N:
        return shard.span(hk)
    h = shard.rank * (hv // N) // (hv // hk)
    return h, h + 1


def expert_shard(cfg: ModelConfig, shard: Shard) -> ExpertShard:
    if shard.expert_parallel and shard.parallel:
        a, b = shard.span(cfg.num_experts)
        return ExpertShard(a, b - a, cfg.num_experts)
    return ExpertShard(0, cfg.num_experts, cfg.num_experts)


def validate(cfg: ModelConfig, shard: Shard) -> None:
    """Clear errors for shapes a world size cannot split."""
    N = shard.world_size
    if N == 1:
        return
    checks = [
        ("num_attention_heads", cfg.num_attention_heads),
        ("vocab_size", cfg.vocab_size),
        ("moe_intermediate_size" if not shard.expert_parallel else "num_experts",
         cfg.moe_intermediate_size if not shard.expert_parallel else cfg.num_experts),
    ]
    if cfg.shared_expert_intermediate_size:
        checks.append(("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size))
    if any(not cfg.is_moe_layer(i) for i in range(cfg.num_hidden_layers)):
        checks.append(("intermediate_size", cfg.intermediate_size))
    for name, v in checks:
        if v % N:
            raise ConfigError(f"tensor parallel size {N} does not divide {name} = {v}")
    for name, v in (("num_key_value_heads", cfg.num_key_value_heads), ("linear_num_key_heads", cfg.linear_num_key_heads)):
        if v % N and N % v:
            raise ConfigError(f"tensor parallel size {N} must divide {name} = {v} or be a multiple of it")
    if cfg.linear_num_value_heads % N:
        raise ConfigError(f"tensor parallel size {N} does not divide linear_num_value_heads = "
                          f"{cfg.linear_num_value_heads}")


def local_config(cfg: ModelConfig, shard: Shard) -> ModelConfig:
    """The config of this rank's slice: what its layers, caches and loader see."""
    if not shard.parallel:
        return cfg
    validate(cfg, shard)
    N = shard.world_size
    a, b = kv_head_span(cfg, shard)
    ka, kb = gdn_key_head_span(cfg, shard)
    ep = shard.expert_parallel
    return dataclasses.replace(
        cfg,
        vocab_size=cfg.vocab_size // N,
        num_attention_heads=cfg.num_attention_heads // N,
        num_key_value_heads=b - a,
        linear_num_key_heads=kb - ka,
        linear_num_value_heads=cfg.linear_num_value_heads // N,
        num_experts=cfg.num_experts // N if ep else cfg.num_experts,
        moe_intermediate_size=cfg.moe_intermediate_size if ep else cfg.moe_intermediate_size // N,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // N,
        intermediate_size=cfg.intermediate_size // N if cfg.intermediate_size else 0,
    )


# Environment every rank of an NCCL group starts with (set only where the user has not): NCCL warnings
# on stderr; a collective that times out aborts the communicator and ends the process with the c10d
# watchdog's message naming the operation and its sequence number, instead of hanging. (The c10d flight
# recorder, TORCH_NCCL_TRACE_BUFFER_SIZE, stays the user's choice: it is not known to be safe while NCCL
# calls are captured in CUDA graphs.) NCCL_NVLS_ENABLE and the like are left alone.
NCCL_ENV_DEFAULTS = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}


def set_nccl_env_defaults(env=None) -> None:
    env = os.environ if env is None else env
    for k, v in NCCL_ENV_DEFAULTS.items():
        env.setdefault(k, v)


def init_process_group(rank: int, world_size: int, init_method: str, backend: str, timeout_s: float = 60.0,
                       device: torch.device | None = None, join_timeout_s: float = 180.0) -> Communicator:
    """Join the group (gloo on CPU, nccl on GPU; gloo with CUDA tensors stages them on the host).
    `timeout_s` bounds how long a collective waits for a dead peer before it raises, so a lost worker
    never hangs the survivors; `join_timeout_s` bounds the rendezvous (a rank that died before joining
    fails the others after it, not after the collective timeout). NCCL is bound to `device` (eager
    communicator creation: every later collective, barriers included, runs on this rank's GPU, never
    a default cuda:0). `init_method`: tcp://host:port (rank 0 hosts the store)."""
    import datetime
    from urllib.parse import urlparse

    import torch.distributed as dist

    kw = {}
    if backend == "nccl":
        if device is None or device.type != "cuda":
            raise ValueError("the nccl backend needs this rank's CUDA device")
        set_nccl_env_defaults()
        kw["device_id"] = device
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.port:
        raise ValueError(f"init_method {init_method!r}: expected tcp://host:port")
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=join_timeout_s), wait_for_workers=True)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s), **kw)
    return Communicator(rank, world_size, stage_on_host=backend == "gloo" and device is not None
                        and device.type == "cuda")


def leave_process_group(backend: str) -> None:
    """Leave the default group without waiting on peers. NCCL: abort (local; destroy_process_group
    can hang once collectives were captured in CUDA graphs, pytorch#115388, or when a peer is gone);
    gloo: destroy. Either way a new group can be joined afterwards in this process."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    if backend == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group

        _abort_process_group()
    else:
        dist.destroy_process_group()


__all__ = ["ParallelConfig", "Shard", "SINGLE", "ExpertShard", "Communicator", "CommStats", "local_config",
           "expert_shard", "kv_head_span", "gdn_key_head_span", "validate", "init_process_group",
           "leave_process_group", "set_nccl_env_defaults", "NCCL_ENV_DEFAULTS"]
