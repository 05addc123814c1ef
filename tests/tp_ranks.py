"""Rank bodies of the tensor-parallel model tests (spawned processes import this module by name)."""
from __future__ import annotations

import math

import torch

PROMPTS = [[5, 17, 300, 42, 9, 4000, 77], [1000, 2, 3]]
DECODE_STEPS = 4


def run_model(model, tau: float) -> tuple[torch.Tensor, list[list[int]]]:
    """Prefill PROMPTS, then greedy-decode DECODE_STEPS tokens as one batch: (all logits rows
    stacked [steps+1, B, V], greedy tokens per sequence)."""
    from linrnn_serve.classifier import build_head_map
    from linrnn_serve.runner.session import Session

    heads = None if math.isinf(tau) else build_head_map(model, tau)[0]
    s = Session(model, len(PROMPTS), 64, block_size=4, bf16_heads=heads)
    sids = [s.new_seq() for _ in PROMPTS]
    logits = [s.forward(sids, PROMPTS)]
    toks = [[] for _ in PROMPTS]
    for _ in range(DECODE_STEPS):
        nxt = logits[-1].argmax(-1).tolist()
        for i, t in enumerate(nxt):
            toks[i].append(t)
        logits.append(s.forward(sids, [[t] for t in nxt]))
    return torch.stack(logits), toks


def load(ckpt: str, shard=None, load_format: str = "auto"):
    from linrnn_serve.config import ModelConfig
    from linrnn_serve.models.loading import load_model

    cfg = ModelConfig.from_pretrained(ckpt)
    return load_model(cfg, ckpt, torch.float32, "cpu", load_format, progress=False, shard=shard)


def rank_main(rank: int, world: int, port: int, ckpt: str, ep: bool, tau: float, out: str,
              load_format: str = "auto") -> None:
    from linrnn_serve.parallel import Shard, init_process_group

    torch.set_num_threads(1)
    comm = init_process_group(rank, world, f"tcp://127.0.0.1:{port}", "gloo", timeout_s=120)
    model = load(ckpt, Shard(rank, world, ep, comm), load_format)
    with torch.inference_mode():
        logits, toks = run_model(model, tau)
    n_state = sum(p.numel() for p in model.parameters())
    torch.save({"logits": logits, "tokens": toks, "params": n_state,
                "gdn_heads": model.local_cfg.linear_num_value_heads}, f"{out}/rank{rank}.pt")
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
