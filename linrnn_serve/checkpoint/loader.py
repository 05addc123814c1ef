"""Load a checkpoint into a constructed model, checking that every parameter row is filled exactly
once. Failures name the file, the tensor and the expected vs found shape; missing tensors are named
by their standard checkpoint names."""
from __future__ import annotations

import logging
import os
from typing import Iterable

import torch
from tqdm.auto import tqdm

from linrnn_serve.checkpoint.errors import CheckpointError
from linrnn_serve.checkpoint.layout import Target, canonical_name, resolve, skipped, standard_names
from linrnn_serve.checkpoint.reader import CheckpointReader, tensor_nbytes

log = logging.getLogger(__name__)


def _same_shape(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Equal up to size-1 dims: scales come as [] or [1], per-channel scales as [N] or [N, 1]."""
    return a == b or [d for d in a if d != 1] == [d for d in b if d != 1]


class WeightLoader:
    """Places checkpoint tensors (by HF name) into a model built by models.build_model."""

    def __init__(self, model: torch.nn.Module, skip_mtp: bool = True):
        # a tensor-parallel rank's model is checked against its slice's config (parallel.local_config)
        self.model, self.cfg, self.skip_mtp = model, getattr(model, "local_cfg", model.cfg), skip_mtp
        self.params = dict(model.named_parameters())
        self.covered: dict[str, torch.Tensor] = {}  # param -> bool over its row dims
        self.loaded_from: dict[str, str] = {}

    # ---- placement -----------------------------------------------------------------------
    def load(self, name: str, tensor: torch.Tensor, source: str) -> None:
        canon = canonical_name(name)
        if skipped(canon, self.skip_mtp):
            return
        targets = resolve(self.cfg, canon)
        if targets is None:
            raise CheckpointError(f"{source}: unexpected tensor {name} {tuple(tensor.shape)}: not part of this "
                                  f"{self.cfg.model_type} model ({self.cfg.num_hidden_layers} layers, "
                                  f"{self.cfg.num_experts} experts)")
        for t in targets:
            self._place(t, name, tensor, source)

    def _place(self, tg: Target, name: str, src: torch.Tensor, source: str) -> None:
        if tg.param is not None:
            pname = f"{tg.module}.{tg.param}" if tg.module else tg.param
            if tuple(src.shape) != tg.shape:
                raise CheckpointError(f"{source}: tensor {name} has shape {tuple(src.shape)}, expected {tg.shape}")
            val = tg.transform(src) if tg.transform else src
            self._mark(pname, None, slice(None), name, source)
            self.params[pname].data.copy_(val)
            return
        mod = self.model.get_submodule(tg.module)
        if tg.part == "gate_up":  # fused 3-D experts: both halves at once
            group, start, rows, gpath = mod.w13, 0, mod.w13.n, "w13"
        else:
            group, start, rows, gpath = mod.locate(tg.part)
        if group.fmt == "dense" and (not src.dtype.is_floating_point or src.dtype.itemsize == 1):
            raise CheckpointError(
                f"{source}: tensor {name} {tuple(src.shape)} holds {src.dtype} (quantized) data, but this model "
                f"stores {tg.module} ({tg.part}) dense: the quantization config does not mark it quantized")
        specs = group.checkpoint_tensors(rows)
        spec = specs.get(tg.suffix)
        if spec is None:
            raise CheckpointError(
                f"{source}: tensor {name}: this model stores {tg.module} ({tg.part}) as {group.fmt}, "
                f"which has no '{tg.suffix}' tensor (expects {sorted(specs)}); check the quantization config")
        val = tg.transform(src) if tg.transform else src
        want = ((group.experts,) if tg.all_experts else ()) + spec.shape
        if not _same_shape(tuple(val.shape), want):
            extra = "" if val.shape == src.shape else f" (de-interleaved {tuple(val.shape)})"
            raise CheckpointError(f"{source}: tensor {name} has shape {tuple(src.shape)}{extra}, expected {want} "
                                  f"({group.fmt} storage of {tg.module} part {tg.part})")
        if spec.attr is None:  # recognised but unused (e.g. input_scale of a weight-only kernel)
            return
        val = val.reshape(want)  # e.g. a [1] or [N, 1] scale into a [] or [N] spec
        pname = f"{tg.module}.{gpath}.{spec.attr}"
        dst = getattr(group, spec.attr)
        if tg.expert is not None:
            dst = dst[tg.expert]
        elif tg.all_experts:
            dst = dst.transpose(0, 1)[start:start + rows].transpose(0, 1)  # rows are dim 1
        if not tg.all_experts:
            dst = dst[start:start + rows]
        try:  # format transforms check dtypes and scale values (layers/quant.py)
            val = spec.transform(val, dst) if spec.transform else val
        except ValueError as e:
            raise CheckpointError(f"{source}: tensor {name} {tuple(src.shape)} {src.dtype} for {tg.module} "
                                  f"part {tg.part} ({group.fmt}): {e}") from None
        self._mark(pname, tg.expert, slice(start, start + rows), name, source)
        dst.copy_(val)

    def _mark(self, pname, expert, rows, name, source):
        """Record that `rows` of `pname` (for one expert, or all) are filled; reject overlaps."""
        p = self.params[pname]
        kind = self._kind(pname)
        if pname not in self.covered:
            shape = {"plain": (1,), "rows": p.shape[:1], "expert": p.shape[:2]}[kind]
            self.covered[pname] = torch.zeros(shape, dtype=torch.bool)
        cov = self.covered[pname]
        if kind == "plain":
            region = cov
        elif kind == "rows":
            region = cov[rows]
        else:
            region = cov[expert, rows] if expert is not None else cov[:, rows]
        if region.any():
            raise CheckpointError(f"{source}: tensor {name} fills {pname} rows that were already loaded "
                                  f"(from {self.loaded_from.get(pname, '?')}): duplicate tensor")
        region.fill_(True)
        self.loaded_from[pname] = name

    @staticmethod
    def _kind(pname: str) -> str:
        if ".experts.w13." in pname or ".experts.w2." in pname:
            return "expert"
        if ".groups." in pname:
            return "rows"
        return "plain"

    # ---- completion ----------------------------------------------------------------------
    def finish(self, source: str) -> None:
        cfg = self.cfg
        head = "lm_head.groups.0.weight"
        if cfg.tie_word_embeddings and head in self.params and not self._complete(head):
            self.params[head].data.copy_(self.params["embed_tokens"])
            self.covered[head] = torch.ones(cfg.vocab_size, dtype=torch.bool)
        incomplete = [n for n in self.params if not self._complete(n)]
        if not incomplete:
            self._repack(source)
            return
        missing = [n for n in standard_names(cfg, self._required_suffixes) if not self._name_covered(n)]
        shown = ", ".join(missing[:8]) + (f", ... ({len(missing)} in all)" if len(missing) > 8 else "")
        raise CheckpointError(f"{source}: checkpoint is missing tensors: {shown or incomplete[:8]}")

    def _repack(self, source: str) -> None:
        """Kernel-specific weight layouts, built once all rows are in (e.g. NVFP4 experts as MMA
        fragments for the Hopper decode kernel: layers/moe.py Experts.repack_for_kernels)."""
        for name, mod in self.model.named_modules():
            if hasattr(mod, "repack_for_kernels"):
                try:
                    mod.repack_for_kernels(name)
                except ValueError as e:
                    raise CheckpointError(f"{source}: {e}") from None

    def _complete(self, pname: str) -> bool:
        cov = self.covered.get(pname)
        return cov is not None and bool(cov.all())

    def _required_suffixes(self, hf_module: str) -> list[str]:
        targets = resolve(self.cfg, hf_module + ".weight") or []
        for tg in targets:
            mod = self.model.get_submodule(tg.module)
            group = mod.locate(tg.part)[0]
            return [s for s, spec in group.checkpoint_tensors(1).items() if not spec.optional]
        return ["weight"]

    def _name_covered(self, canon: str) -> bool:
        for tg in resolve(self.cfg, canon) or []:
            if tg.param is not None:
                if not self._complete(f"{tg.module}.{tg.param}" if tg.module else tg.param):
                    return False
                continue
            mod = self.model.get_submodule(tg.module)
            group, start, rows, gpath = mod.locate(tg.part)
            spec = group.checkpoint_tensors(rows).get(tg.suffix)
            if spec is None or spec.attr is None:
                continue
            cov = self.covered.get(f"{tg.module}.{gpath}.{spec.attr}")
            if cov is None:
                return False
            region = cov[tg.expert] if tg.expert is not None else cov
            if not bool(region[start:start + rows].all()):
                return False
        return True


def _slicer(model):
    """The rank's ShardSlicer for a tensor-parallel model shard, else None."""
    shard = getattr(model, "shard", None)
    if shard is None or not shard.parallel:
        return None
    from linrnn_serve.checkpoint.sharding import ShardSlicer

    return ShardSlicer(model.cfg, shard)


def load_checkpoint(model: torch.nn.Module, path: str | os.PathLike, progress: bool = True,
                    skip_mtp: bool = True, tick=None) -> None:
    """Load a safetensors checkpoint; a tensor-parallel shard reads only its slice of each tensor
    from the memory-mapped files (checkpoint/sharding.py). `tick(what)`: called every few tensors
    (a rank's progress mark, runner/rank_watch.py)."""
    reader = CheckpointReader(path)
    loader = WeightLoader(model, skip_mtp)
    slicer = _slicer(model)
    with tqdm(total=reader.nbytes(), unit="B", unit_scale=True, desc="Loading checkpoint",
              disable=not progress) as bar:
        if slicer is None:
            for name, t, fn in _ticking(reader.iter_tensors(), tick):
                loader.load(name, t, os.path.join(str(path), fn))
                bar.update(tensor_nbytes(t))
        else:
            for name, lazy, fn in _ticking(reader.iter_lazy(), tick):
                if skipped(canonical_name(name), skip_mtp):
                    continue
                try:
                    got = slicer.take(name, lazy)
                except ValueError as e:
                    raise CheckpointError(f"{os.path.join(str(path), fn)}: {e}") from None
                if got is not None:
                    loader.load(got[0], got[1], os.path.join(str(path), fn))
                    bar.update(tensor_nbytes(got[1]))
    loader.finish(str(path))


def _ticking(items, tick, every: int = 2048):
    """`items`, calling tick("weights: N tensors") every `every` of them (no-op without tick)."""
    if tick is None:
        yield from items
        return
    for n, item in enumerate(items):
        if n % every == 0:
            tick(f"weights: {n} tensors read")
        yield item


def load_tensors(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], source: str,
                 progress: bool = False, tick=None) -> None:
    """Load from an in-memory stream of (HF name, tensor): `--load-format dummy` and tests. A
    tensor-parallel shard keeps its slice of each. `tick`: as load_checkpoint's."""
    loader = WeightLoader(model)
    slicer = _slicer(model)
    for name, t in tqdm(_ticking(tensors, tick), desc="Initialising weights", disable=not progress):
        if slicer is not None:
            got = slicer.take(name, t)
            if got is None:
                continue
            name, t = got
        loader.load(name, t, source)
    loader.finish(source)
