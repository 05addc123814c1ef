"""Tensor / expert parallelism on the CPU (gloo, several processes on 127.0.0.1): a sharded tiny
model gives the single-process greedy tokens and logits within 1e-5 relative (max |diff| / max |ref|),
all-f32 and hybrid state, tensor-parallel and expert-parallel MoE; each rank holds only its slice.

Hybrid state: the prefill logits (no bf16 state read yet) are held to 1e-5; once decode reads
bf16-rounded state, an f32 difference of one ulp (the all-reduce's summation order) flips bf16
roundings and the logits move by up to ~1e-4 in a single process too. Those steps are held to
twice the single-process noise floor, measured here by perturbing the embedding by one ulp.
"""
from __future__ import annotations

import math
import socket

import pytest
import torch
import torch.multiprocessing as mp

import tp_ranks
from linrnn_serve.config import ConfigError
from linrnn_serve.parallel import Shard, local_config


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from linrnn_serve.checkpoint import synth

    return synth.cached_preset_dir("tiny", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """tau -> (logits, tokens, per-step noise floor)."""
    model = tp_ranks.load(tiny_dir)
    out = {}
    with torch.inference_mode():
        for tau in (math.inf, _hybrid_tau(model)):
            out[tau] = tp_ranks.run_model(model, tau) + (_noise_floor(model, tau),)
    return out


@pytest.fixture(scope="module")
def other_dirs(tmp_path_factory):
    """tiny-next (fused qkvz / ba, per-expert experts, a dense-MLP layer) and tiny with NVFP4
    experts (ModelOpt layout, uint8 codes + E4M3 scales sliced from the memory-mapped file)."""
    import json

    from safetensors.torch import save_file

    from linrnn_serve.checkpoint import synth
    from linrnn_serve.checkpoint.synth import dummy_tensors
    from linrnn_serve.config import ModelConfig
    from linrnn_serve.presets import nvfp4_experts_quantization

    cache = str(tmp_path_factory.mktemp("cache"))
    tiny = synth.cached_preset_dir("tiny", cache)
    nv = tmp_path_factory.mktemp("tiny-nvfp4")
    with open(f"{tiny}/config.json") as f:
        hf = json.load(f)
    hf["quantization_config"] = nvfp4_experts_quantization()
    with open(nv / "config.json", "w") as f:
        json.dump(hf, f)
    cfg = ModelConfig.from_dict(hf)
    save_file({n: t.clone().contiguous() for n, t in dummy_tensors(cfg, dtype=torch.float32, seed=3)},
              str(nv / "model.safetensors"))
    return {"tiny-next": synth.cached_preset_dir("tiny-next", cache), "tiny-nvfp4": str(nv)}


@pytest.fixture(scope="module")
def other_refs(other_dirs):
    out = {}
    with torch.inference_mode():
        for name, d in other_dirs.items():
            out[name] = tp_ranks.run_model(tp_ranks.load(d), math.inf) + (torch.zeros(tp_ranks.DECODE_STEPS + 1),)
    return out


def _noise_floor(model, tau) -> torch.Tensor:
    """Per-step max relative logits change of the single process under a one-ulp random
    perturbation of the embedding (max over 3 draws); 0 for the all-f32 state (not used there)."""
    if math.isinf(tau):
        return torch.zeros(tp_ranks.DECODE_STEPS + 1)
    e0 = model.embed_tokens.detach().clone()
    ref = tp_ranks.run_model(model, tau)[0]
    floor = torch.zeros(ref.shape[0])
    for seed in range(3):
        g = torch.Generator().manual_seed(seed)
        model.embed_tokens.copy_(e0 * (1 + (torch.rand(e0.shape, generator=g) - 0.5) * 2 ** -22))
        out = tp_ranks.run_model(model, tau)[0]
        floor = torch.maximum(floor, torch.stack([_rel(a, b) for a, b in zip(out, ref)]))
    model.embed_tokens.copy_(e0)
    return floor


def _rel(a, b) -> torch.Tensor:
    return (a - b).abs().max() / b.abs().max()


def _hybrid_tau(model) -> float:
    """A threshold that puts about half of the GDN heads in bf16."""
    from linrnn_serve.classifier import head_timescales

    taus = torch.cat(head_timescales(model))
    return float(taus.median())


def _spawn(world, tiny_dir, ep, tau, tmp_path, load_format="auto"):
    mp.start_processes(tp_ranks.rank_main, args=(world, free_port(), tiny_dir, ep, tau, str(tmp_path), load_format),
                       nprocs=world, start_method="spawn", join=True)
    return [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]


def _check(ranks, ref):
    ref_logits, ref_toks, floor = ref
    bound = torch.maximum(torch.full_like(floor, 1e-5), 2 * floor)
    bound[0] = 1e-5  # prefill: every state still f32
    for r in ranks:
        assert r["tokens"] == ref_toks
        err = torch.stack([_rel(a, b) for a, b in zip(r["logits"], ref_logits)])
        assert (err <= bound).all(), (err.tolist(), bound.tolist())


@pytest.mark.parametrize("ep", [False, True], ids=["tp-moe", "ep-moe"])
@pytest.mark.parametrize("state", ["f32", "hybrid"])
def test_two_ranks_match_one_process(tiny_dir, reference, tmp_path, ep, state):
    taus = sorted(reference)  # [hybrid tau, inf]
    tau = math.inf if state == "f32" else taus[0]
    ranks = _spawn(2, tiny_dir, ep, tau, tmp_path)
    _check(ranks, reference[tau])
    full = sum(p.numel() for p in tp_ranks.load(tiny_dir).parameters())
    assert ranks[0]["params"] < 0.7 * full  # each rank holds its slice, not a copy
    assert ranks[0]["gdn_heads"] == 2


@pytest.mark.parametrize("model,ep", [("tiny-next", False), ("tiny-nvfp4", False), ("tiny-nvfp4", True)],
                         ids=["tiny-next-tp-moe", "tiny-nvfp4-tp-moe", "tiny-nvfp4-ep-moe"])
def test_two_ranks_other_layouts(other_dirs, other_refs, tmp_path, model, ep):
    _check(_spawn(2, other_dirs[model], ep, math.inf, tmp_path), other_refs[model])


@pytest.mark.slow
@pytest.mark.parametrize("ep", [False, True], ids=["tp-moe", "ep-moe"])
@pytest.mark.parametrize("state", ["f32", "hybrid"])
def test_four_ranks_match_one_process(tiny_dir, reference, tmp_path, ep, state):
    """4 > k heads (2) and kv heads (2): those are replicated per pair of ranks."""
    tau = math.inf if state == "f32" else sorted(reference)[0]
    ranks = _spawn(4, tiny_dir, ep, tau, tmp_path)
    _check(ranks, reference[tau])
    assert ranks[0]["gdn_heads"] == 1


@pytest.mark.slow
def test_four_ranks_qwen3_next(other_dirs, other_refs, tmp_path):
    """Fused qkvz / ba cut inside a k-head group (4 ranks > 2 k heads)."""
    _check(_spawn(4, other_dirs["tiny-next"], False, math.inf, tmp_path), other_refs["tiny-next"])


def test_local_config_and_errors(tiny_dir):
    from linrnn_serve.config import ModelConfig

    cfg = ModelConfig.from_pretrained(tiny_dir)
    lc = local_config(cfg, Shard(1, 4, expert_parallel=True))
    assert (lc.num_attention_heads, lc.num_key_value_heads, lc.linear_num_key_heads, lc.linear_num_value_heads,
            lc.num_experts, lc.moe_intermediate_size, lc.vocab_size) == (1, 1, 1, 1, 2, 64, cfg.vocab_size // 4)
    with pytest.raises(ConfigError, match="does not divide num_attention_heads"):
        local_config(cfg, Shard(0, 3))
