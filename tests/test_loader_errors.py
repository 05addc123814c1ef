"""A bad checkpoint fails with a message naming the file, tensor (or shard) and shapes (issue #2)."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import make_hf_checkpoint
from linrnn_serve.checkpoint import CheckpointError
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model


def _load(path):
    return load_model(ModelConfig.from_pretrained(path), str(path), torch.float32, "cpu", progress=False)


def _edit(path, fn):
    """Apply fn(tensors) -> tensors to the shard holding layer 3's k_proj; return (shard, name)."""
    idx = json.load(open(os.path.join(path, "model.safetensors.index.json")))["weight_map"]
    name = "model.layers.3.self_attn.k_proj.weight"
    shard = os.path.join(path, idx[name])
    tensors = load_file(shard)
    save_file(fn(tensors, name), shard)
    return shard, name


@pytest.fixture
def ckpt(tmp_path):
    return make_hf_checkpoint(tmp_path)


def test_wrong_shape_names_file_tensor_and_shapes(ckpt):
    def widen(t, name):
        t[name] = torch.randn(t[name].shape[0] + 1, t[name].shape[1])
        return t
    shard, name = _edit(ckpt, widen)
    with pytest.raises(CheckpointError) as e:
        _load(ckpt)
    msg = str(e.value)
    assert os.path.basename(shard) in msg and name in msg and "(65, 64)" in msg and "(64, 64)" in msg


def test_missing_tensor_is_named(ckpt):
    def drop(t, name):
        del t[name]
        return t
    _edit(ckpt, drop)
    # keep the index consistent with the shard, so the failure is "missing", not "not in file"
    p = os.path.join(ckpt, "model.safetensors.index.json")
    idx = json.load(open(p))
    del idx["weight_map"]["model.layers.3.self_attn.k_proj.weight"]
    json.dump(idx, open(p, "w"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.3\.self_attn\.k_proj\.weight"):
        _load(ckpt)


def test_missing_shard_is_named(ckpt):
    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    shard = idx["model.layers.3.self_attn.k_proj.weight"]
    os.remove(os.path.join(ckpt, shard))
    with pytest.raises(CheckpointError, match=f"shard {shard} .* is missing"):
        _load(ckpt)


def test_unexpected_tensor_is_named(ckpt):
    def add(t, name):
        t["model.layers.3.self_attn.bogus.weight"] = torch.randn(2, 2)
        return t
    shard, _ = _edit(ckpt, add)
    p = os.path.join(ckpt, "model.safetensors.index.json")
    idx = json.load(open(p))
    idx["weight_map"]["model.layers.3.self_attn.bogus.weight"] = os.path.basename(shard)
    json.dump(idx, open(p, "w"))
    with pytest.raises(CheckpointError, match=r"unexpected tensor model\.layers\.3\.self_attn\.bogus\.weight"):
        _load(ckpt)


def test_truncated_shard_is_named(ckpt):
    idx = json.load(open(os.path.join(ckpt, "model.safetensors.index.json")))["weight_map"]
    shard = os.path.join(ckpt, idx["model.embed_tokens.weight"])
    data = open(shard, "rb").read()
    open(shard, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=os.path.basename(shard)):
        _load(ckpt)
