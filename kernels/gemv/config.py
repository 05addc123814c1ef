"""The tuning knobs of the small-batch decode kernels, in one place.

Switches (environment, read per call so a benchmark can flip them without code changes). The fusions are
ON by default: on the H200 (35B-A3B NVFP4 dummy, benchmarks/results/batched/small_fused_ab/) they measured
faster than the unfused kernels at npl 1 and 8, and they stand aside where the measured table says the
unfused chain is faster (every projection above its max_m, every batch above 32 rows).
  LINRNN_SKINNY_GEMM=0            every projection to cuBLAS and every fusion as its unfused chain (default 1:
                                  the skinny GEMM with the fused prologues / epilogues where the table says so)
  LINRNN_SKINNY_MAX_M=N           largest batch (rows) sent to the skinny GEMM (default 32)
  LINRNN_SKINNY_TABLE=path.json   the per-projection table to use instead of kernels/gemv/tuned.json (measured
                                  on the H200 by tools/gpu_small_ab.sh); `bench kernels --only gemv` writes one:
                                  {"N,K,fmt[,fusion]": {"max_m": 8, "1": [block_n, block_k, split_k, warps,
                                  stages, dot(, one_shot(, split_prologue))], ...}, "router": {...}}; max_m: the largest M where the fused call
                                  beat the unfused chain (0 = never)
  LINRNN_FUSED_ROUTER=0           the router's gate GEMM, softmax / top-k and expert alignment as separate
                                  kernels (default 1: one launch, with the shared expert's gate_up, up to the
                                  table's router max_m)
  LINRNN_FUSED_MOE_COMBINE=0      the routed experts' top-k / split-K combine as its own kernel (default 1: inside
                                  the shared expert's down projection, gate_add epilogue; H200, 2a73ece: 2.715 vs
                                  2.791 ms/step at npl 1, 4.562 vs 4.643 at npl 8, 367 vs 407 launches)
  LINRNN_PDL=0                    no programmatic dependent launch for these kernels (default 1 on sm_90+: the
                                  next kernel launches while this one runs and issues its first weight tiles before
                                  it waits; H200, benchmarks/results/batched/small_round3/: 2.489 vs 2.619 ms/step at
                                  npl 1, equal at npl 8 and 128. The first version, an L2 prefetch of the whole
                                  weight slice, measured slower and is gone)

`skinny_config(M, N, K, fmt, device)`: the table's config, else a default: FMA up to 4 rows, tensor-core dots
(rows padded to 16) above; enough programs (N tiles x K splits) for ~4 / ~2 per SM; 16-byte weight loads.
Table configs may also be one-shot (a program's K slice is one tile, loaded whole before the PDL wait) and split
the prologue into its own launch (the K = 4096 out projections from 3 rows: recomputing the gated norm / sigmoid
gate in every N tile cost more than the launch; H200, benchmarks/results/small_round5/).
"""
from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass

import torch

MAX_M = 32


@dataclass(frozen=True)
class SkinnyConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3
    use_dot: bool = False
    min_block_m: int = 16  # rows are padded to this for tensor-core dots
    # one K tile per program (k slice = block_k, split = K / block_k, split_k ignored): the whole weight slice is
    # loaded before the PDL wait, no K loop (skinny.py ONE_SHOT)
    one_shot: bool = False
    # the gated-norm / sigmoid-gate prologue in its own launch (skinny.split_prologue) instead of in every N tile
    split_prologue: bool = False

    def astuple(self) -> list:
        t = [self.block_n, self.block_k, self.split_k, self.num_warps, self.num_stages, int(self.use_dot)]
        if self.split_prologue:
            return t + [int(self.one_shot), 1]
        return t + [1] if self.one_shot else t


def _num_sms(device) -> int:
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132


def _pow2_floor(v: int) -> int:
    return 1 << (max(1, v).bit_length() - 1)


def split_for(N: int, K: int, block_n: int, block_k: int, target: int) -> int:
    """Smallest power-of-two K split that gives `target` programs (N tiles x splits), at most one per K step."""
    n_tiles = -(-N // block_n)
    k_steps = -(-K // block_k)
    split = 1
    while n_tiles * split < target and split * 2 <= k_steps and split < 32:
        split *= 2
    return split


def skinny_config(M: int, N: int, K: int, fmt: str, device, head: int = 0, kind: str = "") -> SkinnyConfig:
    """Config for an [M, K] x [N, K]^T projection (N output columns; the gated epilogue reads 2N weight
    rows): the measured table's entry for (N, K, fmt) when there is one, else the default below.
    `head`: the gated-norm prologue needs block_k to be a multiple of it.
    Default: FMA up to 4 rows ([M, block_n, block_k] products held in registers, <= 64 per thread, about 4
    programs per SM); tensor-core dots (rows padded to 16) from 8 rows, about 2 programs per SM."""
    over = _table_entry(N, K, fmt, M, kind)
    if over is not None and (not head or over.block_k % head == 0):
        return over
    sms = _num_sms(device)
    if M <= 4:
        block_n, block_k = (16, 256) if M <= 2 else (8, 256)
        block_k = min(block_k, max(8, _pow2_floor(K)))
        if head:
            block_k = max(block_k // head, 1) * head
        return SkinnyConfig(block_n, block_k, split_for(N, K, block_n, block_k, 4 * sms), 4, 1, False)
    block_n, block_k = 64, 128
    if head:
        block_k = max(block_k // head, 1) * head
    return SkinnyConfig(block_n, block_k, split_for(N, K, block_n, block_k, 2 * sms), 4, 4, True)


def router_config(M: int, N: int, K: int, device) -> SkinnyConfig:
    """Config of the fused router's GEMM tiles (N: router rows + the shared expert's gate_up columns)."""
    over = _table_entry(N, K, "router", M)
    return over if over is not None else skinny_config(M, N, K, "dense", device)


ROUTER_TAIL_DEFAULT = ("reg_align", "logit_keys")


def router_tail(M: int) -> tuple[str, ...]:
    """How the fused router's finishing program routes M rows (router_fused.RouterTail's fields that are on): the
    table's router "tail" entry ({"M": "replicate,logit_keys", ...}, the first M key >= M), else
    ROUTER_TAIL_DEFAULT."""
    t = (_table(0, 0, "router") or {}).get("tail") or {}
    for m, spec in sorted(((int(k), v) for k, v in t.items()), key=lambda kv: kv[0]):
        if M <= m:
            return tuple(v for v in spec.split(",") if v)
    return ROUTER_TAIL_DEFAULT


@functools.lru_cache(maxsize=8)
def _load_table(path: str) -> dict:
    with open(path) as f:
        return json.load(f)


TUNED = os.path.join(os.path.dirname(__file__), "tuned.json")


def table_key(N: int, K: int, fmt: str, kind: str = "") -> str:
    """Key of a projection in the measured table: its shape, weight format and fusion (the prologue, or else
    the epilogue, that the call site fuses: "gated_norm", "sigmoid_gate", "conv", "gate_add", ...)."""
    return "router" if fmt == "router" else f"{N},{K},{fmt}" + (f",{kind}" if kind and kind != "none" else "")


def _table(N: int, K: int, fmt: str, kind: str = "") -> dict | None:
    path = os.environ.get("LINRNN_SKINNY_TABLE") or (TUNED if os.path.exists(TUNED) else None)
    if not path:
        return None
    return _load_table(path).get(table_key(N, K, fmt, kind))


def _table_entry(N: int, K: int, fmt: str, M: int, kind: str = "") -> SkinnyConfig | None:
    t = _table(N, K, fmt, kind)
    if not t:
        return None
    for m, spec in sorted(((int(k), v) for k, v in t.items() if k.isdigit()), key=lambda kv: kv[0]):
        if M <= m:
            bn, bk, split, warps, stages, dot = spec[:6]
            return SkinnyConfig(bn, bk, split, warps, stages, bool(dot), one_shot=len(spec) > 6 and bool(spec[6]),
                                split_prologue=len(spec) > 7 and bool(spec[7]))
    return None


def skinny_enabled(M: int, N: int, K: int, fmt: str, kind: str = "") -> bool:
    """Whether a projection of M rows goes to the skinny GEMM (else cuBLAS / the unfused chain); `kind`: the
    fusion of the call (table_key)."""
    if os.environ.get("LINRNN_SKINNY_GEMM", "1") == "0" or fmt not in ("dense", "fp8"):
        return False
    limit = min(int(os.environ.get("LINRNN_SKINNY_MAX_M", MAX_M)), MAX_M)
    t = _table(N, K, fmt, kind)
    if t is not None and "max_m" in t:
        limit = min(limit, int(t["max_m"]))
    return 1 <= M <= limit


def fused_router_enabled(M: int = 1) -> bool:
    """Whether the router of an M-row batch runs as the one fused kernel (router_fused.py)."""
    if os.environ.get("LINRNN_FUSED_ROUTER", "1") == "0":
        return False
    t = _table(0, 0, "router")
    return M <= (int(t["max_m"]) if t is not None and "max_m" in t else MAX_M)


def fused_moe_combine_enabled() -> bool:
    return os.environ.get("LINRNN_FUSED_MOE_COMBINE", "1") != "0"


def pdl_available(device) -> bool:
    from linrnn_kernels.gemv import skinny

    if skinny.gdc_wait is None or not (isinstance(device, torch.device) and device.type == "cuda"):
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch_kwargs(x: torch.Tensor) -> dict:
    """Launch options of a kernel that supports PDL: its PDL constexpr, plus Triton's launch_pdl."""
    on = os.environ.get("LINRNN_PDL", "1") != "0" and pdl_available(x.device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
