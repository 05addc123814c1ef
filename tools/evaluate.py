"""Validation loss / perplexity of a checkpoint on held-out tokens, by transformers and by our engine.

Chunking follows the KL gate (BENCH.md "KL gate", after llama.cpp's llama-perplexity): the tokens
are cut into chunks of n_ctx, each chunk runs from an empty state, and the logits at position j
predict token j+1. Two scores per run: `all` (every position 0..n_ctx-2) and `second_half`
(positions n_ctx/2..n_ctx-2, what llama-perplexity and the KL gate score).
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch
import torch.nn.functional as F


def make_chunks(tokens: np.ndarray, n_ctx: int, max_tokens: int | None = None) -> torch.Tensor:
    """[n_chunks, n_ctx] int64 (the tail that does not fill a chunk is dropped)."""
    n = tokens.size if max_tokens is None else min(tokens.size, max_tokens)
    n_chunks = n // n_ctx
    if n_chunks == 0:
        raise ValueError(f"{tokens.size} validation tokens do not fill one chunk of n_ctx={n_ctx}")
    return torch.from_numpy(tokens[: n_chunks * n_ctx].astype(np.int64)).view(n_chunks, n_ctx)


class NLL:
    """Sums of next-token negative log-likelihoods (nats), all positions and second half."""

    def __init__(self, n_ctx: int):
        self.n_ctx, self.sum_all, self.n_all, self.sum_half, self.n_half = n_ctx, 0.0, 0, 0.0, 0

    def add(self, logits: torch.Tensor, chunk: torch.Tensor) -> None:
        """logits [n_ctx, V] of one chunk (any dtype), chunk [n_ctx] token ids."""
        nll = F.cross_entropy(logits[:-1].float(), chunk[1:].to(logits.device), reduction="none")
        if not torch.isfinite(nll).all():
            raise FloatingPointError("non-finite loss: the model produced NaN/inf logits")
        half = self.n_ctx // 2
        self.sum_all += nll.sum().item()
        self.n_all += nll.numel()
        self.sum_half += nll[half:].sum().item()
        self.n_half += nll[half:].numel()

    def result(self, seconds: float | None = None) -> dict:
        la, lh = self.sum_all / max(self.n_all, 1), self.sum_half / max(self.n_half, 1)
        out = {"loss": la, "ppl": math.exp(la), "loss_second_half": lh, "ppl_second_half": math.exp(lh),
               "scored_tokens": self.n_all, "n_ctx": self.n_ctx}
        if seconds is not None:
            out["seconds"] = round(seconds, 2)
        return out


def unigram(train: np.ndarray, chunks: torch.Tensor, vocab_size: int) -> dict:
    """Baseline: add-one smoothed unigram distribution of the training tokens, scored like NLL."""
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    tgt = chunks[:, 1:].numpy()
    half = chunks.shape[1] // 2
    la = -logp[tgt].mean()
    lh = -logp[tgt[:, half - 1:]].mean()  # targets of positions half..n_ctx-2
    return {"loss": float(la), "ppl": math.exp(la), "loss_second_half": float(lh), "ppl_second_half": math.exp(lh),
            "scored_tokens": int(tgt.size), "n_ctx": int(chunks.shape[1])}


@torch.no_grad()
def eval_hf(model, chunks: torch.Tensor, batch: int = 16, autocast_dtype: torch.dtype | None = None) -> dict:
    """A transformers causal LM (already on its device), each chunk from an empty state."""
    t0 = time.time()
    device = next(model.parameters()).device
    acc = NLL(chunks.shape[1])
    was_training = model.training
    model.eval()
    for i in range(0, chunks.shape[0], batch):
        x = chunks[i:i + batch].to(device)
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            logits = model(input_ids=x, use_cache=False).logits
        for j in range(x.shape[0]):
            acc.add(logits[j], x[j])
    model.train(was_training)
    return acc.result(time.time() - t0)


def load_hf(model_dir: str, dtype: torch.dtype, device) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()


def load_engine(model_dir: str, dtype: torch.dtype, device):
    from linrnn_serve.config import ModelConfig
    from linrnn_serve.models.loading import load_model

    return load_model(ModelConfig.from_pretrained(model_dir), model_dir, dtype, device, progress=False)


@torch.no_grad()
def eval_engine(model, chunks: torch.Tensor, batch: int = 16) -> dict:
    """Our engine through runner.session.Session: `batch` chunks per forward, each a fresh sequence
    (empty recurrent state and KV), all-position logits."""
    from linrnn_serve.runner.session import Session

    t0 = time.time()
    n_ctx = chunks.shape[1]
    acc = NLL(n_ctx)
    batch = min(batch, chunks.shape[0])
    sess = Session(model, max_seqs=batch, max_len=n_ctx)
    for i in range(0, chunks.shape[0], batch):
        part = chunks[i:i + batch]
        sids = [sess.new_seq() for _ in range(part.shape[0])]
        logits = sess.forward(sids, [c.tolist() for c in part], all_logits=True)  # [B * n_ctx, V]
        for j in range(part.shape[0]):
            acc.add(logits[j * n_ctx:(j + 1) * n_ctx], part[j])
        for sid in sids:
            sess.free(sid)
    return acc.result(time.time() - t0)


@torch.no_grad()
def engine_greedy(model, prompt_ids: list[int], max_new_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """Greedy continuation by the engine (prefill, then one token at a time from carried state)."""
    from linrnn_serve.runner.session import Session

    sess = Session(model, max_seqs=1, max_len=len(prompt_ids) + max_new_tokens + 1)
    sid = sess.new_seq()
    logits = sess.forward([sid], [list(prompt_ids)])
    out = []
    for _ in range(max_new_tokens):
        nxt = int(logits[0].float().argmax())
        out.append(nxt)
        if nxt in stop_ids:
            break
        logits = sess.forward([sid], [[nxt]])
    return out


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / abs(b)
