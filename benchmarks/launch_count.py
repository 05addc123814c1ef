"""Kernel launches of one decode step, counted on the CPU (no GPU): `linrnn-serve bench launches`.

The model (default: the 35B-A3B NVFP4 preset's shapes) is built on the meta device, so no weight
memory is allocated. The runner's captured decode region (ModelRunner._decode_forward: embedding ->
layers -> lm_head -> logits copy -> greedy argmax) runs with the Triton launchers selected
(linrnn_kernels.dispatch.triton_on("meta")), and

  * every Triton kernel launch is intercepted and counted by kernel name (nothing runs);
  * every torch operator that launches device work on CUDA is counted by operator name: all aten
    ops except views, allocations (empty*) and pure metadata ops. A cuBLAS GEMM counts as one
    launch (cuBLAS adds a split-K reduce kernel on some shapes: the GPU profile counts those).

The GPU profile of `bench batched --profile` reports the measured count (`launches/step`); this
one makes progress measurable before a GPU run and names where the launches come from.

    linrnn-serve bench launches --npl 1            # table by source, total per step
    linrnn-serve bench launches --prefill-tokens 128   # one eager prefill forward instead
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import json

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# aten ops that never launch a kernel (allocation / metadata); views are detected from the schema
_NO_LAUNCH = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "alias",
              "lift_fresh", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "size", "stride",
              "is_same_size", "_to_copy_noop", "set_", "resize_"}


class _OpCounter(TorchDispatchMode):
    def __init__(self, counts: collections.Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        out = func(*args, **kwargs)
        may_alias = any(a.alias_info is not None and not a.alias_info.is_write for a in func._schema.returns)
        if may_alias:  # a view, or an op like to / reshape / contiguous that copies only when it must
            src = args[0] if args and isinstance(args[0], torch.Tensor) else None
            outs = out if isinstance(out, (tuple, list)) else (out,)
            copied = src is not None and any(isinstance(o, torch.Tensor) and not _aliases(o, src) for o in outs)
            if copied:
                self.counts[f"torch:{name}"] += 1
        elif name not in _NO_LAUNCH:
            self.counts[f"torch:{name}"] += 1
        return out


def _aliases(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage()._cdata == b.untyped_storage()._cdata


@contextlib.contextmanager
def _intercept_triton(counts: collections.Counter):
    """Count Triton kernel launches by name instead of compiling and running them (compiled kernels,
    autotuned ones, and the interpreter's twins under TRITON_INTERPRET=1)."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    def fn_name(f):
        while hasattr(f, "fn"):
            f = f.fn
        return f.__name__

    def run(self, *args, **kwargs):
        counts[f"triton:{fn_name(self)}"] += 1

    saved = [(cls, cls.run) for cls in (JITFunction, Autotuner, InterpretedFunction)]
    for cls, _ in saved:
        cls.run = run
    try:
        yield
    finally:
        for cls, orig in saved:
            cls.run = orig


def count_decode_launches(cfg, npl: int, dtype=torch.bfloat16, quant="auto") -> collections.Counter:
    """Launch counts of one captured decode step at batch npl (bucket size) for ModelConfig cfg."""
    from linrnn_kernels.dispatch import triton_on
    from linrnn_serve.cache import HybridStateCache, ModelCaches, PagedKVCache
    from linrnn_serve.models.loading import quant_plan
    from linrnn_serve.models.registry import build_model
    from linrnn_serve.runner.model_runner import ModelRunner

    meta = torch.device("meta")
    model = build_model(cfg, dtype, meta, quant_plan(cfg) if quant == "auto" else quant)
    block_size = 16
    caches = ModelCaches(HybridStateCache(cfg, npl + 1, dtype, meta), PagedKVCache(cfg, 4 * npl + 1, block_size, dtype, meta))
    runner = ModelRunner(model, caches, max_num_seqs=npl, max_model_len=64, block_size=block_size,
                         enforce_eager=True, progress=False)
    # one uncounted pass first: modules imported lazily on the first call build their tables at import
    # (nvfp4_layout's scale codes), which is no per-step work
    with torch.inference_mode(), triton_on("meta"), _intercept_triton(collections.Counter()):
        runner._decode_forward(npl)
    counts: collections.Counter = collections.Counter()
    with torch.inference_mode(), triton_on("meta"), _intercept_triton(counts), _OpCounter(counts):
        runner._decode_forward(npl)
    return counts


def count_prefill_launches(cfg, tokens: int, dtype=torch.bfloat16, quant="auto") -> collections.Counter:
    """Launch counts of one eager prefill forward of a single `tokens`-token prompt (what a prefill CUDA
    graph replays at once up to runner/prefill_graphs.PREFILL_GRAPH_MAX_TOKENS tokens). On meta tensors
    the MoE takes the grouped-GEMM path (the Hopper MMA kernel needs a GPU): a few launches per layer differ."""
    from linrnn_kernels.dispatch import triton_on
    from linrnn_serve.cache import HybridStateCache, ModelCaches, PagedKVCache
    from linrnn_serve.models.loading import quant_plan
    from linrnn_serve.models.registry import build_model
    from linrnn_serve.runner.inputs import SeqWork, build_forward_batch

    import linrnn_kernels.moe.nvfp4_mma  # noqa: F401 (its import builds lookup tables: not the forward's launches)

    meta = torch.device("meta")
    model = build_model(cfg, dtype, meta, quant_plan(cfg) if quant == "auto" else quant)
    block_size = 16
    blocks = -(-tokens // block_size)
    caches = ModelCaches(HybridStateCache(cfg, 2, dtype, meta), PagedKVCache(cfg, blocks + 1, block_size, dtype, meta))
    batch = build_forward_batch([SeqWork([1] * tokens, 0, 1, list(range(1, blocks + 1)))], block_size, meta)
    counts: collections.Counter = collections.Counter()
    with torch.inference_mode(), triton_on("meta"), _intercept_triton(counts), _OpCounter(counts):
        model(batch, caches)
    return counts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="qwen35moe-nvfp4", help="preset name or checkpoint dir (config only)")
    p.add_argument("--npl", default="1", help="comma list of batch sizes")
    p.add_argument("--prefill-tokens", default=None,
                   help="comma list: count one eager prefill forward of a prompt of that many tokens instead")
    p.add_argument("--json", default=None, help="write {npl (or tokens): {name: count}} here")
    p.add_argument("--top", type=int, default=40)


def run(args) -> int:
    from linrnn_serve.presets import resolve_model

    cfg = resolve_model(args.model, "dummy").cfg
    out = {}
    prefill = args.prefill_tokens is not None
    for n in (int(v) for v in (args.prefill_tokens if prefill else args.npl).split(",")):
        c = count_prefill_launches(cfg, n) if prefill else count_decode_launches(cfg, n)
        total = sum(c.values())
        out[n] = dict(c)
        what = f"prefill forward of {n} tokens" if prefill else f"decode step at npl {n}"
        print(f"{what}: {total} launches ({sum(v for k, v in c.items() if k.startswith('triton:'))} "
              f"Triton, {sum(v for k, v in c.items() if k.startswith('torch:'))} torch ops)")
        print("| source | launches/step |\n|---|---:|")
        for name, n in c.most_common(args.top):
            print(f"| `{name}` | {n} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
