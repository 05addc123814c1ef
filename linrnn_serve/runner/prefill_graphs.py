"""Prefill steps in CUDA graphs, bucketed by token count (issue #14 build item 4).

An eager prefill forward of the 35B-A3B model launches ~1700 kernels: ~65 ms of host time for 11 ms
of GPU work at 128 tokens (H200), flat up to ~1k tokens; replayed from a graph, `bench batched` T_PP of
one 128-token prompt is 14 ms instead of 104 ms (benchmarks/results/prefill_graphs/). Prefill forwards of up to
PREFILL_GRAPH_MAX_TOKENS tokens (the default 8192-token budget: every step of it) therefore run in the smallest bucket of T_b >= T tokens (16, 32, 64, 128,
then four per octave: 160, 192, 224, 256, 320, ...) with a fixed number of sequence rows
S_b = min(max_num_seqs, T_b) + 1:

    rows 0 .. n-1     the real sequences, their tokens first (tokens 0 .. T-1); with --mixed-batch the
                      step's decode rows come first among them, one token each
    row n             the padding sequence: tokens T .. T_b-1 (token id 0, positions 0, 1, ...), recurrent
                      state in dummy slot 0, KV in dummy block 0 (every position maps into that block)
    rows n+1 .. S_b-1 empty sequences (no tokens, slot 0): every varlen kernel skips them

Padding is by sentinel, as for decode: padded rows touch only the dummy state slot 0 and the dummy KV
block 0, which no live sequence reads, and every real row's math reads only its own sequence's tokens,
state and KV (token-wise ops compute padded rows beside it, never mixing rows). The logits are taken
at L_b = S_b rows (`logits_indices`; unused rows repeat the last token) into a static buffer.

Every input a captured forward reads sits in static device buffers (token ids, positions, KV slot
mapping, logits rows; cu_seqlens, sequence lengths, state slots, block tables), written by one
pinned host -> device copy per dtype group per step; everything inside the forward is shape-static
and sync-free (the GDN chunk table, the attention tile map and the MoE alignment are built on the
device). One graph per bucket, in a memory pool of their own, captured largest first.

The eager path (enforce_eager, or a failed capture) runs the very same padded forward on the same
static buffers, so graphs on and off give bit-identical logits and states. Whether a step is padded
is a function of the plan alone (`PrefillGraphs.bucket_for`): more tokens than the largest bucket,
more logits rows than L_b, one token per row (the decode kernels) or prompt logprobs run the plain
unpadded eager forward in both modes.
On the CPU padding is off (no graphs to match); tests switch it on.
"""
from __future__ import annotations

import logging
import os

import numpy as np
import torch

from linrnn_serve.batch import DUMMY_KV_BLOCK, DUMMY_STATE_SLOT, ForwardBatch
from linrnn_serve.runner.cuda_graphs import GraphSet

log = logging.getLogger(__name__)

# Largest captured prefill (tokens): the default token budget (config.LARGE_GPU_TOKEN_BUDGET), so a full-budget
# step (a c = 64 wave of 64 x 128-token prompts, a chunk of a long prompt) replays a graph too. Eagerly such a step
# is GPU-bound but still leaves gaps between its launches: 140.7 ms eager wall vs 129.5 ms replayed at 64 x 128 on
# the H200 (benchmarks/results/prefill/round3/). The graphs share one pool, which keeps the largest bucket's
# scratch: the cache budget accounts it (cache/budget.py, prefill_graph_tokens). Above the old 4096-token cap the
# buckets are 5120, 6144, 7168, 8192. LINRNN_PREFILL_GRAPH_MAX_TOKENS overrides the cap (A/B runs).
PREFILL_GRAPH_MAX_TOKENS = 8192
MAX_TOKENS_ENV = "LINRNN_PREFILL_GRAPH_MAX_TOKENS"
MIN_BUCKET = 16
# Above 128 tokens a padded token costs about what a real one does (every layer computes it; in the MoE the
# padding tokens, all alike, pile onto the same few experts), so buckets are four per octave: at most 25 %
# padding where powers of two wasted up to 50 % (a 129-token restored turn ran as 256, 1161 tokens as 2048).
# LINRNN_PREFILL_BUCKETS=pow2 gives the powers of two back (A/B runs).
FINE_FROM = 128
PER_OCTAVE = 4


def prefill_graph_max_tokens() -> int:
    """The largest captured prefill: PREFILL_GRAPH_MAX_TOKENS unless LINRNN_PREFILL_GRAPH_MAX_TOKENS says otherwise."""
    flag = os.environ.get(MAX_TOKENS_ENV)
    if flag is None:
        return PREFILL_GRAPH_MAX_TOKENS
    try:
        n = int(flag)
    except ValueError:
        n = 0
    if n < MIN_BUCKET:
        raise ValueError(f"{MAX_TOKENS_ENV} must be an integer >= {MIN_BUCKET}, got {flag!r}")
    return n


def prefill_buckets(max_num_batched_tokens: int, max_tokens: int | None = None,
                    per_octave: int | None = None) -> list[int]:
    """Token buckets 16, 32, 64, 128, then `per_octave` per doubling (128 + 32, 128 + 64, ...), up to the first
    bucket >= min(max_num_batched_tokens, max_tokens) (default: prefill_graph_max_tokens())."""
    if max_num_batched_tokens < 1:
        raise ValueError(f"max_num_batched_tokens must be >= 1, got {max_num_batched_tokens}")
    if per_octave is None:
        per_octave = 1 if os.environ.get("LINRNN_PREFILL_BUCKETS") == "pow2" else PER_OCTAVE
    cap = min(max_num_batched_tokens, prefill_graph_max_tokens() if max_tokens is None else max_tokens)
    out, b = [MIN_BUCKET], MIN_BUCKET
    while b < cap:
        b += b if b < FINE_FROM else (1 << (b.bit_length() - 1)) // per_octave
        out.append(b)
    return out


class PrefillGraphs:
    """Static prefill inputs, bucket choice, capture and replay (or the same forward eagerly)."""

    def __init__(self, model, caches, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, device: torch.device, max_tokens: int | None = None):
        self.model, self.caches = model, caches
        self.device, self.block_size, self.max_model_len = device, block_size, max_model_len
        self.buckets = prefill_buckets(max_num_batched_tokens, max_tokens)
        self.max_num_seqs = max_num_seqs
        T, S = self.buckets[-1], self.rows(self.buckets[-1])
        # wide enough for every real table and for the padding sequence's positions (block 0 throughout)
        self.max_blocks = max(-(-max_model_len // block_size), -(-T // block_size))
        pin = device.type == "cuda"
        # int64 group: ids [T] | positions [T] | slot_mapping [T] | logits_indices [S]
        self._i64_host = torch.zeros(3 * T + S, dtype=torch.int64, pin_memory=pin)
        self._i64 = torch.zeros(3 * T + S, dtype=torch.int64, device=device)
        # int32 group: cu_seqlens [S + 1] | seq_lens [S] | state_indices [S] | block_tables [S, max_blocks]
        self._i32_host = torch.zeros(3 * S + 1 + S * self.max_blocks, dtype=torch.int32, pin_memory=pin)
        self._i32 = torch.zeros(3 * S + 1 + S * self.max_blocks, dtype=torch.int32, device=device)
        self.T_max, self.S_max = T, S
        self.logits = torch.zeros(S, model.cfg.vocab_size, dtype=model.dtype, device=device)
        self.graphs = GraphSet()
        self.use_graphs = False
        self._batches: dict[int, ForwardBatch] = {}
        self._uploaded = None  # event after the last upload: the pinned staging is reused only once it passed

    def rows(self, bucket: int) -> int:
        """Sequence rows (and logits rows) of a bucket: every real sequence of a step, plus the padding one."""
        s = min(self.max_num_seqs, bucket) + 1
        return s + 1 if s == bucket else s  # tokens == rows would select the one-token decode kernels

    def bucket_for(self, num_tokens: int, num_seqs: int, num_logits_rows: int) -> int | None:
        """The bucket a prefill of these sizes runs in, or None (plain eager forward). One token per row
        (e.g. the last prompt token after a prefix-cache restore) stays unpadded: that forward takes the
        decode kernels, whose results equal a decode step's bit for bit (lossless prefix restore)."""
        if num_tokens == num_seqs:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                rows = self.rows(b)
                return b if num_seqs < rows and num_logits_rows <= rows else None
        return None

    # ---- static buffers ---------------------------------------------------------------------------
    def _views(self, buf: torch.Tensor, bucket: int):
        T, S, mb = self.T_max, self.S_max, self.max_blocks
        if buf.dtype == torch.int64:
            t, s = bucket, self.rows(bucket)
            return buf[:t], buf[T:T + t], buf[2 * T:2 * T + t], buf[3 * T:3 * T + s]
        s = self.rows(bucket)
        return (buf[:s + 1], buf[S + 1:S + 1 + s], buf[2 * S + 1:2 * S + 1 + s],
                buf[3 * S + 1:3 * S + 1 + s * mb].view(s, mb))

    def batch(self, bucket: int) -> ForwardBatch:
        """The ForwardBatch of a bucket: views of the static device buffers."""
        if bucket not in self._batches:
            ids, pos, slots, sel = self._views(self._i64, bucket)
            cu, lens, state, tables = self._views(self._i32, bucket)
            self._batches[bucket] = ForwardBatch(
                input_ids=ids, positions=pos, cu_seqlens=cu, seq_lens=lens, state_indices=state, block_tables=tables,
                slot_mapping=slots, is_decode=False, max_query_len=bucket, max_seq_len=self.max_model_len,
                logits_indices=sel)
        return self._batches[bucket]

    def stage(self, bucket: int, work: list[tuple[list[int], int, int, list[int]]], sel: list[int]) -> None:
        """Write one step's inputs (work: (token_ids, start_pos, state_slot, block_table) per sequence, the
        table a list or an int array; sel: the token rows whose logits are wanted) padded to `bucket`, then
        upload them. numpy on the pinned buffers: a mixed step stages ~64 one-token rows besides its prompts."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        bs = self.block_size
        ids, pos, slots, lsel = (v.numpy() for v in self._views(self._i64_host, bucket))
        cu, lens, state, tables = (v.numpy() for v in self._views(self._i32_host, bucket))
        t = 0
        for i, (toks, start, slot, table) in enumerate(work):
            n = len(toks)
            if (start + n + bs - 1) // bs > len(table):
                raise ValueError(f"block table of {len(table)} blocks cannot hold {start + n} tokens")
            if len(table) > self.max_blocks:
                raise ValueError(f"block table of {len(table)} blocks exceeds max_model_len {self.max_model_len}")
            p = np.arange(start, start + n)
            ids[t:t + n] = toks
            pos[t:t + n] = p
            slots[t:t + n] = np.asarray(table, dtype=np.int64)[p // bs] * bs + p % bs
            cu[i] = t
            t += n
            lens[i] = start + n
            state[i] = slot
            tables[i, :len(table)] = table
            tables[i, len(table):] = DUMMY_KV_BLOCK
        self._pad(bucket, len(work), t)
        lsel[:len(sel)] = sel
        lsel[len(sel):] = t - 1 if t else 0
        self._upload()

    def _pad(self, bucket: int, n: int, t: int) -> None:
        """Rows n.. of the host staging: the padding sequence (tokens t..bucket-1), then empty ones."""
        ids, pos, slots, _ = self._views(self._i64_host, bucket)
        cu, lens, state, tables = self._views(self._i32_host, bucket)
        pad = bucket - t
        ids[t:] = 0
        p = torch.arange(pad)
        pos[t:] = p
        slots[t:] = DUMMY_KV_BLOCK * self.block_size + p % self.block_size
        cu[n] = t
        cu[n + 1:] = bucket
        lens[n] = pad
        lens[n + 1:] = 0
        state[n:] = DUMMY_STATE_SLOT
        tables[n:] = DUMMY_KV_BLOCK

    def _upload(self) -> None:
        nb = self.device.type == "cuda"
        self._i64.copy_(self._i64_host, non_blocking=nb)
        self._i32.copy_(self._i32_host, non_blocking=nb)
        if nb:
            self._uploaded = torch.cuda.Event()
            self._uploaded.record()

    def stage_padding(self, bucket: int) -> None:
        """Inputs of an all-padding step (capture and warm-up)."""
        if self._uploaded is not None:
            self._uploaded.synchronize()
        self._pad(bucket, 0, 0)
        self._views(self._i64_host, bucket)[3].zero_()
        self._upload()

    # ---- the forward ----------------------------------------------------------------------------------
    def forward(self, bucket: int) -> None:
        """The captured region: the model on the bucket's static batch, logits into the static buffer."""
        logits = self.model(self.batch(bucket), self.caches)
        self.logits[:logits.shape[0]].copy_(logits)

    def run(self, bucket: int) -> torch.Tensor:
        """Replay (or run eagerly) the staged step; returns the bucket's logits rows (a static view)."""
        if self.use_graphs and (bucket, "prefill") in self.graphs:
            self.graphs.replay(bucket, "prefill")
        else:
            self.forward(bucket)
        return self.logits[:self.rows(bucket)]

    def capture(self, progress: bool = True) -> None:
        """One graph per bucket (largest first, one memory pool); leaves use_graphs False on failure."""
        try:
            with torch.inference_mode():
                self.graphs.capture(self.buckets, {"prefill": self.forward}, self.device, progress=progress,
                                    prepare=self.stage_padding, desc="capturing prefill CUDA graphs")
            self.use_graphs = True
        except Exception as e:  # a host sync or an uncapturable op on the prefill path
            log.warning("prefill CUDA graph capture failed (%s: %s); short prefills run eagerly (padded)",
                        type(e).__name__, e)
            self.graphs = GraphSet()
            self.use_graphs = False
            torch.cuda.synchronize(self.device)
