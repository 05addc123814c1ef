"""Sparse MoE block with a sigmoid-gated shared expert (SPEC §1.8), and the dense MLP of Qwen3-Next's
non-MoE layers (SPEC §1.2).

The router (`mlp.gate`, E rows) and `shared_expert_gate` (1 row) are never quantized (SPEC §2.2) and
form one FusedLinear `gate` (parts router, shared_gate): one GEMM.
"""
from __future__ import annotations

import torch
from torch import nn

import linrnn_kernels.gemv as gemv_ops
import linrnn_kernels.moe as moe_ops
import linrnn_kernels.norm as norm_ops
from linrnn_serve.config import ModelConfig
from linrnn_serve.layers.linear import DenseWeights, FusedLinear, Linear
from linrnn_serve.layers.norms import PostNorm


class MLP(nn.Module):
    """silu(gate(x)) * up(x) -> down; gate/up are parts of one FusedLinear. `prefix` is the HF
    module path ("mlp" or "mlp.shared_expert") used to look up storage formats."""

    def __init__(self, hidden: int, inter: int, dtype: torch.dtype, fmt=lambda name: DenseWeights,
                 prefix: str = "mlp"):
        super().__init__()
        self.inter = inter
        self.gate_up_proj = FusedLinear(hidden, [("gate", inter), ("up", inter)], dtype,
                                        {p: fmt(f"{prefix}.{p}_proj") for p in ("gate", "up")})
        self.down_proj = Linear(inter, hidden, dtype, fmt(f"{prefix}.down_proj"))

    def forward(self, x: torch.Tensor, post: PostNorm | None = None, addend=None, gate_logit=None, h=None,
                addend_parts=None):
        """down(silu(gate(x)) * up(x)); with addend / gate_logit: addend + sigmoid(gate_logit) * that (the
        shared expert joining the routed experts' sum); with post, (post-normed output, new residual).
        Decode-sized batches: SiLU*mul in the gate_up kernel's epilogue, the rest in the down kernel's.
        h: silu(gate(x)) * up(x) when already computed (the fused router's launch does it).
        addend_parts: the routed experts' uncombined partials (kernels' moe Partials) in place of addend."""
        w13, w2 = self.gate_up_proj.weight_tensor(), self.down_proj.weight_tensor()
        if h is not None:
            pass
        elif w13 is not None:
            h = gemv_ops.fused_linear(x, w13, epilogue="silu_mul")
        else:
            h = norm_ops.silu_mul(self.gate_up_proj(x))
        epi = {} if addend is None else {"epilogue": "gate_add", "addend": addend, "gate_logit": gate_logit}
        if addend_parts is not None:
            epi = {"epilogue": "gate_add", "addend_parts": addend_parts, "gate_logit": gate_logit}
        if w2 is not None:
            return gemv_ops.fused_linear(h, w2, **epi, **(post.fused_options() if post is not None else {}))
        y = self.down_proj(h)
        if addend_parts is not None:
            addend = gemv_ops.combine(*addend_parts, y.dtype)
        if addend is not None:
            y = addend + torch.sigmoid(gate_logit) * y
        return y if post is None else post(y)


class Experts(nn.Module):
    """Routed experts: w13 [E, 2I, H] (rows [gate | up]) and w2 [E, H, I], in one storage format."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt: type = DenseWeights):
        super().__init__()
        E, I, H = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        self.inter = I
        self.w13 = fmt(2 * I, H, dtype, experts=E)
        self.w2 = fmt(H, I, dtype, experts=E)

    def locate(self, part: str):
        """Checkpoint part (gate/up/down) -> (weight module, first row, rows, path)."""
        if part == "down":
            return self.w2, 0, self.w2.n, "w2"
        return self.w13, (0 if part == "gate" else self.inter), self.inter, "w13"

    def repack_for_kernels(self, name: str = "experts", force: bool = False) -> None:
        """After loading: NVFP4 experts also get the MMA-fragment layout of the Hopper decode kernel
        (kernels/moe/nvfp4_layout.py; gate/up rows interleaved) when that kernel can run on their
        device (or `force`). Costs a second copy of the expert weights; negative / NaN block scales
        raise ValueError naming the tensor."""
        if getattr(self.w13, "fmt", None) != "nvfp4":
            return
        if not (force or moe_ops.mma_path_available(self.w13.packed.device)):
            return
        self.w13.pack_mma(gated=True, name=f"{name}.w13 (gate_up_proj)")
        self.w2.pack_mma(gated=False, name=f"{name}.w2 (down_proj)")

    def forward(self, x, topk_weights, topk_ids, alignment=None, combine: bool = True):
        return moe_ops.moe_experts(x, topk_weights, topk_ids, self.w13.weight_tensor(), self.w2.weight_tensor(),
                                   alignment=alignment, combine=combine)


class SparseMoE(nn.Module):
    """`experts` (parallel.ExpertShard): the routed experts held here when they are partitioned over
    ranks (expert parallel): routing is over all of them; the experts of other ranks get weight 0
    and a local id, so every rank's output is its own experts' share of the sum (all-reduced by the
    model). cfg is the rank's local config (intermediate sizes already split under TP)."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, fmt=lambda name: DenseWeights, experts=None):
        super().__init__()
        self.num_experts = experts.total if experts is not None else cfg.num_experts
        self.top_k = cfg.num_experts_per_tok
        self.expert_first = experts.first if experts is not None and experts.partitioned else 0
        self.partitioned = experts is not None and experts.partitioned
        self.renormalize = cfg.norm_topk_prob
        self.has_shared = cfg.shared_expert_intermediate_size > 0
        parts = [("router", self.num_experts)] + ([("shared_gate", 1)] if self.has_shared else [])
        self.gate = FusedLinear(cfg.hidden_size, parts, dtype)
        self.experts = Experts(cfg, dtype, fmt("mlp.experts"))
        if self.has_shared:
            self.shared_expert = MLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, fmt,
                                     prefix="mlp.shared_expert")

    def forward(self, x: torch.Tensor, post: PostNorm | None = None):
        """MoE output [T, H]; with `post`, (post-normed output, new residual). Decode-sized batches: the
        router and the shared expert's gate_up are one kernel (gate GEMMs, softmax, top-k, alignment,
        SiLU*mul), the shared expert's down projection another (it adds the routed sum, the residual and
        the next norm)."""
        # the routing weights come back in the activation dtype (transformers casts them before use)
        shared_w13 = self.shared_expert.gate_up_proj.weight_tensor() if self.has_shared else None
        experts_w = None if self.partitioned else (self.experts.w13.weight_tensor(), self.experts.w2.weight_tensor())
        logits, topk_w, topk_ids, alignment, h = moe_ops.route_align(
            x, self.gate.weight_tensor(), self.num_experts, self.top_k, self.renormalize, shared_w13, experts_w)
        if self.partitioned:  # the alignment is of the global ids: the experts re-align the local ones
            topk_w, topk_ids = self._local_routes(topk_w, topk_ids)
            alignment = None
        # decode-sized batches: the routed experts' top-k / split-K combine can run inside the shared expert's
        # down projection (LINRNN_FUSED_MOE_COMBINE=1)
        w2 = self.shared_expert.down_proj.weight_tensor() if self.has_shared else None
        combined = not (gemv_ops.config.fused_moe_combine_enabled() and not self.partitioned and w2 is not None
                        and gemv_ops.takes_rows(x.shape[0], x, w2, "gate_add"))
        y = self.experts(x, topk_w, topk_ids, alignment, combine=combined)
        if self.has_shared:
            parts = None if isinstance(y, torch.Tensor) else y
            return self.shared_expert(x, post=post, addend=None if parts is not None else y,
                                      gate_logit=logits[:, self.num_experts:], h=h, addend_parts=parts)
        return y if post is None else post(y)

    def _local_routes(self, topk_w, topk_ids):
        """Routes to other ranks' experts -> weight 0 on local expert 0 (static shapes, no host sync;
        adds an exact 0, so the all-reduced sum equals the unpartitioned one up to summation order)."""
        local = topk_ids - self.expert_first
        mine = (local >= 0) & (local < self.experts.w13.experts)
        return torch.where(mine, topk_w, 0.0), torch.where(mine, local, 0).to(topk_ids.dtype)
