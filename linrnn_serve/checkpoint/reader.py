"""Read safetensors checkpoints lazily: single-file, multi-file, or sharded with an index.

Tensors are memory-mapped and read one at a time (the checkpoint is never copied whole into RAM).
"""
from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
from safetensors import safe_open

from linrnn_serve.checkpoint.errors import CheckpointError

INDEX = "model.safetensors.index.json"


class CheckpointReader:
    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not os.path.isdir(self.path):
            raise CheckpointError(f"{self.path}: checkpoint directory does not exist")
        self.file_of: dict[str, str] = {}
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise CheckpointError(f"{index}: malformed index ({e})") from e
            for shard in sorted(set(weight_map.values())):
                if not os.path.isfile(os.path.join(self.path, shard)):
                    names = [n for n, s in weight_map.items() if s == shard]
                    raise CheckpointError(
                        f"{self.path}: shard {shard} listed in {INDEX} is missing "
                        f"({len(names)} tensors, e.g. {names[0]})"
                    )
            self.file_of = dict(weight_map)
        else:
            files = sorted(f for f in os.listdir(self.path) if f.endswith(".safetensors"))
            if not files:
                raise CheckpointError(f"{self.path}: no *.safetensors files and no {INDEX}")
            for fn in files:
                with self._open(fn) as f:
                    for name in f.keys():
                        self.file_of[name] = fn
        self._meta: dict[str, tuple[tuple[int, ...], str]] = {}

    def _open(self, fn: str):
        try:
            return safe_open(os.path.join(self.path, fn), framework="pt", device="cpu")
        except Exception as e:  # safetensors raises its own error types for truncated/corrupt files
            raise CheckpointError(f"{os.path.join(self.path, fn)}: unreadable safetensors file ({e})") from e

    def names(self) -> list[str]:
        return list(self.file_of)

    def iter_tensors(self):
        """Yield (name, tensor, file) grouped by file, one tensor at a time."""
        for n, lazy, fn in self.iter_lazy():
            yield n, lazy.read(), fn

    def iter_lazy(self):
        """Yield (name, LazyTensor, file) like iter_tensors, without reading: the caller reads the
        parts it needs (rank-sliced loading, checkpoint/sharding.py)."""
        by_file = defaultdict(list)
        for n, fn in self.file_of.items():
            by_file[fn].append(n)
        for fn in sorted(by_file):
            with self._open(fn) as f:
                present = set(f.keys())
                for n in by_file[fn]:
                    if n not in present:
                        raise CheckpointError(f"{os.path.join(self.path, fn)}: tensor {n} listed in {INDEX} "
                                              f"is not in the file")
                    yield n, LazyTensor(f, n, os.path.join(self.path, fn)), fn

    def nbytes(self) -> int:
        return sum(os.path.getsize(os.path.join(self.path, fn)) for fn in set(self.file_of.values()))


class LazyTensor:
    """A memory-mapped checkpoint tensor not read yet: `.shape`, `lazy[idx]` reads only the indexed
    rows / columns (safetensors `get_slice`), `read()` the whole tensor."""

    def __init__(self, f, name: str, path: str):
        self._f, self.name, self.path = f, name, path
        try:
            self._slice = f.get_slice(name)
            self.shape = tuple(self._slice.get_shape())
        except Exception as e:
            raise CheckpointError(f"{path}: cannot read tensor {name} ({e})") from e

    def __getitem__(self, idx) -> torch.Tensor:
        try:
            return self._slice[idx]
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {self.name} ({e})") from e

    def read(self) -> torch.Tensor:
        try:
            return self._f.get_tensor(self.name)
        except Exception as e:
            raise CheckpointError(f"{self.path}: cannot read tensor {self.name} ({e})") from e


def tensor_nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
