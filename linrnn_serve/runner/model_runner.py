"""ModelRunner: executes a scheduler StepPlan on the model and caches; returns sampled tokens.

Per step (runner/plan.py):
  1. block-table edits, prefix-cache snapshot saves of finished sequences, fresh-slot resets or
     snapshot restores, and copy-on-write KV block copies;
  2. decode: every one-token sequence in one forward at the bucket size (cuda_graphs.py), with its
     inputs written into static buffers; the block table of each row is gathered on the device from
     a per-slot table (`slot_tables`), so per step only token ids, positions, slots and sampling
     parameters cross the bus;
  3. prefill: the chunks in one varlen forward; logits only for the rows that sample and for
     prompt-logprob positions (batch.logits_indices). Up to prefill_graphs.PREFILL_GRAPH_MAX_TOKENS
     tokens it runs padded to a token bucket, replayed from a CUDA graph (prefill_graphs.py); longer
     ones (and prompt-logprob steps) run eagerly;
  4. prefix-cache snapshots of states this forward produced (prompt ends, divergence points) are
     saved with their last token's logits; sequences whose whole prompt was such a snapshot sample
     from the stored logits; n > 1 forks copy the prompt's recurrent state to the samples' slots;
  5. one host transfer of the sampled ids (the only sync of a step).
"""
from __future__ import annotations

import logging
import os

import torch

from linrnn_serve.batch import ForwardBatch
from linrnn_serve.cache import ModelCaches
from linrnn_serve.runner import sampler as S
from linrnn_serve.runner.cuda_graphs import GraphSet, bucket_for, decode_buckets
from linrnn_serve.runner.inputs import SeqWork, build_forward_batch
from linrnn_serve.runner.plan import (
    CachedSampleRow, DecodeRow, PrefillRow, SampledToken, SamplingRow, StepPlan, StepResult,
)
from linrnn_serve.runner.prefill_graphs import PrefillGraphs

log = logging.getLogger(__name__)

PROMPT_LOGPROB_SLICE = 256  # rows of f32 log-softmax computed at once for prompt logprobs


class ModelRunner:
    def __init__(self, model, caches: ModelCaches, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 enforce_eager: bool = False, progress: bool = True, max_num_batched_tokens: int = 2048,
                 pad_prefill: bool | None = None):
        """pad_prefill: short prefills padded to token buckets (captured unless enforce_eager); None:
        on CUDA for an unsharded model (prefill_graphs.py)."""
        self.model, self.caches = model, caches
        self.device = next(model.parameters()).device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.vocab_size = model.cfg.vocab_size
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        num_slots = caches.state.num_slots
        dev = self.device
        pin = dev.type == "cuda"
        i32, i64 = torch.int32, torch.int64
        # per-slot block tables: row 0 (the dummy slot) stays all-zero = dummy block 0
        self.slot_tables_cpu = torch.zeros(num_slots, self.max_blocks, dtype=i32)
        self.slot_tables = torch.zeros(num_slots, self.max_blocks, dtype=i32, device=dev)
        # static decode inputs; host staging in pinned memory, one copy per dtype group
        B = self.max_batch
        self._ints_host = torch.zeros(4, B, dtype=i64, pin_memory=pin)  # ids, positions, slots, top_k
        self._floats_host = torch.zeros(3, B, dtype=torch.float32, pin_memory=pin)  # temperature, top_p, min_p
        self._u_host = torch.full((B,), 0.5, dtype=torch.float64, pin_memory=pin)
        self._ints = torch.zeros(4, B, dtype=i64, device=dev)
        self._floats = torch.zeros(3, B, dtype=torch.float32, device=dev)
        self._u = torch.full((B,), 0.5, dtype=torch.float64, device=dev)
        self._cu = torch.arange(B + 1, dtype=i32, device=dev)
        self.logits_buf = torch.zeros(B, self.vocab_size, dtype=model.dtype, device=dev)
        self.greedy_buf = torch.zeros(B, dtype=i64, device=dev)
        # structured output: token bitmask rows (int32 words, all ones = unconstrained), host -> static device
        words = (self.vocab_size + 31) // 32
        self._mask_host = torch.full((B, words), -1, dtype=torch.int32, pin_memory=pin)
        self._mask = torch.full((B, words), -1, dtype=torch.int32, device=dev)
        self.sample_buf = torch.zeros(B, dtype=i64, device=dev)
        self.graphs = GraphSet()
        self.use_graphs = False
        self.enforce_eager = enforce_eager
        self.progress = progress
        self._last: list[tuple[list[int], torch.Tensor]] = []
        if pad_prefill is None:
            pad_prefill = prefill_padding_default(model, dev)
        self.prefill_graphs = PrefillGraphs(
            model, caches, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, device=dev) if pad_prefill else None

    # ---- CUDA graphs -----------------------------------------------------------------------
    def capture_graphs(self, strict: bool = False, note=None) -> None:
        """Capture the decode step per bucket (no-op on CPU or with enforce_eager). A failed capture
        falls back to eager decode, or raises with `strict` (tensor parallel: every rank must capture
        the same graphs). `note(what)` marks progress per bucket and kind (rank_watch.py)."""
        if self.enforce_eager or self.device.type != "cuda":
            log.info("CUDA graphs off (%s): decode runs eagerly at the same bucket sizes",
                     "enforce_eager" if self.enforce_eager else f"device {self.device.type}")
            return
        self._reset_static(self.max_batch)
        self._floats[0].fill_(1.0)
        self._floats[1].fill_(1.0)
        kinds = {"step": self._decode_forward, "mask": self._mask_static,
                 "sample": lambda b: self._sample_static(b, False),
                 "sample_sorted": lambda b: self._sample_static(b, True)}
        try:
            with torch.inference_mode():
                self.graphs.capture(self.buckets, kinds, self.device, progress=self.progress, note=note)
            self.use_graphs = True
        except Exception as e:  # e.g. a reference op with a host sync on the decode path
            if strict:
                raise
            log.warning("CUDA graph capture failed (%s: %s); decode runs eagerly", type(e).__name__, e)
            self.graphs = GraphSet()
            self.use_graphs = False
            torch.cuda.synchronize(self.device)
        self._reset_static(self.max_batch)
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(progress=self.progress)
        torch.cuda.synchronize(self.device)

    # ---- the captured region ---------------------------------------------------------------
    def _decode_batch(self, b: int) -> ForwardBatch:
        bs = self.block_size
        ids, pos, slots = self._ints[0, :b], self._ints[1, :b], self._ints[2, :b]
        state_idx = slots.to(torch.int32)
        tables = self.slot_tables.index_select(0, slots)
        blk = tables.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None]).squeeze(1).long()
        return ForwardBatch(
            input_ids=ids, positions=pos, cu_seqlens=self._cu[: b + 1], seq_lens=(pos + 1).to(torch.int32),
            state_indices=state_idx, block_tables=tables, slot_mapping=blk * bs + pos % bs, is_decode=True,
            max_query_len=1, max_seq_len=self.max_model_len)

    def _decode_forward(self, b: int) -> None:
        logits = self.model(self._decode_batch(b), self.caches)
        self.logits_buf[:b].copy_(logits)
        self.greedy_buf[:b].copy_(S.greedy(logits))

    def _mask_static(self, b: int) -> None:
        """Apply the step's token bitmask to the logits in place and redo the greedy pick (captured)."""
        S.apply_bitmask(self.logits_buf[:b], self._mask[:b])
        self.greedy_buf[:b].copy_(S.greedy(self.logits_buf[:b]))

    def _static_sampling(self, b: int) -> S.SamplingTensors:
        return S.SamplingTensors(self._floats[0, :b], self._ints[3, :b], self._floats[1, :b], self._floats[2, :b],
                                 self._u[:b])

    def _sample_static(self, b: int, use_sort: bool) -> None:
        self.sample_buf[:b].copy_(S.sample(self.logits_buf[:b], self._static_sampling(b), use_sort))

    def _reset_static(self, b: int) -> None:
        """Padding values: token 0 at position 0 in dummy slot 0, greedy."""
        self._ints_host[:, :b].zero_()
        self._floats_host[0, :b].zero_()
        self._floats_host[1, :b].fill_(1.0)
        self._floats_host[2, :b].zero_()
        self._u_host[:b].fill_(0.5)
        self._upload(b)

    def _upload(self, b: int) -> None:
        """Host staging -> static device inputs: whole buffers (contiguous pinned -> one DMA each; a
        few KB). Rows past the bucket are never read by its graph."""
        nb = self.device.type == "cuda"
        self._ints.copy_(self._ints_host, non_blocking=nb)
        self._floats.copy_(self._floats_host, non_blocking=nb)
        self._u.copy_(self._u_host, non_blocking=nb)

    # ---- one step ----------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        self._prepare(plan)
        self._last = []
        result = StepResult()
        dec = self._run_decode(plan.decode, plan.fill_bitmask) if plan.decode else None
        pre = self._run_prefill(plan.prefill, result, plan.fill_bitmask) if plan.prefill else None
        hit = self._run_cached(plan.cached, plan.fill_bitmask) if plan.cached else None
        for src, dst in plan.slot_copies:
            self.caches.state.copy_slot(src, dst)
        for part in (dec, pre, hit):
            if part is not None:
                rows, ids, logits = part
                self._collect(rows, ids, logits, result)
        return result

    def _prepare(self, plan: StepPlan) -> None:
        if plan.block_table_updates:
            touched = []
            for slot, start, blocks in plan.block_table_updates:
                self.slot_tables_cpu[slot, start:start + len(blocks)] = torch.tensor(blocks, dtype=torch.int32)
                touched.append(slot)
            idx = torch.tensor(sorted(set(touched)), dtype=torch.long)
            self.slot_tables.index_copy_(0, idx.to(self.device), self.slot_tables_cpu[idx].to(self.device))
        self._save_snapshots(plan.snapshot_saves_before)
        if plan.reset_slots:
            self.caches.state.reset_slots(plan.reset_slots)
        if plan.snapshot_restores:
            self.caches.snapshots.copy_to(self.caches.state, [s for s, _ in plan.snapshot_restores],
                                          [d for _, d in plan.snapshot_restores])
        if plan.block_copies:
            src = torch.tensor([s for s, _ in plan.block_copies], dtype=torch.long, device=self.device)
            dst = torch.tensor([d for _, d in plan.block_copies], dtype=torch.long, device=self.device)
            kv = self.caches.kv.kv  # [layers, 2, blocks, block_size, heads, dim]
            kv[:, :, dst] = kv[:, :, src]

    def _save_snapshots(self, saves: list[tuple[int, int]]) -> None:
        if saves:
            self.caches.state.copy_to(self.caches.snapshots, [s for s, _ in saves], [d for _, d in saves])

    def _run_decode(self, rows: list[DecodeRow], fill_bitmask=None):
        n = len(rows)
        b = bucket_for(self.buckets, n)
        ints, floats, u = self._ints_host, self._floats_host, self._u_host
        ints[0, :n] = torch.tensor([r.token_id for r in rows], dtype=torch.int64)
        ints[1, :n] = torch.tensor([r.position for r in rows], dtype=torch.int64)
        ints[2, :n] = torch.tensor([r.slot for r in rows], dtype=torch.int64)
        ints[:3, n:b] = 0
        samp = [r.sampling for r in rows]
        any_random = not all(s.is_greedy for s in samp)
        if any_random:
            ints[3, :n] = torch.tensor([s.top_k for s in samp], dtype=torch.int64)
            floats[0, :n] = torch.tensor([s.temperature for s in samp], dtype=torch.float32)
            floats[1, :n] = torch.tensor([s.top_p for s in samp], dtype=torch.float32)
            floats[2, :n] = torch.tensor([s.min_p for s in samp], dtype=torch.float32)
            u[:n] = torch.tensor([s.u for s in samp], dtype=torch.float64)
        else:
            ints[3, :n] = 0
            floats[0, :n] = 0.0
            floats[1, :n] = 1.0
            floats[2, :n] = 0.0
        ints[3, n:b] = 0
        floats[0, n:b] = 0.0
        floats[1, n:b] = 1.0
        floats[2, n:b] = 0.0
        self._upload(b)
        graphs = self.use_graphs and (b, "step") in self.graphs
        if graphs:
            self.graphs.replay(b, "step")
        else:
            self._decode_forward(b)
        if fill_bitmask is not None:
            # the forward is queued on the GPU: fill the grammar bitmask on the host meanwhile, then hand it
            # over without a sync (pinned -> static buffer) and mask inside the graph
            host = self._mask_host[:b]
            host.fill_(-1)
            fill_bitmask(host[:n], [s.seq_id for s in samp])
            self._mask[:b].copy_(host, non_blocking=self.device.type == "cuda")
            if graphs:
                self.graphs.replay(b, "mask")
            else:
                self._mask_static(b)
        if S.needs_logit_edits(samp):
            logits = S.apply_logit_edits(self.logits_buf[:b], samp + [None] * (b - n))
            ids = S.sample(logits, self._static_sampling(b), any(s.needs_sort for s in samp)) if any_random \
                else S.greedy(logits)
        elif any_random:
            kind = "sample_sorted" if any(s.needs_sort for s in samp) else "sample"
            if graphs:
                self.graphs.replay(b, kind)
            else:
                self._sample_static(b, kind == "sample_sorted")
            ids = self.sample_buf[:b]
        else:
            ids = self.greedy_buf[:b]
        return samp, ids[:n], self.logits_buf[:n]

    def _run_prefill(self, rows: list[PrefillRow], result: StepResult, fill_bitmask=None):
        """One varlen forward (padded to a token bucket and replayed from a CUDA graph when short, else
        eager); logits only for sampled rows (a fork samples n times from its prompt's last row) and
        prompt-logprob positions."""
        starts, cu = [], 0
        for r in rows:
            starts.append(cu)
            cu += len(r.token_ids)
        samp = [s for r in rows for s in r.samples]
        sel = [starts[i] + len(r.token_ids) - 1 for i, r in enumerate(rows) for _ in r.samples]
        plp_rows = []  # (row, [positions in chunk])
        for i, r in enumerate(rows):
            if r.prompt_logprobs is not None:
                pos = [j for j, t in enumerate(r.next_token_ids) if t is not None]
                plp_rows.append((r, pos))
                sel += [starts[i] + j for j in pos]
        # snapshot rows' last-token logits: a sampled row's own (no extra logits row: the lm_head's
        # result must not depend on it), else one more row
        snaps, snap_rows, k = [], [], 0
        for i, r in enumerate(rows):
            if r.snapshot is not None:
                snaps.append((r.slot, r.snapshot))
                if r.samples:
                    snap_rows.append(k)
                else:
                    snap_rows.append(len(sel))
                    sel.append(starts[i] + len(r.token_ids) - 1)
            k += len(r.samples)
        if not sel:  # a middle chunk: state and KV only
            sel = [cu - 1]
        pg = self.prefill_graphs
        bucket = pg.bucket_for(cu, len(rows), len(sel)) if pg is not None and not plp_rows else None
        if bucket is not None:
            pg.stage(bucket, [(r.token_ids, r.start_pos, r.slot, r.block_table) for r in rows], sel)
            logits = pg.run(bucket)[:len(sel)]
        else:
            work = [SeqWork(r.token_ids, r.start_pos, r.slot, r.block_table) for r in rows]
            batch = build_forward_batch(work, self.block_size, self.device)
            batch.logits_indices = torch.tensor(sel, dtype=torch.long, device=self.device)
            logits = self.model(batch, self.caches)
        k = len(samp)
        for r, pos in plp_rows:
            result.prompt_logprobs[r.seq_id] = self._prompt_logprobs(logits[k:k + len(pos)], r, pos)
            k += len(pos)
        if snaps:  # the state after each chunk and its last token's logits
            self._save_snapshots(snaps)
            idx = torch.tensor([s for _, s in snaps], dtype=torch.long, device=self.device)
            rows_idx = torch.tensor(snap_rows, dtype=torch.long, device=self.device)
            self.caches.snapshot_logits.index_copy_(0, idx, logits.index_select(0, rows_idx).to(
                self.caches.snapshot_logits.dtype))
        if not samp:
            return None
        return self._sample(samp, logits[: len(samp)], fill_bitmask)

    def _run_cached(self, rows: list[CachedSampleRow], fill_bitmask=None):
        """First tokens of fully cached prompts, from their snapshots' stored logits (no forward)."""
        samp = [s for r in rows for s in r.samples]
        idx = torch.tensor([r.snapshot for r in rows for _ in r.samples], dtype=torch.long, device=self.device)
        return self._sample(samp, self.caches.snapshot_logits.index_select(0, idx), fill_bitmask)

    def _sample(self, samp: list[SamplingRow], logits: torch.Tensor, fill_bitmask=None):
        if fill_bitmask is not None:
            host = torch.full((len(samp), self._mask.shape[1]), -1, dtype=torch.int32)
            fill_bitmask(host, [s.seq_id for s in samp])
            S.apply_bitmask(logits, host.to(self.device))
        t = S.SamplingTensors.from_rows(samp, self.device)
        any_random = not all(s.is_greedy for s in samp)
        x = S.apply_logit_edits(logits, samp) if S.needs_logit_edits(samp) else logits
        ids = S.sample(x, t, any(s.needs_sort for s in samp)) if any_random else S.greedy(x)
        return samp, ids, logits

    def _prompt_logprobs(self, logits: torch.Tensor, row: PrefillRow, pos: list[int]) -> list[dict[int, float]]:
        out: list[dict[int, float]] = []
        for k in range(0, len(pos), PROMPT_LOGPROB_SLICE):
            part = pos[k:k + PROMPT_LOGPROB_SLICE]
            nxt = torch.tensor([row.next_token_ids[j] for j in part], device=self.device)
            out += S.logprobs_of(logits[k:k + len(part)], nxt, [row.prompt_logprobs] * len(part))
        return out

    def _collect(self, rows: list[SamplingRow], ids: torch.Tensor, logits: torch.Tensor, result: StepResult) -> None:
        self._last.append(([r.seq_id for r in rows], logits))
        want = [i for i, r in enumerate(rows) if r.logprobs is not None]
        lps = {}
        if want:
            sel = torch.tensor(want, device=self.device)
            dicts = S.logprobs_of(logits.index_select(0, sel), ids.index_select(0, sel),
                                  [rows[i].logprobs for i in want])
            lps = dict(zip(want, dicts))
        for i, (r, t) in enumerate(zip(rows, ids.tolist())):
            result.sampled[r.seq_id] = SampledToken(t, lps.get(i))

    def last_logits(self) -> dict[int, torch.Tensor]:
        """Logits rows of the last step per sampled sequence id (views: copy before the next step)."""
        out = {}
        for seq_ids, logits in self._last:
            for i, sid in enumerate(seq_ids):
                out[sid] = logits[i]
        return out


def prefill_padding_default(model, device: torch.device) -> bool:
    """Short prefills are padded to buckets (and captured) on CUDA for an unsharded model. LINRNN_PREFILL_GRAPHS=0
    turns that off (A/B runs), =1 on for any device (CPU tests of the padded layout). Tensor-parallel prefill
    stays eager (collectives in prefill graphs are untested)."""
    shard = getattr(model, "shard", None)
    if shard is not None and shard.parallel:
        return False
    flag = os.environ.get("LINRNN_PREFILL_GRAPHS")
    return flag != "0" if flag is not None else device.type == "cuda"
