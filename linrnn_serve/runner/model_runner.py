"""ModelRunner: executes a scheduler StepPlan on the model and caches; returns sampled tokens.

Per step (runner/plan.py):
  1. block-table edits, prefix-cache snapshot saves of finished sequences, fresh-slot resets or
     snapshot restores, and copy-on-write KV block copies;
  2. decode: every one-token sequence in one forward at the bucket size (cuda_graphs.py), with its
     inputs written into static buffers;
  3. prefill: the chunks in one varlen forward; logits only for the rows that sample and for
     prompt-logprob positions (batch.logits_indices). Up to prefill_graphs.PREFILL_GRAPH_MAX_TOKENS
     tokens (8192, the default budget) it runs padded to a token bucket, replayed from a CUDA graph (prefill_graphs.py); longer
     ones (and prompt-logprob steps) run eagerly. With `mixed_batch` a step that has prefill rows skips
     step 2: its decode rows ride in this forward as one-token chunks in front of the prompts (their
     tables from the per-slot mirror, ids the host has not seen gathered from `slot_ids` on the device)
     and are sampled with the prompts' first tokens (plan.py says what that does to the numerics);
  4. prefix-cache snapshots of states this forward produced (prompt ends, divergence points) are
     saved with their last token's logits; sequences whose whole prompt was such a snapshot sample
     from the stored logits; n > 1 forks copy the prompt's recurrent state to the samples' slots;
  5. the step's sampled ids go to pinned host memory with a non-blocking copy and a CUDA event:
     `execute_async` returns a PendingStep at once, `PendingStep.result()` waits for the event.

The persistent device batch (what lives on the device from step to step, indexed by state slot):
  * `slot_tables`  each slot's KV block table (a decode row's table is gathered in the graph);
  * `slot_f`, `slot_i`  each slot's sampling parameters (temperature, top_p, min_p / top_k, seed,
     prompt length), uploaded when a sequence first decodes in a slot: the seeded uniform of a row is
     computed in the graph from its seed and position (sampler.uniform);
  * `slot_ids`  the id each slot sampled last: a decode row whose token the host has not seen yet
     (DecodeRow.token_id == -1, overlapped steps) is fed from it, so step N+1 can be launched before
     step N's ids reach the host;
  * `penalties`  (at the first penalised request) each slot's output-token counts, prompt-token mask and
     penalties (sampler.PenaltyState): built when a sequence's first penalised row reaches the slot,
     then each step adds its sampled token on the device.
Per decode step only the ids the host knows, positions and slots cross the bus (one pinned copy), plus
the block-table rows and slot parameters that changed. On the host, per slot: the owner's sequence id and its
sampling kind (ROW_*: random, sorted, lasting logit edits, logprobs), so a step decides which sampling path
runs with one numpy reduction over its slots, not a pass over its rows. Every other small upload (admission
resets, prefix snapshot indices, eager prefill inputs, logit edits) goes through pinned memory too (inputs.to_device):
none of the runner's uploads blocks the host (tests/test_overlap_gpu.py). Host staging buffers are double-buffered (two
steps may be in flight); a buffer is rewritten only after the event of the step that used it.
"""
from __future__ import annotations

import logging
import os
from operator import attrgetter

import numpy as np
import torch

from linrnn_serve.batch import ForwardBatch
from linrnn_serve.cache import ModelCaches
from linrnn_serve.runner import sampler as S
from linrnn_serve.runner.cuda_graphs import GraphSet, bucket_for, decode_buckets
from linrnn_serve.runner.inputs import SeqWork, build_forward_batch, to_device
from linrnn_serve.runner.plan import (
    CachedSampleRow, DecodeRow, PrefillRow, SamplingRow, StepPlan, StepResult,
)
from linrnn_serve.runner.prefill_graphs import PrefillGraphs

log = logging.getLogger(__name__)

PROMPT_LOGPROB_SLICE = 256  # rows of f32 log-softmax computed at once for prompt logprobs

# what a sequence's sampling needs, fixed for its life (its SamplingParams): kept per state slot on the host
# so a decode step tests them with one numpy reduction instead of a Python pass per row
ROW_RANDOM, ROW_SORT, ROW_EDITS, ROW_LOGPROBS = 1, 2, 4, 8
_banned = attrgetter("banned_token_ids")


def row_kind(r: SamplingRow) -> int:
    """The ROW_* flags of a sampling row's sequence: random (temperature), sorted (top-k / top-p), logit
    edits that last (logit_bias, penalties; bans are per step), logprobs."""
    return (ROW_RANDOM if not r.is_greedy else 0) | (ROW_SORT if r.needs_sort else 0) | \
        (ROW_EDITS if r.logit_bias or S.has_penalties(r) else 0) | (ROW_LOGPROBS if r.logprobs is not None else 0)


class PendingStep:
    """A launched step whose sampled ids (and logprobs) are on their way to pinned host memory."""

    def __init__(self, event, prompt_logprobs: dict):
        self.event = event  # recorded after the device -> host copies (None on the CPU: already done)
        self.seq_ids: list[int] = []  # row order of `host_ids`
        self.host_ids: torch.Tensor | None = None
        self.logprobs: list[tuple[list[int], list[int], list[torch.Tensor]]] = []  # (rows, top_n, host parts)
        self.prompt_logprobs = prompt_logprobs
        self._result: StepResult | None = None

    def done(self) -> bool:
        return self.event is None or self.event.query()

    def result(self) -> StepResult:
        if self._result is None:
            if self.event is not None:
                self.event.synchronize()
            ids = self.host_ids.tolist() if self.host_ids is not None else []
            lps: dict[int, dict] = {}
            for rows, top_n, parts in self.logprobs:
                lps.update(zip([self.seq_ids[i] for i in rows], S.logprob_dicts(parts, top_n)))
            self._result = StepResult(dict(zip(self.seq_ids, ids)), self.prompt_logprobs, lps)
        return self._result


class ModelRunner:
    def __init__(self, model, caches: ModelCaches, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 enforce_eager: bool = False, progress: bool = True, max_num_batched_tokens: int = 2048,
                 pad_prefill: bool | None = None, mixed_batch: bool = False):
        """pad_prefill: short prefills padded to token buckets (captured unless enforce_eager); None:
        on CUDA for an unsharded model (prefill_graphs.py). mixed_batch: a step with prefill rows runs its
        decode rows in the prefill forward, as one-token chunks (one forward per step)."""
        self.model, self.caches = model, caches
        self.mixed_batch = mixed_batch
        self.device = next(model.parameters()).device
        self.block_size, self.max_model_len = block_size, max_model_len
        self.vocab_size = model.cfg.vocab_size
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        num_slots = self.num_slots = caches.state.num_slots
        dev = self.device
        self.cuda = dev.type == "cuda"
        pin = self.cuda
        i32, i64 = torch.int32, torch.int64
        B = self.max_batch
        # ---- the persistent device batch, per state slot (slot 0 = the dummy: block 0, greedy)
        self.slot_tables_np = np.zeros((num_slots, self.max_blocks), dtype=np.int32)  # host mirror
        self.slot_tables = torch.zeros(num_slots, self.max_blocks, dtype=i32, device=dev)
        self.slot_f = torch.zeros(num_slots, 3, dtype=torch.float32, device=dev)  # temperature, top_p, min_p
        self.slot_f[:, 1] = 1.0
        self.slot_i = torch.zeros(num_slots, 3, dtype=i64, device=dev)  # top_k, seed (int64 bits), prompt_len
        self.slot_ids = torch.zeros(num_slots, dtype=i64, device=dev)  # last sampled id per slot
        self._slot_owner = np.full(num_slots, -1, dtype=np.int64)  # seq id whose parameters the slot holds
        self._slot_kind = np.zeros(num_slots, dtype=np.uint8)  # its row_kind flags (host only)
        # ---- static decode inputs: host ids (-1: from slot_ids), positions, slots
        self._in = torch.zeros(3, B, dtype=i64, device=dev)
        self._cu = torch.arange(B + 1, dtype=i32, device=dev)
        self.logits_buf = torch.zeros(B, self.vocab_size, dtype=model.dtype, device=dev)
        # a step's sampled ids, in row order (decode rows, then prefill samples, then cached samples)
        self.step_ids = torch.zeros(num_slots + B, dtype=i64, device=dev)
        # structured output: token bitmask rows (int32 words, all ones = unconstrained), host -> static device
        words = (self.vocab_size + 31) // 32
        self._mask_host = torch.full((B, words), -1, dtype=torch.int32, pin_memory=pin)
        self._mask = torch.full((B, words), -1, dtype=torch.int32, device=dev)
        # ---- host staging, two of each (a step's copies read them after the call returns)
        self._stage = [self._new_stage(num_slots, B, pin) for _ in range(2)]
        self._events: list = [None, None]
        self._k = 1
        # the mask upload runs on its own stream, beside the forward (not queued behind it); the events keep
        # the pinned rows and the device buffer from being rewritten while a copy / the mask graph uses them
        self._mask_stream = torch.cuda.Stream(dev) if pin else None
        self._mask_copied = torch.cuda.Event() if pin else None
        self._mask_read = torch.cuda.Event() if pin else None
        self.graphs = GraphSet()
        self.use_graphs = False
        self.enforce_eager = enforce_eager
        self.progress = progress
        self._last: list[tuple[list[int], torch.Tensor]] = []
        self.penalties: S.PenaltyState | None = None  # per-slot penalty statistics (sampler.PenaltyState)
        if pad_prefill is None:
            pad_prefill = prefill_padding_default(model, dev)
        self.prefill_graphs = PrefillGraphs(
            model, caches, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len, block_size=block_size, device=dev) if pad_prefill else None

    def _new_stage(self, num_slots: int, B: int, pin: bool) -> dict:
        t = {"in": torch.zeros(3, B, dtype=torch.int64, pin_memory=pin),
             "sp_f": torch.zeros(num_slots, 3, dtype=torch.float32, pin_memory=pin),
             "sp_i": torch.zeros(num_slots, 3, dtype=torch.int64, pin_memory=pin),
             "sp_idx": torch.zeros(num_slots, dtype=torch.int64, pin_memory=pin),
             "bt": torch.zeros(num_slots, self.max_blocks, dtype=torch.int32, pin_memory=pin),
             "bt_idx": torch.zeros(num_slots, dtype=torch.int64, pin_memory=pin),
             "ids": torch.zeros(num_slots + B, dtype=torch.int64, pin_memory=pin)}
        return {"t": t, "np": {k: v.numpy() for k, v in t.items()}}

    # ---- CUDA graphs -----------------------------------------------------------------------
    def capture_graphs(self, strict: bool = False, note=None) -> None:
        """Capture the decode step per bucket (no-op on CPU or with enforce_eager). A failed capture
        falls back to eager decode, or raises with `strict` (tensor parallel: every rank must capture
        the same graphs). `note(what)` marks progress per bucket and kind (rank_watch.py)."""
        if self.enforce_eager or not self.cuda:
            log.info("CUDA graphs off (%s): decode runs eagerly at the same bucket sizes",
                     "enforce_eager" if self.enforce_eager else f"device {self.device.type}")
            return
        self._in.zero_()
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
        self._in.zero_()
        self.slot_ids.zero_()
        if self.prefill_graphs is not None:
            self.prefill_graphs.capture(progress=self.progress)
        torch.cuda.synchronize(self.device)

    # ---- the captured region ---------------------------------------------------------------
    def _decode_input_ids(self, b: int) -> torch.Tensor:
        """Token ids fed by the b decode rows: the host's, or (-1) the slot's last sampled id on the device."""
        host, slots = self._in[0, :b], self._in[2, :b]
        return torch.where(host >= 0, host, self.slot_ids.index_select(0, slots))

    def _decode_batch(self, b: int) -> ForwardBatch:
        bs = self.block_size
        pos, slots = self._in[1, :b], self._in[2, :b]
        state_idx = slots.to(torch.int32)
        tables = self.slot_tables.index_select(0, slots)
        blk = tables.gather(1, torch.div(pos, bs, rounding_mode="floor")[:, None]).squeeze(1).long()
        return ForwardBatch(
            input_ids=self._decode_input_ids(b), positions=pos, cu_seqlens=self._cu[: b + 1],
            seq_lens=(pos + 1).to(torch.int32), state_indices=state_idx, block_tables=tables,
            slot_mapping=blk * bs + pos % bs, is_decode=True, max_query_len=1, max_seq_len=self.max_model_len)

    def _publish(self, b: int, ids: torch.Tensor) -> None:
        """The decode rows' sampled ids: into the step's output and each slot's last id (padded rows
        write the dummy slot 0)."""
        self.step_ids[:b].copy_(ids)
        self.slot_ids.index_copy_(0, self._in[2, :b], self.step_ids[:b])

    def _decode_forward(self, b: int) -> None:
        logits = self.model(self._decode_batch(b), self.caches)
        self.logits_buf[:b].copy_(logits)
        self._publish(b, S.greedy(logits))

    def _mask_static(self, b: int) -> None:
        """Apply the step's token bitmask to the logits in place and redo the greedy pick (captured)."""
        S.apply_bitmask(self.logits_buf[:b], self._mask[:b])
        self._publish(b, S.greedy(self.logits_buf[:b]))

    def _static_sampling(self, b: int) -> S.SamplingTensors:
        """Each row's parameters gathered from its slot; the seeded uniform of (seed, output position)."""
        pos, slots = self._in[1, :b], self._in[2, :b]
        f = self.slot_f.index_select(0, slots)
        i = self.slot_i.index_select(0, slots)
        return S.SamplingTensors(f[:, 0], i[:, 0], f[:, 1], f[:, 2], S.uniform(i[:, 1], pos + 1 - i[:, 2]))

    def _sample_static(self, b: int, use_sort: bool) -> None:
        self._publish(b, S.sample(self.logits_buf[:b], self._static_sampling(b), use_sort))

    # ---- one step ----------------------------------------------------------------------------
    def execute(self, plan: StepPlan) -> StepResult:
        return self.execute_async(plan).result()

    @torch.inference_mode()
    def execute_async(self, plan: StepPlan) -> PendingStep:
        """Launch the step; its sampled ids come back through the PendingStep (no host sync on the decode
        path: the host may prepare and launch the next step meanwhile)."""
        k = self._k = self._k ^ 1
        if self._events[k] is not None:  # the step that last used this staging buffer has read it
            self._events[k].synchronize()
        stage = self._stage[k]
        self._prepare(plan, stage)
        self._last = []
        pending = PendingStep(None, {})
        result = StepResult(prompt_logprobs=pending.prompt_logprobs)
        mixed = self.mixed_batch and plan.decode and plan.prefill
        dec = self._run_decode(plan.decode, plan.fill_bitmask, stage) if plan.decode and not mixed else None
        pre = self._run_prefill(plan.prefill, result, plan.fill_bitmask, plan.decode if mixed else ()) \
            if plan.prefill else None
        hit = self._run_cached(plan.cached, plan.fill_bitmask) if plan.cached else None
        for src, dst in plan.slot_copies:
            self.caches.state.copy_slot(src, dst)
        off = 0
        for part, published in ((dec, True), (pre, False), (hit, False)):
            if part is not None:
                rows, ids, logits, want = part
                self._collect(rows, ids, logits, want, off, published, pending, stage)
                off += len(rows)
        if off:
            host = stage["t"]["ids"][:off]
            host.copy_(self.step_ids[:off], non_blocking=self.cuda)
            pending.host_ids = host
        if self.cuda:
            ev = self._events[k] = torch.cuda.Event()
            ev.record()
            pending.event = ev
        return pending

    def _prepare(self, plan: StepPlan, stage: dict) -> None:
        if plan.block_table_updates:
            mirror = self.slot_tables_np
            touched = set()
            for slot, start, blocks in plan.block_table_updates:
                mirror[slot, start:start + len(blocks)] = blocks
                touched.add(slot)
            idx = sorted(touched)
            m = len(idx)
            stage["np"]["bt_idx"][:m] = idx
            stage["np"]["bt"][:m] = mirror[idx]
            self.slot_tables.index_copy_(0, self._h2d(stage["t"]["bt_idx"][:m]), self._h2d(stage["t"]["bt"][:m]))
        self._save_snapshots(plan.snapshot_saves_before)
        if plan.reset_slots:
            self.caches.state.reset_slots(self._to_device(plan.reset_slots))
        if plan.snapshot_restores:
            src, dst = self._to_device([list(p) for p in zip(*plan.snapshot_restores)])
            self.caches.snapshots.copy_to(self.caches.state, src, dst)
        if plan.block_copies:
            src = self._to_device([s for s, _ in plan.block_copies])  # (copy-on-write: no host sync)
            dst = self._to_device([d for _, d in plan.block_copies])
            kv = self.caches.kv.kv  # [layers, 2, blocks, block_size, heads, dim]
            kv[:, :, dst] = kv[:, :, src]

    def _h2d(self, host: torch.Tensor) -> torch.Tensor:
        """A pinned staging slice -> the device without a host sync (stream-ordered)."""
        return host.to(self.device, non_blocking=True) if self.cuda else host

    def _to_device(self, values: list, dtype=torch.int64) -> torch.Tensor:
        """A small host list -> the device without a host sync (inputs.to_device)."""
        return to_device(torch.tensor(values, dtype=dtype), self.device)

    def _save_snapshots(self, saves: list[tuple[int, int]]) -> None:
        if saves:
            src, dst = self._to_device([list(p) for p in zip(*saves)])
            self.caches.state.copy_to(self.caches.snapshots, src, dst)

    def _upload_slot_params(self, samp: list[SamplingRow], slots: np.ndarray, stage: dict) -> np.ndarray:
        """Sampling parameters of the rows whose slot holds another sequence's (first decode in a slot), and
        the kind flags (ROW_*) of every row's sequence, per slot on the host."""
        owner, kind = self._slot_owner, self._slot_kind
        seq_ids = np.fromiter((s.seq_id for s in samp), dtype=np.int64, count=len(samp))
        new = np.flatnonzero(owner[slots] != seq_ids)
        if not len(new):
            return kind[slots]
        m = len(new)
        npst = stage["np"]
        for j, i in enumerate(new.tolist()):
            r = samp[i]
            npst["sp_f"][j] = (r.temperature, r.top_p, r.min_p)
            npst["sp_i"][j] = (r.top_k, S._i64(r.seed), r.prompt_len)
            kind[slots[i]] = row_kind(r)
        npst["sp_idx"][:m] = slots[new]
        owner[slots[new]] = seq_ids[new]
        t = stage["t"]
        idx = self._h2d(t["sp_idx"][:m])
        self.slot_f.index_copy_(0, idx, self._h2d(t["sp_f"][:m]))
        self.slot_i.index_copy_(0, idx, self._h2d(t["sp_i"][:m]))
        return kind[slots]

    def _run_decode(self, rows: list[DecodeRow], fill_bitmask, stage: dict):
        n = len(rows)
        b = bucket_for(self.buckets, n)
        samp = [r.sampling for r in rows]
        inp = stage["np"]["in"]
        inp[0, :n] = np.fromiter((r.token_id for r in rows), np.int64, n)
        inp[1, :n] = np.fromiter((r.position for r in rows), np.int64, n)
        slots = inp[2, :n]
        slots[:] = np.fromiter((r.slot for r in rows), np.int64, n)
        inp[:, n:b] = 0  # padding: token 0 at position 0 in dummy slot 0
        kind = self._upload_slot_params(samp, slots, stage)
        kinds = int(np.bitwise_or.reduce(kind))
        self._in.copy_(stage["t"]["in"], non_blocking=self.cuda)
        graphs = self.use_graphs and (b, "step") in self.graphs
        if graphs:
            self.graphs.replay(b, "step")
        else:
            self._decode_forward(b)
        if fill_bitmask is not None:
            # the forward is queued on the GPU: fill the grammar bitmask on the host meanwhile, then hand it
            # over without a sync (pinned -> static buffer, on the side stream) and mask inside the graph
            self._upload_mask(b, n, fill_bitmask, [s.seq_id for s in samp])
            if graphs:
                self.graphs.replay(b, "mask")
            else:
                self._mask_static(b)
            if self._mask_read is not None:
                self._mask_read.record()
        any_random, use_sort = kinds & ROW_RANDOM, kinds & ROW_SORT
        # bans (min_tokens, one-token bad words) change from step to step: the one per-row test left
        if kinds & ROW_EDITS or any(map(_banned, samp)):
            rows = samp + [None] * (b - n)
            pen = self._penalty_rows(rows)
            logits = S.apply_logit_edits(self.logits_buf[:b], rows, self.penalties, pen)
            ids = S.sample(logits, self._static_sampling(b), bool(use_sort)) if any_random else S.greedy(logits)
            self._publish(b, ids)
            if pen is not None:
                self.penalties.observe(pen, ids)
        elif any_random:
            if graphs:
                self.graphs.replay(b, "sample_sorted" if use_sort else "sample")
            else:
                self._sample_static(b, bool(use_sort))
        want = np.flatnonzero(kind & ROW_LOGPROBS).tolist() if kinds & ROW_LOGPROBS else []
        return samp, None, self.logits_buf[:n], want

    def _upload_mask(self, b: int, n: int, fill_bitmask, seq_ids: list[int]) -> None:
        """Fill rows [:n] of the pinned staging buffer (padding rows [n:b] all ones) and copy [:b] to the
        device buffer; on CUDA the copy runs on `_mask_stream` and the current stream waits for it."""
        host = self._mask_host
        if self._mask_copied is not None:
            self._mask_copied.synchronize()  # the previous step's copy has read the pinned rows (normally long done)
        fill_bitmask(host[:n], seq_ids)
        if b > n:
            host.numpy()[n:b] = -1  # numpy: torch's fill_ of a few hundred KB wakes OpenMP threads (ms spikes)
        if self._mask_stream is None:
            self._mask[:b].copy_(host[:b])
            return
        cur = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._mask_stream):
            self._mask_stream.wait_event(self._mask_read)  # the last mask graph has read the device buffer
            self._mask[:b].copy_(host[:b], non_blocking=True)
            self._mask_copied.record()
        cur.wait_event(self._mask_copied)

    def _run_prefill(self, rows: list[PrefillRow], result: StepResult, fill_bitmask=None,
                     decode: list[DecodeRow] | tuple = ()):
        """One varlen forward (padded to a token bucket and replayed from a CUDA graph when short, else
        eager); logits only for sampled rows (a fork samples n times from its prompt's last row) and
        prompt-logprob positions. `decode` (mixed batch): decode rows that ride in this forward as one-token
        chunks in front of the prefill rows (tokens 0 .. len(decode) - 1), their block tables from the
        per-slot mirror, their ids -1 fed from `slot_ids` on the device; sampled like first tokens."""
        nd = len(decode)
        bs, mirror = self.block_size, self.slot_tables_np
        work = [([d.token_id], d.position, d.slot, mirror[d.slot, :d.position // bs + 1]) for d in decode]
        work += [(r.token_ids, r.start_pos, r.slot, r.block_table) for r in rows]
        starts, cu = [], nd
        for r in rows:
            starts.append(cu)
            cu += len(r.token_ids)
        samp = [d.sampling for d in decode] + [s for r in rows for s in r.samples]
        sel = list(range(nd)) + [starts[i] + len(r.token_ids) - 1 for i, r in enumerate(rows) for _ in r.samples]
        plp_rows = []  # (row, [positions in chunk])
        for i, r in enumerate(rows):
            if r.prompt_logprobs is not None:
                pos = [j for j, t in enumerate(r.next_token_ids) if t is not None]
                plp_rows.append((r, pos))
                sel += [starts[i] + j for j in pos]
        # snapshot rows' last-token logits: a sampled row's own (no extra logits row: the lm_head's
        # result must not depend on it), else one more row
        snaps, snap_rows, k = [], [], nd
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
        bucket = pg.bucket_for(cu, len(work), len(sel)) if pg is not None and not plp_rows else None
        if bucket is not None:
            pg.stage(bucket, work, sel)
            batch = pg.batch(bucket)
        else:
            batch = build_forward_batch([SeqWork(list(t), p, s, list(b)) for t, p, s, b in work], bs, self.device)
            batch.logits_indices = self._to_device(sel)
        if any(d.token_id < 0 for d in decode):  # overlapped: the previous step's ids, still on the device
            ids = batch.input_ids[:nd]
            ids.copy_(torch.where(ids >= 0, ids, self.slot_ids.index_select(0, batch.state_indices[:nd].long())))
        logits = pg.run(bucket)[:len(sel)] if bucket is not None else self.model(batch, self.caches)
        k = len(samp)
        for r, pos in plp_rows:
            result.prompt_logprobs[r.seq_id] = self._prompt_logprobs(logits[k:k + len(pos)], r, pos)
            k += len(pos)
        if snaps:  # the state after each chunk and its last token's logits
            self._save_snapshots(snaps)
            idx, rows_idx = self._to_device([[s for _, s in snaps], snap_rows])
            self.caches.snapshot_logits.index_copy_(0, idx, logits.index_select(0, rows_idx).to(
                self.caches.snapshot_logits.dtype))
        if not samp:
            return None
        return self._sample(samp, logits[: len(samp)], fill_bitmask)

    def _run_cached(self, rows: list[CachedSampleRow], fill_bitmask=None):
        """First tokens of fully cached prompts, from their snapshots' stored logits (no forward)."""
        samp = [s for r in rows for s in r.samples]
        idx = self._to_device([r.snapshot for r in rows for _ in r.samples])
        return self._sample(samp, self.caches.snapshot_logits.index_select(0, idx), fill_bitmask)

    def _sample(self, samp: list[SamplingRow], logits: torch.Tensor, fill_bitmask=None):
        if fill_bitmask is not None:
            # first tokens (prefill / cached rows): eager, off the decode graph; a fresh host buffer keeps
            # the decode staging rows out of it (a prefill batch may sample more rows than a decode bucket)
            host = torch.empty((len(samp), self._mask.shape[1]), dtype=torch.int32)
            fill_bitmask(host, [s.seq_id for s in samp])
            S.apply_bitmask(logits, to_device(host, self.device))
        t = S.SamplingTensors.from_rows(samp, self.device)
        any_random = not all(s.is_greedy for s in samp)
        pen = self._penalty_rows(samp)
        x = S.apply_logit_edits(logits, samp, self.penalties, pen) if S.needs_logit_edits(samp) else logits
        ids = S.sample(x, t, any(s.needs_sort for s in samp)) if any_random else S.greedy(x)
        if pen is not None:
            self.penalties.observe(pen, ids)
        return samp, ids, logits, None

    def _penalty_rows(self, rows: list[SamplingRow | None]) -> S.PenaltyRows | None:
        """The batch's penalised rows (their per-slot statistics built first where needed); the state is
        allocated at the first penalised request."""
        if not any(S.has_penalties(r) for r in rows):
            return None
        if self.penalties is None:
            self.penalties = S.PenaltyState(self.num_slots, self.vocab_size, self.device)
        return self.penalties.prepare(rows)

    def _prompt_logprobs(self, logits: torch.Tensor, row: PrefillRow, pos: list[int]) -> list[dict[int, float]]:
        out: list[dict[int, float]] = []
        for k in range(0, len(pos), PROMPT_LOGPROB_SLICE):
            part = pos[k:k + PROMPT_LOGPROB_SLICE]
            nxt = self._to_device([row.next_token_ids[j] for j in part])
            out += S.logprobs_of(logits[k:k + len(part)], nxt, [row.prompt_logprobs] * len(part))
        return out

    def _collect(self, rows: list[SamplingRow], ids: torch.Tensor | None, logits: torch.Tensor,
                 want: list[int] | None, off: int, published: bool, pending: PendingStep, stage: dict) -> None:
        """Rows [off, off + len(rows)) of the step's output: their ids into `step_ids` and their slots' last
        ids (unless the decode graph did), their logprobs (rows `want`, None: those that ask) started on the
        way to the host."""
        n = len(rows)
        seq_ids = [r.seq_id for r in rows]
        pending.seq_ids += seq_ids
        self._last.append((seq_ids, logits))
        if not published:
            out = self.step_ids[off:off + n]
            out.copy_(ids)
            slots = stage["t"]["ids"][off:off + n]  # staging for the slot indices (overwritten by the D2H later)
            slots.numpy()[:] = [r.slot for r in rows]
            self.slot_ids.index_copy_(0, self._h2d(slots), out)
        if want is None:
            want = [i for i, r in enumerate(rows) if r.logprobs is not None]
        if want:
            top_n = [rows[i].logprobs for i in want]
            sel = self._to_device(want)
            parts = S.logprob_tensors(logits.index_select(0, sel), self.step_ids[off:off + n].index_select(0, sel),
                                      max(top_n))
            if self.cuda:
                parts = [p.to("cpu", non_blocking=True) if p.numel() else torch.empty(p.shape, dtype=p.dtype)
                         for p in parts]
            pending.logprobs.append(([off + i for i in want], top_n, parts))

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


def mixed_batch_default(device: torch.device) -> bool:
    """--mixed-batch when the flag is not given: off (README, "Mixed batches", says why)."""
    return False
