"""Memory budget: how many recurrent-state slots and paged-KV blocks to allocate.

State slots are fixed by the scheduler's limit: max_num_seqs live sequences + slot 0, the dummy
that padded CUDA-graph rows write to. KV blocks get what is left (vLLM's rule):

    usable    = total GPU memory * gpu_memory_utilization
    kv_bytes  = usable - (memory in use after the weights are loaded, by anyone on the GPU)
                       - state pool - activation peak (measured by a profile run, or estimated)
                       - CUDA-graph reserve (0 with enforce_eager) - logits + sampler scratch
    blocks    = kv_bytes // bytes per block (+1 dummy), capped at what max_num_seqs sequences of
                max_model_len tokens could ever use.

With prefix caching, `prefix_snapshot_fraction` of kv_bytes goes to the snapshot pool instead
(each a state slot's bytes + one logits row; LRU-evicted in cache/prefix_cache.py) and KV gets
the rest; `num_prefix_snapshots` overrides the count.

On the CPU the budget is a fixed `CPU_KV_BYTES`. `EngineConfig.num_kv_blocks` overrides all of it.
Pure arithmetic: no tensors are allocated here.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from linrnn_serve.cache.kv_pool import PagedKVCache
from linrnn_serve.config import ModelConfig

log = logging.getLogger(__name__)

GiB = 1 << 30
MiB = 1 << 20
CPU_KV_BYTES = 256 * MiB
MIN_GRAPH_RESERVE = 256 * MiB
SAMPLER_BYTES_PER_LOGIT = 40


class CacheBudgetError(RuntimeError):
    """Not enough memory for the caches this configuration asks for."""


@dataclass
class CacheBudget:
    num_state_slots: int  # incl. dummy slot 0
    num_kv_blocks: int  # incl. dummy block 0
    block_size: int
    state_bytes_per_seq: int
    kv_bytes_per_block: int
    activation_reserve: int = 0
    graph_reserve: int = 0
    source: str = ""  # how the KV count was decided (logs)
    num_snapshots: int = 0  # prefix-cache state snapshots (incl. dummy 0 when > 0)
    cache_bytes: int = 0  # memory the KV (and snapshot) pools may use before the max_num_seqs cap

    @property
    def state_bytes(self) -> int:
        return self.num_state_slots * self.state_bytes_per_seq

    @property
    def kv_bytes(self) -> int:
        return self.num_kv_blocks * self.kv_bytes_per_block

    @property
    def kv_tokens(self) -> int:
        return (self.num_kv_blocks - 1) * self.block_size

    snapshot_bytes_each: int = 0  # a state slot + a logits row

    @property
    def snapshot_bytes(self) -> int:
        return self.num_snapshots * self.snapshot_bytes_each

    def describe(self) -> str:
        snaps = (f"; {self.num_snapshots - 1} prefix snapshots ({self.snapshot_bytes / GiB:.3f} GiB)"
                 if self.num_snapshots else "")
        return (f"{self.num_state_slots - 1} state slots x {self.state_bytes_per_seq / MiB:.2f} MiB "
                f"= {self.state_bytes / GiB:.3f} GiB; {self.num_kv_blocks - 1} KV blocks x {self.block_size} "
                f"tokens ({self.kv_tokens} tokens, {self.kv_bytes / GiB:.3f} GiB){snaps} [{self.source}]")


def state_bytes_per_seq(cfg: ModelConfig, act_dtype: torch.dtype, bf16_heads: list[list[bool]] | None) -> int:
    """Recurrent state + conv state of one sequence over all GDN layers (matches HybridStateCache)."""
    n_gdn = len(cfg.gdn_layers)
    hv, dk, dv = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
    n_bf16 = sum(sum(map(bool, m)) for m in bf16_heads) if bf16_heads else 0
    n_f32 = n_gdn * hv - n_bf16
    ssm = dk * dv * (4 * n_f32 + 2 * n_bf16)
    conv = n_gdn * (cfg.linear_conv_kernel_dim - 1) * cfg.conv_dim * _elt(act_dtype)
    return ssm + conv


def max_useful_blocks(max_num_seqs: int, max_model_len: int, block_size: int) -> int:
    """Blocks that max_num_seqs sequences of max_model_len tokens could hold at once (+ dummy)."""
    return max_num_seqs * -(-max_model_len // block_size) + 1


def activation_estimate(cfg: ModelConfig, max_num_batched_tokens: int, act_dtype: torch.dtype) -> int:
    """A generous estimate of the forward's peak scratch memory when no profile run is available:
    a few hidden-sized buffers per token, the widest projection outputs, the MoE's per-(token,
    expert) intermediates (logits and sampling scratch are reserved separately)."""
    T, e = max_num_batched_tokens, _elt(act_dtype)
    widest = max(cfg.conv_dim + cfg.value_dim + 2 * cfg.linear_num_value_heads,
                 cfg.num_attention_heads * cfg.head_dim * 2 + 2 * cfg.num_key_value_heads * cfg.head_dim)
    per_token = (8 * cfg.hidden_size + 3 * widest) * e + cfg.num_experts_per_tok * (
        2 * cfg.moe_intermediate_size + cfg.hidden_size) * 4
    return T * per_token + 256 * MiB


def compute_budget(cfg: ModelConfig, *, device: torch.device, act_dtype: torch.dtype, kv_dtype: torch.dtype,
                   max_num_seqs: int, max_model_len: int, block_size: int, gpu_memory_utilization: float,
                   bf16_heads: list[list[bool]] | None = None, num_kv_blocks: int | None = None,
                   activation_peak: int | None = None, max_num_batched_tokens: int = 2048,
                   enforce_eager: bool = False, mem_info: tuple[int, int] | None = None,
                   prefix_snapshot_fraction: float = 0.0, num_prefix_snapshots: int | None = None,
                   prefill_graph_tokens: int = 0) -> CacheBudget:
    """Decide the cache sizes. `activation_peak` is a profile run's peak scratch bytes (the caller
    measures it with the weights loaded); `mem_info` = (free, total) bytes, default from CUDA.
    `prefix_snapshot_fraction` > 0 (prefix caching on) gives that share of the KV memory to state
    snapshots. `prefill_graph_tokens` > 0: prefill forwards of up to that many tokens are captured in
    CUDA graphs (runner/prefill_graphs.py), whose pool keeps such a forward's scratch."""
    out = _compute_kv(cfg, device=device, act_dtype=act_dtype, kv_dtype=kv_dtype, max_num_seqs=max_num_seqs,
                      max_model_len=max_model_len, block_size=block_size,
                      gpu_memory_utilization=gpu_memory_utilization, bf16_heads=bf16_heads,
                      num_kv_blocks=num_kv_blocks, activation_peak=activation_peak,
                      max_num_batched_tokens=max_num_batched_tokens, enforce_eager=enforce_eager, mem_info=mem_info,
                      prefill_graph_tokens=prefill_graph_tokens)
    out.snapshot_bytes_each = out.state_bytes_per_seq + cfg.vocab_size * _elt(act_dtype)
    if num_prefix_snapshots is not None:
        if num_prefix_snapshots < 1:
            raise CacheBudgetError(f"num_prefix_snapshots must be >= 1, got {num_prefix_snapshots}")
        out.num_snapshots = num_prefix_snapshots + 1
    elif prefix_snapshot_fraction > 0:
        if not 0.0 < prefix_snapshot_fraction < 1.0:
            raise CacheBudgetError(f"prefix_snapshot_fraction must be in (0, 1), got {prefix_snapshot_fraction}")
        avail = out.cache_bytes if num_kv_blocks is None else out.kv_bytes
        want = int(avail * prefix_snapshot_fraction) // out.snapshot_bytes_each
        if want < 1:
            raise CacheBudgetError(
                f"prefix_snapshot_fraction {prefix_snapshot_fraction} of {avail / MiB:.1f} MiB of cache "
                f"memory does not hold one {out.snapshot_bytes_each / MiB:.1f} MiB state snapshot; raise it or "
                f"gpu_memory_utilization")
        if num_kv_blocks is None:  # the snapshots' bytes come out of the KV share
            cap = max_useful_blocks(max_num_seqs, max_model_len, block_size)
            kv_left = avail - want * out.snapshot_bytes_each
            out.num_kv_blocks = max(2, min(cap, kv_left // max(out.kv_bytes_per_block, 1) + 1))
        out.num_snapshots = want + 1
        out.source += f", {prefix_snapshot_fraction:.2f} of it to prefix snapshots"
    return out


def _compute_kv(cfg: ModelConfig, *, device: torch.device, act_dtype: torch.dtype, kv_dtype: torch.dtype,
                max_num_seqs: int, max_model_len: int, block_size: int, gpu_memory_utilization: float,
                bf16_heads: list[list[bool]] | None, num_kv_blocks: int | None, activation_peak: int | None,
                max_num_batched_tokens: int, enforce_eager: bool,
                mem_info: tuple[int, int] | None, prefill_graph_tokens: int = 0) -> CacheBudget:
    slots = max_num_seqs + 1
    per_seq = state_bytes_per_seq(cfg, act_dtype, bf16_heads)
    per_block = PagedKVCache.bytes_per_block(cfg, block_size, kv_dtype)
    cap = max_useful_blocks(max_num_seqs, max_model_len, block_size)
    out = CacheBudget(slots, 0, block_size, per_seq, per_block)
    if num_kv_blocks is not None:
        if num_kv_blocks < 2:
            raise CacheBudgetError(f"num_kv_blocks must be >= 2 (block 0 is a reserved dummy), got {num_kv_blocks}")
        out.num_kv_blocks, out.source = num_kv_blocks, "num_kv_blocks override"
        return out
    if device.type != "cuda":
        out.cache_bytes = CPU_KV_BYTES
        out.num_kv_blocks = max(2, min(cap, CPU_KV_BYTES // max(per_block, 1) + 1))
        out.source = f"CPU budget {CPU_KV_BYTES // MiB} MiB" + (", capped at max_num_seqs x max_model_len"
                                                               if out.num_kv_blocks == cap else "")
        return out
    if not 0.0 < gpu_memory_utilization <= 1.0:
        raise CacheBudgetError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free, total = mem_info if mem_info is not None else torch.cuda.mem_get_info(device)
    in_use = total - free
    act = activation_peak if activation_peak is not None else activation_estimate(
        cfg, max_num_batched_tokens, act_dtype)
    # graph pool: the largest decode bucket's activations (a max_num_seqs-token forward)
    graphs = 0 if enforce_eager else max(MIN_GRAPH_RESERVE, activation_estimate(cfg, max_num_seqs, act_dtype))
    # decode logits buffer + sampling scratch at the largest batch (f32 probs, sort values and
    # int64 order, f64 cumulative sums), live in eager mode too and held by the graph pool
    graphs += max_num_seqs * cfg.vocab_size * (_elt(act_dtype) + SAMPLER_BYTES_PER_LOGIT)
    if not enforce_eager and prefill_graph_tokens > 0:  # the prefill graphs' pool: its largest bucket's scratch
        graphs += int(act * min(1.0, prefill_graph_tokens / max(max_num_batched_tokens, 1)))
    out.activation_reserve, out.graph_reserve = act, graphs
    left = int(total * gpu_memory_utilization) - in_use - out.state_bytes - act - graphs
    need_one = -(-max_model_len // block_size) + 1
    if left < need_one * per_block:
        raise CacheBudgetError(
            f"not enough GPU memory for the caches: {total / GiB:.1f} GiB x gpu_memory_utilization "
            f"{gpu_memory_utilization} = {total * gpu_memory_utilization / GiB:.1f} GiB, of which "
            f"{in_use / GiB:.1f} GiB is in use (weights, other processes), {out.state_bytes / GiB:.2f} GiB goes "
            f"to {max_num_seqs} state slots ({per_seq / MiB:.1f} MiB each), {act / GiB:.2f} GiB to activations and "
            f"{graphs / GiB:.2f} GiB to CUDA graphs; {max(left, 0) / GiB:.2f} GiB is left for KV but one sequence of "
            f"max_model_len {max_model_len} needs {need_one * per_block / GiB:.3f} GiB. Lower max_num_seqs or "
            f"max_model_len, or raise gpu_memory_utilization.")
    out.num_kv_blocks = min(cap, left // per_block + 1)
    out.cache_bytes = left
    out.source = (f"{gpu_memory_utilization:.2f} x {total / GiB:.1f} GiB - {in_use / GiB:.1f} GiB in use - "
                  f"{act / GiB:.2f} GiB activations - {graphs / GiB:.2f} GiB graphs")
    return out


def _elt(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()
