"""The decode floor of BENCH.md ("The floor: bytes per decode step"), from a model's real byte counts.

    bytes(B, L) = non-expert weights      every stored parameter but the routed experts, in its stored
                                          dtype (quantized formats: codes + scales), lm_head included;
                                          the embedding table is gathered, not read: B rows count
                + experts touched x bytes per expert (actual stored bytes incl. scales), per MoE layer
                  experts touched ~= E * (1 - (1 - k/E)^B)   (E experts, top-k, uniform routing)
                + recurrent state read + write   (the pool's real f32 / bf16 partitions: tau matters)
                + conv state read + write
                + KV read at context L           (K and V of every attention layer)
    floor time  = bytes / copy bandwidth (a device-to-device copy measured in the same run, read +
                  written bytes counted)

With Qwen3.5-35B-A3B shapes, NVFP4 experts and bf16 elsewhere this gives BENCH.md's numbers: 3.9 GB of
non-expert weights, ~4.5 GB at B=1, experts ~17.8 GB at B=128, f32 state 126 MB per sequence per step.
Used by `linrnn-serve bench batched` and examples/decode_throughput.py.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch


def experts_touched(num_experts: int, top_k: int, batch: int) -> float:
    """Expected distinct experts hit by `batch` tokens choosing top_k of num_experts uniformly."""
    if batch <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass
class ModelBytes:
    """What one decode step must move, per component, for a model and its cache pools."""

    nonexpert_weight_bytes: int  # all parameters but routed experts and the embedding table
    embed_row_bytes: int  # one embedding row (gathered once per token)
    expert_bytes: int  # one routed expert of one layer: gate + up + down incl. scales
    num_moe_layers: int
    num_experts: int
    top_k: int
    ssm_state_bytes_per_seq: int  # recurrent state over all GDN layers (f32 and bf16 partitions)
    conv_state_bytes_per_seq: int
    kv_bytes_per_token: int  # K + V over all attention layers

    @classmethod
    def from_model(cls, model, state=None, kv_bytes_per_token: int = 0) -> "ModelBytes":
        """Byte counts of `model` (a HybridMoEForCausalLM) and, optionally, its HybridStateCache."""
        from linrnn_serve.layers.moe import Experts

        cfg = model.cfg
        expert_params = {id(p) for m in model.modules() if isinstance(m, Experts) for p in m.parameters()}
        expert_total = other = 0
        for p in model.parameters():  # parameters() deduplicates shared tensors
            if id(p) in expert_params:
                expert_total += tensor_bytes(p)
            elif p is not model.embed_tokens:
                other += tensor_bytes(p)
        n_moe = sum(1 for m in model.modules() if isinstance(m, Experts))
        E = cfg.num_experts
        ssm = conv = 0
        if state is not None:
            ssm = sum(tensor_bytes(t[0]) for t in state.ssm_f32 + state.ssm_bf16)
            conv = tensor_bytes(state.conv[:, 0])
        emb = model.embed_tokens
        return cls(nonexpert_weight_bytes=other, embed_row_bytes=emb.shape[1] * emb.element_size(),
                   expert_bytes=expert_total // max(E * n_moe, 1), num_moe_layers=n_moe, num_experts=E,
                   top_k=cfg.num_experts_per_tok, ssm_state_bytes_per_seq=ssm, conv_state_bytes_per_seq=conv,
                   kv_bytes_per_token=kv_bytes_per_token)

    @classmethod
    def from_engine(cls, eng) -> "ModelBytes":
        """From a live LLMEngine: its model, its hybrid state pool and its paged KV pool."""
        kv = eng.caches.kv.kv  # [attn layers, 2, blocks, block_size, kv_heads, head_dim]
        per_token = tensor_bytes(kv[:, :, 0, 0]) if kv.numel() else 0
        return cls.from_model(eng.model, eng.caches.state, per_token)

    def step_bytes(self, batch: int, context: float) -> dict[str, float]:
        """Bytes per decode step of `batch` sequences at `context` tokens, by component + total."""
        touched = experts_touched(self.num_experts, self.top_k, batch)
        parts = {
            "weights": self.nonexpert_weight_bytes + batch * self.embed_row_bytes,
            "experts": touched * self.num_moe_layers * self.expert_bytes,
            "state": 2 * batch * self.ssm_state_bytes_per_seq,
            "conv": 2 * batch * self.conv_state_bytes_per_seq,
            "kv": batch * context * self.kv_bytes_per_token,
        }
        parts["total"] = sum(parts.values())
        parts["experts_touched_per_layer"] = touched
        return parts

    def floor_ms(self, batch: int, context: float, copy_bandwidth: float) -> float:
        """Floor time in ms of one decode step at `copy_bandwidth` bytes/s (read + write counted)."""
        return 1e3 * self.step_bytes(batch, context)["total"] / copy_bandwidth

    def to_dict(self) -> dict:
        return asdict(self)


def warm_up_gpu(device, seconds: float = 2.0) -> None:
    """Keep the GPU busy for a moment so clocks leave their idle state before anything is timed."""
    device = torch.device(device)
    if device.type != "cuda":
        return
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, iters: int = 10) -> float:
    """Copy bandwidth in bytes/s, read + write counted: median over `iters` copies of one large buffer
    (1 GiB on a GPU, far beyond L2; 64 MiB on a CPU). CUDA events on a GPU, wall clock on a CPU."""
    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = nbytes or ((1 << 30) if cuda else (64 << 20))
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up (first-touch pages, lazy allocation)
    times = []
    if cuda:
        torch.cuda.synchronize(device)
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


__all__ = ["ModelBytes", "experts_touched", "copy_bandwidth", "tensor_bytes"]
