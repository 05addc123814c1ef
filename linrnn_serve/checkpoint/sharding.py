"""Rank-sliced loading: the part of each checkpoint tensor one tensor-parallel rank holds.

`ShardSlicer(cfg, shard).take(name, src)` gives this rank's (name, tensor) for a checkpoint tensor,
or None when the rank holds none of it (another rank's experts under expert parallelism). `src`
is a tensor or a reader.LazyTensor (a safetensors `get_slice`): only the rows / columns
taken are read from the memory-mapped file. The result has the shapes of the rank's local config
(parallel.local_config), so WeightLoader places it unchanged, and a load-time repack of a format
(e.g. NVFP4 experts) runs on the slice.

How each tensor is cut (parallel.py has the layer-level picture):
  rows    output rows of column-parallel projections: q/k/v, GDN qkv/z/b/a (and conv1d, A_log,
          dt_bias), gate/up of experts, shared expert and dense MLP, embedding and lm_head rows
  cols    input columns of row-parallel projections: o_proj, out_proj, down projections. Packed
          or block-scaled storage (NVFP4 codes K/2, E4M3 block scales K/16) is cut in proportion
  experts under expert parallelism: per-expert tensors of other ranks are dropped, the rest are
          renamed to local expert ids; fused 3-D expert tensors are cut along the expert dim
  whole   norms, router, shared-expert gate, scalar / per-row scales of a cut-by-columns weight
Per-tensor scales (NVFP4 weight_scale_2 / global scales, FP8 scalar scales, input scales) stay
whole: a slice of a matrix keeps its matrix's scale.
"""
from __future__ import annotations

import re

import torch

from linrnn_serve.checkpoint.layout import canonical_name
from linrnn_serve.config import ModelConfig
from linrnn_serve.parallel import Shard, expert_shard, gdn_key_head_span, kv_head_span

Ranges = list[tuple[int, int]]
_L = re.compile(r"model\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"(mlp\.experts\.)(\d+)(\..*)")


def _merge(r: Ranges) -> Ranges:
    out: Ranges = []
    for a, b in r:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out


class ShardSlicer:
    def __init__(self, cfg: ModelConfig, shard: Shard):
        self.cfg, self.shard = cfg, shard
        N = shard.world_size
        self.vocab = shard.span(cfg.vocab_size)
        self.q_heads = shard.span(cfg.num_attention_heads)
        self.kv_heads = kv_head_span(cfg, shard)
        self.k_heads = gdn_key_head_span(cfg, shard)
        self.v_heads = shard.span(cfg.linear_num_value_heads)
        self.experts = expert_shard(cfg, shard)
        self.moe_inter = (0, cfg.moe_intermediate_size) if shard.expert_parallel else \
            shard.span(cfg.moe_intermediate_size)
        self.shared_inter = shard.span(cfg.shared_expert_intermediate_size)
        self.dense_inter = shard.span(cfg.intermediate_size) if cfg.intermediate_size % N == 0 else (0, 0)

    # ---- the plan for one name ------------------------------------------------------------------
    def plan(self, canon: str) -> tuple[str, str, Ranges, int] | None:
        """(kind, name, ranges, logical total) with kind rows | cols | rows1 (dim 1 of fused
        experts) | experts | whole; None: not held by this rank."""
        c = self.cfg
        if canon == "model.embed_tokens.weight" or canon.startswith("lm_head."):
            return "rows", canon, [self.vocab], c.vocab_size
        m = _L.fullmatch(canon)
        if not m:
            return "whole", canon, [], 0
        rest = m[2]
        if rest.startswith("linear_attn."):
            return self._gdn(canon, rest[len("linear_attn."):])
        if rest.startswith("self_attn."):
            return self._attn(canon, rest[len("self_attn."):])
        if rest.startswith("mlp."):
            return self._mlp(canon, rest, int(m[1]))
        return "whole", canon, [], 0

    def _gdn(self, canon, rest):
        c = self.cfg
        dk, dv, hk, hv = c.linear_key_head_dim, c.linear_value_head_dim, c.linear_num_key_heads, \
            c.linear_num_value_heads
        (k0, k1), (v0, v1) = self.k_heads, self.v_heads
        qkv = [(k0 * dk, k1 * dk), (hk * dk + k0 * dk, hk * dk + k1 * dk), (2 * hk * dk + v0 * dv, 2 * hk * dk + v1 * dv)]
        if rest == "conv1d.weight" or rest.startswith("in_proj_qkv."):
            return "rows", canon, qkv, c.conv_dim
        if rest.startswith("in_proj_z."):
            return "rows", canon, [(v0 * dv, v1 * dv)], hv * dv
        if rest.startswith(("in_proj_b.", "in_proj_a.")) or rest in ("A_log", "dt_bias"):
            return "rows", canon, [(v0, v1)], hv
        if rest.startswith("out_proj."):
            return "cols", canon, [(v0 * dv, v1 * dv)], hv * dv
        r = hv // hk  # Qwen3-Next fused layouts: one group per k head [q k v.. z..] / [b.. a..]
        if rest.startswith(("in_proj_qkvz.", "in_proj_ba.")):
            qkvz = rest.startswith("in_proj_qkvz.")
            g = 2 * dk + 2 * r * dv if qkvz else 2 * r
            out: Ranges = []
            for k in range(k0, k1):
                j0, j1 = max(v0 - k * r, 0), min(v1 - k * r, r)  # this rank's v heads of group k
                base = k * g
                if qkvz:
                    out += [(base, base + 2 * dk), (base + 2 * dk + j0 * dv, base + 2 * dk + j1 * dv),
                            (base + 2 * dk + (r + j0) * dv, base + 2 * dk + (r + j1) * dv)]
                else:
                    out += [(base + j0, base + j1), (base + r + j0, base + r + j1)]
            return "rows", canon, _merge(out), hk * g
        return "whole", canon, [], 0  # norm.weight

    def _attn(self, canon, rest):
        c = self.cfg
        d = c.head_dim
        (q0, q1), (h0, h1) = self.q_heads, self.kv_heads
        if rest.startswith("q_proj."):
            return "rows", canon, [(q0 * 2 * d, q1 * 2 * d)], c.num_attention_heads * 2 * d
        if rest.startswith(("k_proj.", "v_proj.")):  # (a KV-cache scale is a scalar: kept whole)
            return "rows", canon, [(h0 * d, h1 * d)], c.num_key_value_heads * d
        if rest.startswith("o_proj."):
            return "cols", canon, [(q0 * d, q1 * d)], c.num_attention_heads * d
        return "whole", canon, [], 0  # q_norm, k_norm, KV-cache scales

    def _mlp(self, canon, rest, layer):
        c = self.cfg
        if not c.is_moe_layer(layer):
            a, b = self.dense_inter
            if rest.startswith(("mlp.gate_proj.", "mlp.up_proj.")):
                return "rows", canon, [(a, b)], c.intermediate_size
            if rest.startswith("mlp.down_proj."):
                return "cols", canon, [(a, b)], c.intermediate_size
            return "whole", canon, [], 0
        a, b = self.shared_inter
        S = c.shared_expert_intermediate_size
        if rest.startswith(("mlp.shared_expert.gate_proj.", "mlp.shared_expert.up_proj.")):
            return "rows", canon, [(a, b)], S
        if rest.startswith("mlp.shared_expert.down_proj."):
            return "cols", canon, [(a, b)], S
        I = c.moe_intermediate_size
        i0, i1 = self.moe_inter
        ex = self.experts
        if rest in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            if ex.partitioned:
                return "experts", canon, [(ex.first, ex.first + ex.count)], c.num_experts
            if rest.endswith("gate_up_proj"):
                return "rows1", canon, [(i0, i1), (I + i0, I + i1)], 2 * I
            return "cols", canon, [(i0, i1)], I
        m = _EXPERT.search(rest)
        if m:
            e = int(m[2])
            if ex.partitioned:
                if not ex.first <= e < ex.first + ex.count:
                    return None
                local = canon[: canon.index(rest)] + rest[: m.start()] + f"{m[1]}{e - ex.first}{m[3]}"
                return "whole", local, [], 0
            if m[3].startswith((".gate_proj.", ".up_proj.")):
                return "rows", canon, [(i0, i1)], I
            if m[3].startswith(".down_proj."):
                return "cols", canon, [(i0, i1)], I
        return "whole", canon, [], 0  # router, shared_expert_gate

    # ---- applying it ----------------------------------------------------------------------------
    def take(self, name: str, src) -> tuple[str, torch.Tensor] | None:
        """This rank's (canonical name, tensor) of checkpoint tensor `name`, or None. `src`: a tensor
        or a safetensors slice (only the parts taken are read)."""
        canon = canonical_name(name)
        if not self.shard.parallel:
            return name, _read_all(src)
        p = self.plan(canon)
        if p is None:
            return None
        kind, out_name, ranges, total = p
        shape = _shape(src)
        if kind == "whole" or len(shape) == 0 or _numel(shape) == 1:
            return out_name, _read_all(src)
        if kind == "cols":
            if len(shape) < 2 or shape[-1] == 1:  # a per-row scale of a column-cut weight
                return out_name, _read_all(src)
            dim = len(shape) - 1
        elif kind == "rows1":
            dim = 1
        else:  # rows, experts
            dim = 0
        n = shape[dim]
        if any((x * n) % total for r in ranges for x in r):
            raise ValueError(f"{name}: dim {dim} of size {n} cannot be cut at {ranges} of {total}")
        phys = [(a * n // total, b * n // total) for a, b in ranges]
        parts = [_read(src, dim, a, b, len(shape)) for a, b in phys]
        return out_name, parts[0] if len(parts) == 1 else torch.cat(parts, dim)


def _shape(src) -> tuple[int, ...]:
    return tuple(src.shape)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _read_all(src) -> torch.Tensor:
    return src if isinstance(src, torch.Tensor) else src.read()


def _read(src, dim: int, a: int, b: int, ndim: int) -> torch.Tensor:
    idx = (slice(None),) * dim + (slice(a, b),)
    if isinstance(src, torch.Tensor):
        return src[idx]
    return src[idx + (slice(None),) * (ndim - dim - 1)]


__all__ = ["ShardSlicer"]
