"""Continuous-batching scheduler: who runs in each step, with which cache slots and blocks.

Plain Python (no tensors). Each step:

1. every running sequence with exactly one new token decodes (highest priority first);
2. running sequences in the middle of a chunked prefill continue, within the step's token budget
   (`max_num_batched_tokens`, decode tokens included);
3. waiting sequences are admitted in priority order while a state slot, budget and KV blocks remain.

Priority is arrival order (then sample index). When a sequence needs a KV block (a new page, or a
copy of a page it shares) and none is free, the lowest-priority running sequence not yet scheduled
in this step is preempted by *recompute*: its slot and blocks are freed and it goes back to the
waiting queue with its tokens (prompt + generated so far); on re-admission it is prefilled again
from an empty state and continues exactly where it stopped (sampling is keyed by output position,
so a seeded stream does not notice). If no other sequence can be preempted it preempts itself.

n > 1 samples: the prompt is prefilled once. The request reserves n state slots at admission; when
the prompt's last chunk is scheduled the n-1 extra samples fork from it: they share its KV blocks
(reference counts; the partly filled last block is copied on first write) and get a copy of its
recurrent state right after that forward (`StepPlan.slot_copies`, HybridStateCache.copy_slot).
All n first tokens are drawn from the prompt's last logits with per-sample seeds. After the fork
each sample is an independent sequence (preempted alone, recomputed alone).

Prefix caching (optional, cache/prefix_cache.py): at admission a sequence looks up its tokens (all
but the last, whose logits it needs) in the radix tree; if a state snapshot sits at depth q on its
path it restores it (`StepPlan.snapshot_restores`, instead of a reset), shares the KV blocks of
[0, q) (the partly filled last one is copied on first write) and prefills from q. If a snapshot
with logits sits at its full length, nothing is prefilled: its first token is drawn from the
stored logits (`StepPlan.cached`). If the path goes
on to p > q, its first chunk ends exactly at p and the state there is snapshotted (a divergence
point). Every prefill that reaches the end of a sequence's tokens (a prompt, a recompute) and every
sequence that finishes (stop / length) snapshots too. Requests that ask for prompt logprobs compute
their whole prompt. Tree entries are evicted (LRU, unlocked only) before anyone is preempted.

Host cost: schedule() and postprocess() run for every row of every step (B = 128: ~0.1 ms of the step's
host time together), so their decode paths are single passes with the common case inlined, and each
sequence keeps its DecodeRow and (without penalties / bans) its SamplingRow from step to step, updated
in place rather than rebuilt (benchmarks/host_overhead.py measures it).

Finish detection (vLLM semantics): EOS (unless ignore_eos) and stop_token_ids, only once
min_tokens are out; stop strings on the detokenized text, across token boundaries (the text is cut
before the stop string unless include_stop_str_in_output); max_tokens; the context limit.
"""
from __future__ import annotations

import bisect
import enum
import itertools
import time
from dataclasses import dataclass
from typing import Callable, Protocol

from linrnn_serve.cache.allocator import BlockAllocator, SlotAllocator
from linrnn_serve.cache.prefix_cache import PrefixCache, PrefixMatch
from linrnn_serve.runner.plan import (
    CachedSampleRow, DecodeRow, PrefillRow, SamplingRow, StepPlan, StepResult, sample_seed,
)
from linrnn_serve.sampling_params import SamplingParams


PROMPT_LOGPROBS_MAX_CHUNK = 512


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


RUNNING, FINISHED = SeqStatus.RUNNING, SeqStatus.FINISHED  # (the hot loops' local names)


class Detokenizer(Protocol):
    """Incremental detokenizer of one sequence (engine/tokenizer.py provides one)."""

    def update(self, token_id: int) -> str:  # the new text this token completes
        ...

    def flush(self) -> str:  # at the end: a held-back incomplete character as U+FFFD (as vLLM / OpenAI)
        ...


DetokenizerFactory = Callable[[list[int], SamplingParams], Detokenizer]


class Sequence:
    """One sample of a request: its tokens, cache holdings and output state."""

    def __init__(self, seq_id: int, group: "Request", index: int, seed: int):
        self.seq_id, self.group, self.index, self.seed = seq_id, group, index, seed
        self.token_ids: list[int] = list(group.prompt_token_ids)
        self.prompt_len = len(self.token_ids)
        self.num_computed = 0  # tokens whose state / KV are in the caches (or queued for them: counted when scheduled)
        # tokens sampled by scheduled steps whose ids have not reached the host yet (overlapped steps: 0-2)
        self.num_inflight = 0
        self.slot: int | None = None
        self.blocks: list[int] = []
        self.status = SeqStatus.WAITING
        self.pending_children: list[Sequence] = []  # n > 1 samples not yet forked (parent only)
        self.logprobs: list[dict[int, float]] | None = [] if group.params.logprobs is not None else None
        self.text = ""
        self.detok: Detokenizer | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None
        self.prefix_node = None  # prefix-cache node it restored from (locked while it runs)
        self.divergence_at: int | None = None  # depth whose state it snapshots (its chunk ends there)
        self.sampling_row: SamplingRow | None = None  # reusable decode sampling row (Scheduler._sampling_row)
        # its decode row, rewritten each step it decodes (a plan's rows are read when the step is launched and,
        # for the sequence id, at its postprocess: both before the next schedule() or unaffected by it)
        self.decode_row: DecodeRow | None = None
        # the runner's per-slot penalty statistics hold this sequence's tokens (since its last slot assignment)
        self.penalty_stats_sent = False
        self.max_len: int | None = None  # prompt + output limit (Scheduler.max_len_for), set at add

    @property
    def priority(self) -> tuple[int, int]:
        return (self.group.arrival_order, self.index)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def decode_ready(self) -> bool:
        """Exactly one token to feed (the last sampled, maybe still on the device) and nothing to fork."""
        return len(self.token_ids) + self.num_inflight - self.num_computed == 1 and not self.pending_children

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def visible_text(self) -> str:
        """Text to stream: while running, hold back a possible stop-string prefix (vLLM's rule).
        It only ever grows: a stop string found later cuts the text at or after what was visible,
        because `_find_stop` only looks at matches that end in the newest characters."""
        p = self.group.params
        if self.finished or not p.stop or p.include_stop_str_in_output:
            return self.text
        hold = max(len(s) for s in p.stop) - 1
        return self.text[: max(0, len(self.text) - hold)]


class Request:
    """A request: n sequences sharing one prompt."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, seed: int,
                 prompt: str | None = None, arrival_time: float | None = None):
        self.request_id, self.prompt, self.params = request_id, prompt, params
        self.prompt_token_ids = list(prompt_token_ids)
        self.seed = seed
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.arrival_order = 0  # set by the scheduler
        self.seqs: list[Sequence] = []
        self.admitted = False  # has ever left the waiting queue (max_queue_len counts the others)
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.aborted = False
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache (first admission)
        self.num_prefill_tokens = 0  # tokens this request's sequences prefilled (recomputes included)

    @property
    def finished(self) -> bool:
        for s in self.seqs:
            if s.status is not SeqStatus.FINISHED:
                return False
        return True

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    block_size: int
    # admit new work only while this fraction of KV blocks stays free (fewer immediate preemptions)
    watermark: float = 0.01


@dataclass
class SchedulerStats:
    num_preemptions: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests (first admission only)
    generation_tokens: int = 0
    recomputed_tokens: int = 0  # tokens re-prefilled after preemption
    prefill_tokens: int = 0  # tokens run through prefill forwards
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (first admission)
    prefix_cache_hits: int = 0  # of which served from it


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, slots: SlotAllocator, blocks: BlockAllocator,
                 eos_token_ids: set[int] | list[int] = (), detokenizer_factory: DetokenizerFactory | None = None,
                 prefix_cache: PrefixCache | None = None):
        if cfg.max_num_batched_tokens < cfg.max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({cfg.max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({cfg.max_num_seqs}): every running sequence decodes each step")
        if slots.capacity < cfg.max_num_seqs:
            raise ValueError(f"{slots.capacity} state slots cannot hold max_num_seqs={cfg.max_num_seqs}")
        self.cfg, self.slots, self.blocks = cfg, slots, blocks
        self.prefix = prefix_cache
        if prefix_cache is not None and (prefix_cache.blocks is not blocks or prefix_cache.block_size != cfg.block_size):
            raise ValueError("the prefix cache must share the scheduler's block allocator and block size")
        self._pending_saves: list[tuple[int, int]] = []  # finished sequences' (slot, snapshot), next step
        self.eos_token_ids = set(eos_token_ids)
        self.detokenizer_factory = detokenizer_factory
        self.requests: dict[str, Request] = {}
        self.seqs: dict[int, Sequence] = {}
        self.waiting: list[Sequence] = []  # sorted by priority
        self.running: list[Sequence] = []  # sorted by priority
        self.stats = SchedulerStats()
        self._seq_ids = itertools.count()
        self._arrivals = itertools.count()
        self._num_unadmitted = 0
        self._watermark_blocks = int(cfg.watermark * blocks.capacity)

    # ---- requests -----------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.blocks.capacity * self.cfg.block_size

    def max_len_for(self, prompt_len: int, params: SamplingParams) -> int:
        """Total tokens (prompt + output) a sequence of this request may reach."""
        limit = min(self.cfg.max_model_len, self.kv_capacity_tokens)
        if params.max_tokens is not None:
            limit = min(limit, prompt_len + params.max_tokens)
        return limit

    def add_request(self, req: Request) -> None:
        """Queue a request (the engine has validated lengths and params)."""
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        n = req.params.n
        if n > self.cfg.max_num_seqs:
            raise ValueError(f"n={n} exceeds max_num_seqs={self.cfg.max_num_seqs}")
        req.arrival_order = next(self._arrivals)
        req.seqs = [Sequence(next(self._seq_ids), req, i, sample_seed(req.seed, i)) for i in range(n)]
        max_len = self.max_len_for(req.prompt_len, req.params)
        for s in req.seqs:
            s.max_len = max_len
            if self.detokenizer_factory is not None:
                s.detok = self.detokenizer_factory(req.prompt_token_ids, req.params)
            self.seqs[s.seq_id] = s
        parent = req.seqs[0]
        parent.pending_children = req.seqs[1:]
        self.requests[req.request_id] = req
        bisect.insort(self.waiting, parent, key=lambda s: s.priority)
        self._num_unadmitted += 1

    def abort_request(self, request_id: str) -> Request | None:
        """Stop a request wherever it is; frees its slots and blocks. None if unknown/finished."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        req.aborted = True
        if not req.admitted:
            self._num_unadmitted -= 1
        for s in req.seqs:
            if not s.finished:
                self._finish(s, "abort", None)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    @property
    def num_waiting_requests(self) -> int:
        """Requests never admitted (preempted ones excluded): what max_queue_len bounds."""
        return self._num_unadmitted

    @property
    def num_running_seqs(self) -> int:
        return len(self.running)

    @property
    def num_waiting_seqs(self) -> int:
        return len(self.waiting)

    # ---- scheduling -----------------------------------------------------------------------
    @property
    def oldest_waiting_arrival(self) -> float | None:
        """The arrival time of the first request in the waiting queue (None: it is empty)."""
        return self.waiting[0].group.arrival_time if self.waiting else None

    def num_finishing_within(self, steps: int) -> int:
        """Running sequences that reach their length limit within `steps` more decode steps."""
        return sum(1 for s in self.running if s.max_len - len(s.token_ids) - s.num_inflight <= steps)

    def schedule(self, admit: bool = True, admit_tokens: int | None = None,
                 parked: set[str] | frozenset = frozenset()) -> StepPlan:
        """The next step's plan; `admit=False` leaves the waiting queue where it is (engine/burst.py).
        `admit_tokens`: admit whole prompts of at most this many tokens in all (a burst's head start); `parked`:
        request ids whose running sequences do not decode this step (their burst's rest is still prefilling)."""
        plan = StepPlan()
        plan.snapshot_saves_before, self._pending_saves = self._pending_saves, []
        budget = self.cfg.max_num_batched_tokens
        scheduled: set[int] = set()

        # 1. decodes: every step for every running row, so the per-row work is kept to the minimum (the
        # decode_ready test, _reserve's no-new-block case and _sampling_row's reuse case are inlined; the
        # row objects persist per sequence and are updated in place)
        running, bs, refcount, decode = RUNNING, self.cfg.block_size, self.blocks.refcount, plan.decode
        for seq in list(self.running):
            if parked and seq.group.request_id in parked:
                continue
            toks, pos, inflight = seq.token_ids, seq.num_computed, seq.num_inflight
            n_toks = len(toks) + inflight
            if seq.status is not running or n_toks - pos != 1 or seq.pending_children:  # not decode_ready
                continue
            if n_toks >= seq.max_len:
                continue  # its last token is in flight: it finishes ("length") when that token arrives
            if budget < 1:
                break
            blocks = seq.blocks
            j = pos // bs
            if not (j < len(blocks) and refcount(blocks[j]) == 1) and not self._reserve(seq, 1, plan, scheduled):
                continue
            scheduled.add(seq.seq_id)
            srow = seq.sampling_row
            if srow is None:
                srow = self._sampling_row(seq)
            else:  # no penalties, no bans: only the output index (and after preemption the slot) change
                srow.out_index, srow.slot = n_toks - seq.prompt_len, seq.slot
                seq.num_inflight = inflight + 1
            # the token to feed: on the host, or (overlapped steps) sampled by the step in flight
            tok = toks[-1] if not inflight else -1
            row = seq.decode_row
            if row is None:
                row = seq.decode_row = DecodeRow(tok, pos, seq.slot, srow)
            else:
                row.token_id, row.position, row.slot, row.sampling = tok, pos, seq.slot, srow
            decode.append(row)
            seq.num_computed = pos + 1
            budget -= 1

        # 2. chunked prefills in flight (no pass at all when every running sequence already decodes)
        for seq in list(self.running) if len(scheduled) < len(self.running) else ():
            if seq.status is not SeqStatus.RUNNING or seq.seq_id in scheduled:
                continue
            if seq.decode_ready:  # left unscheduled by an exhausted budget
                continue
            n = min(len(seq.token_ids) - seq.num_computed, budget, self._chunk_cap(seq))
            if n <= 0:
                break
            if not self._reserve(seq, n, plan, scheduled):
                continue
            scheduled.add(seq.seq_id)
            plan.prefill.append(self._prefill_row(seq, n, plan))
            budget -= n

        bs = self.cfg.block_size
        left = budget if admit_tokens is None else min(budget, admit_tokens)
        while admit and self.waiting and left > 0:  # 3. admission
            seq = self.waiting[0]
            if seq.num_inflight or self.slots.num_free < 1 + len(seq.pending_children):
                break  # (preempted while a step sampling its next token is in flight: re-prefill once it arrives)
            m = self._lookup(seq)
            q = seq.num_computed = m.cached
            seq.divergence_at = m.matched if m.matched > q else None
            n = min(len(seq.token_ids) - q, left, self._chunk_cap(seq))  # 0: a full hit
            if admit_tokens is not None and n < len(seq.token_ids) - q:  # a head start takes whole prompts only
                seq.num_computed, seq.divergence_at = 0, None
                break
            # new blocks past the shared ones + a copy of the partly valid last shared block
            need = max(0, -(-(q + n) // bs) - len(m.blocks)) + (1 if q % bs else 0)
            reserve = self._watermark_blocks if self.running else 0
            if self.prefix is not None:
                self.prefix.lock(m.node)  # keep the snapshot we restore out of eviction's reach
                if self.blocks.num_free - need < reserve:
                    self.prefix.evict_blocks(need + reserve)
            if self.blocks.num_free - need < reserve:
                if self.prefix is not None:
                    self.prefix.unlock(m.node)
                seq.num_computed, seq.divergence_at = 0, None
                break
            self.waiting.pop(0)
            seq.slot = self.slots.alloc()
            seq.penalty_stats_sent = False
            for c in seq.pending_children:
                c.slot = self.slots.alloc()
                c.penalty_stats_sent = False
            seq.prefix_node = m.node
            seq.blocks = list(m.blocks)
            for b in seq.blocks:
                self.blocks.share(b)
            seq.status = SeqStatus.RUNNING
            bisect.insort(self.running, seq, key=lambda s: s.priority)
            if q:
                plan.snapshot_restores.append((m.node.snapshot, seq.slot))
                plan.block_table_updates.append((seq.slot, 0, list(seq.blocks)))
            else:
                plan.reset_slots.append(seq.slot)
            if n and not self._reserve(seq, n, plan, scheduled):
                raise RuntimeError("admission reserved blocks it had counted as free")
            if not seq.group.admitted:
                seq.group.admitted = True
                self._num_unadmitted -= 1
                self.stats.prompt_tokens += seq.prompt_len
                seq.group.num_cached_tokens = q
                if self.prefix is not None:
                    self.stats.prefix_cache_queries += seq.prompt_len
                    self.stats.prefix_cache_hits += q
            else:
                self.stats.recomputed_tokens += len(seq.token_ids) - q
            scheduled.add(seq.seq_id)
            if n:
                plan.prefill.append(self._prefill_row(seq, n, plan))
            else:
                plan.cached.append(CachedSampleRow(m.node.snapshot, [self._sampling_row(seq)] +
                                                   self._fork_children(seq, plan)))
            left -= n
        return plan

    def _lookup(self, seq: Sequence) -> PrefixMatch:
        """The prefix cache's best restore point for `seq` (nothing for prompt-logprob requests,
        which need logits at every prompt position). The last token is always computed: its logits
        pick the next one."""
        req = seq.group
        if self.prefix is None or (req.prompt_logprobs is not None and seq.index == 0
                                   and len(req.prompt_logprobs) < req.prompt_len):
            return PrefixMatch()
        full = self.prefix.match(seq.token_ids, len(seq.token_ids))
        if full.cached == len(seq.token_ids) and full.node.logits:
            return full
        return self.prefix.match(seq.token_ids, len(seq.token_ids) - 1)

    def _snapshot_after(self, seq: Sequence, row: PrefillRow, plan: StepPlan) -> None:
        """Snapshot the state (and last logits) at the end of `row` once this step's forward has run."""
        depth = row.start_pos + len(row.token_ids)
        if self.prefix.has_snapshot(seq.token_ids[:depth]):
            return
        snap = self.prefix.alloc_snapshot()
        if snap is not None:
            row.snapshot = snap
            plan.snapshot_inserts.append((seq.seq_id, depth, snap))

    @staticmethod
    def _chunk_cap(seq: Sequence) -> int:
        """Prompt logprobs need full-vocab logits for every prompt token: smaller chunks bound that.
        A divergence snapshot needs a chunk that ends exactly at its depth."""
        req = seq.group
        cap = 1 << 62
        if req.prompt_logprobs is not None and seq.index == 0 and len(req.prompt_logprobs) < req.prompt_len:
            cap = PROMPT_LOGPROBS_MAX_CHUNK
        if seq.divergence_at is not None and seq.num_computed < seq.divergence_at:
            cap = min(cap, seq.divergence_at - seq.num_computed)
        return cap

    def _block_need(self, seq: Sequence, n: int) -> tuple[int, list[int]]:
        """(new blocks, indices of shared blocks to copy) for writing n more tokens."""
        bs = self.cfg.block_size
        end = seq.num_computed + n
        new = max(0, -(-end // bs) - len(seq.blocks))
        first = seq.num_computed // bs
        cow = [j for j in range(first, min(len(seq.blocks), -(-end // bs)))
               if self.blocks.refcount(seq.blocks[j]) > 1]
        return new, cow

    def _reserve(self, seq: Sequence, n: int, plan: StepPlan, scheduled: set[int]) -> bool:
        """Give `seq` the blocks for n more tokens, preempting lower-priority sequences if needed.
        False if `seq` itself had to be preempted."""
        if n == 1:  # the decode case, every step for every row: one lookup unless a block boundary is crossed
            j = seq.num_computed // self.cfg.block_size
            if j < len(seq.blocks) and self.blocks.refcount(seq.blocks[j]) == 1:
                return True
        while True:
            new, cow = self._block_need(seq, n)
            if new + len(cow) <= self.blocks.num_free:
                break
            if self.prefix is not None and self.prefix.evict_blocks(new + len(cow)):
                continue
            victim = next((v for v in reversed(self.running)
                           if v is not seq and v.seq_id not in scheduled), None)
            if victim is None:
                self._preempt(seq, plan)
                return False
            self._preempt(victim, plan)
        for j in cow:
            dst = self.blocks.alloc(1)[0]
            plan.block_copies.append((seq.blocks[j], dst))
            self.blocks.free([seq.blocks[j]])
            seq.blocks[j] = dst
            plan.block_table_updates.append((seq.slot, j, [dst]))
        if new:
            start = len(seq.blocks)
            got = self.blocks.alloc(new)
            seq.blocks += got
            plan.block_table_updates.append((seq.slot, start, got))
        return True

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self._release(seq)
        for c in seq.pending_children:
            if c.slot is not None:
                self.slots.free(c.slot)
                c.slot = None
        seq.status = SeqStatus.WAITING
        seq.num_computed = 0
        self.running.remove(seq)
        bisect.insort(self.waiting, seq, key=lambda s: s.priority)
        self.stats.num_preemptions += 1
        plan.preempted.append(seq.seq_id)

    def _release(self, seq: Sequence) -> None:
        if seq.prefix_node is not None:
            self.prefix.unlock(seq.prefix_node)
            seq.prefix_node = None
        seq.divergence_at = None
        if seq.slot is not None:
            self.slots.free(seq.slot)
            seq.slot = None
        if seq.blocks:
            self.blocks.free(seq.blocks)
            seq.blocks = []

    def _prefill_row(self, seq: Sequence, n: int, plan: StepPlan) -> PrefillRow:
        start = seq.num_computed
        row = PrefillRow(seq.seq_id, seq.token_ids[start:start + n], start, seq.slot, list(seq.blocks))
        seq.num_computed = start + n
        req = seq.group
        req.num_prefill_tokens += n
        self.stats.prefill_tokens += n
        if self.prefix is not None:
            end = start + n
            if end == len(seq.token_ids) or end == seq.divergence_at:
                self._snapshot_after(seq, row, plan)
            if seq.divergence_at is not None and end >= seq.divergence_at:
                seq.divergence_at = None
        if req.prompt_logprobs is not None and seq.index == 0 and len(req.prompt_logprobs) < req.prompt_len:
            done = len(req.prompt_logprobs)  # entries for prompt positions [0, done)
            nxt = [seq.token_ids[p + 1] if done <= p + 1 < seq.prompt_len else None for p in range(start, start + n)]
            if any(t is not None for t in nxt):
                row.prompt_logprobs, row.next_token_ids = req.params.prompt_logprobs, nxt
        if start + n == len(seq.token_ids):
            row.samples.append(self._sampling_row(seq))
            row.samples += self._fork_children(seq, plan)
        return row

    def _fork_children(self, seq: Sequence, plan: StepPlan) -> list[SamplingRow]:
        """Fork the n > 1 samples off a sequence whose prompt is done (state copied after the forward)."""
        rows = []
        for c in seq.pending_children:
            c.blocks = list(seq.blocks)
            for b in c.blocks:
                self.blocks.share(b)
            c.num_computed = len(seq.token_ids)
            c.status = SeqStatus.RUNNING
            bisect.insort(self.running, c, key=lambda s: s.priority)
            plan.slot_copies.append((seq.slot, c.slot))
            plan.block_table_updates.append((c.slot, 0, list(c.blocks)))
            rows.append(self._sampling_row(c))
        seq.pending_children = []
        return rows

    def _sampling_row(self, seq: Sequence) -> SamplingRow:
        """The row of one token `seq` samples in this step (counted in flight until postprocess)."""
        p = seq.group.params
        num_output = len(seq.token_ids) + seq.num_inflight - seq.prompt_len
        seq.num_inflight += 1
        row = seq.sampling_row
        if row is not None:  # no penalties, no bans: only the output index (and after preemption the slot) change
            row.out_index, row.slot = num_output, seq.slot
            return row
        row = SamplingRow(seq.seq_id, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                          seed=seq.seed, out_index=num_output, prompt_len=seq.prompt_len, slot=seq.slot,
                          presence_penalty=p.presence_penalty,
                          frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                          logprobs=p.logprobs, logit_bias=p.logit_bias or None)
        if (row.presence_penalty or row.frequency_penalty or row.repetition_penalty != 1.0) and \
                not seq.penalty_stats_sent:  # the first row in this slot: the runner builds the slot's statistics
            row.output_token_ids = seq.output_token_ids
            row.prompt_token_ids = seq.group.prompt_token_ids if row.repetition_penalty != 1.0 else []
            seq.penalty_stats_sent = True
        banned: set[int] = set()
        if num_output < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned |= self.eos_token_ids
        if p.bad_words_token_ids:  # vLLM: ban a bad word's last token where its other tokens just came
            toks, n_out = seq.token_ids, seq.num_output  # (compared in place: no copy of the output)
            for w in p.bad_words_token_ids:
                k = len(w) - 1
                if k == 0 or (n_out >= k and toks[len(toks) - k:] == w[:-1]):
                    banned.add(w[-1])
        if banned:
            row.banned_token_ids = sorted(banned)
        elif not row.needs_logit_edits and not p.bad_words_token_ids and num_output >= p.min_tokens:
            seq.sampling_row = row  # reused by later steps (the runner keeps no reference past a step)
        return row

    # ---- results --------------------------------------------------------------------------
    def postprocess(self, plan: StepPlan, result: StepResult, now: float | None = None) -> list[Request]:
        """Apply a step's sampled tokens; returns the requests with new output (finished included)."""
        now = time.monotonic() if now is None else now
        touched: dict[str, Request] = {}
        seqs = self.seqs
        for seq_id, depth, snap in plan.snapshot_inserts:  # the forward has written these snapshots
            seq = seqs.get(seq_id)
            # (overlapped steps: preempted since this step was scheduled -> its blocks no longer hold depth tokens)
            ok = seq is not None and not seq.finished and seq.num_computed >= depth and \
                len(seq.blocks) * self.cfg.block_size >= depth
            if not (ok and self.prefix.insert(seq.token_ids[:depth], seq.blocks, snap, logits=True)):
                self.prefix.snapshots.free(snap)
        # the sampled sequences in row order (None or finished: a stop found a step late, an abort: dropped)
        sampled = [seqs.get(row.sampling.seq_id) for row in plan.decode]
        for row in plan.prefill:
            seq = seqs.get(row.seq_id)
            if seq is None or seq.finished:
                continue
            plp = result.prompt_logprobs.get(row.seq_id)
            if plp and seq.group.prompt_logprobs is not None:
                seq.group.prompt_logprobs.extend(plp)
                touched[seq.group.request_id] = seq.group
            sampled += [seqs.get(s.seq_id) for s in row.samples]
        for row in plan.cached:
            sampled += [seqs.get(s.seq_id) for s in row.samples]
        self._append(sampled, result, now, touched)
        return list(touched.values())

    def _append(self, sampled: list[Sequence | None], result: StepResult, now: float,
                touched: dict[str, Request]) -> None:
        """Append each sequence's sampled token and check its finish conditions (one loop: it runs for
        every row of every step; text and stop strings in _append_text)."""
        ids, lps, eos = result.sampled, result.logprobs, self.eos_token_ids
        n = 0
        for seq in sampled:
            if seq is None or seq.status is FINISHED:
                continue
            t = ids.get(seq.seq_id)
            if t is None:
                raise RuntimeError(f"runner returned no token for sequence {seq.seq_id}")
            req = seq.group
            p = req.params
            toks = seq.token_ids
            toks.append(t)
            seq.num_inflight -= 1
            n += 1
            if seq.logprobs is not None:
                seq.logprobs.append(lps.get(seq.seq_id) or {})
            if seq.first_token_time is None:
                seq.first_token_time = now
                if req.first_token_time is None:
                    req.first_token_time = now
            seq.last_token_time = now
            touched[req.request_id] = req
            stopped_by_token = None
            if len(toks) - seq.prompt_len >= p.min_tokens:
                if t in p.stop_token_ids:
                    stopped_by_token = t
                elif not p.ignore_eos and t in eos:
                    stopped_by_token = -1  # EOS: stop_reason None
            if seq.detok is not None or stopped_by_token is not None:
                self._append_text(seq, t, stopped_by_token)
            elif len(toks) >= seq.max_len:
                self._finish(seq, "length", None)
        self.stats.generation_tokens += n

    def _append_text(self, seq: Sequence, t: int, stopped_by_token: int | None) -> None:
        """After appending token t: its text (detokenizing sequences), stop tokens and stop strings, the
        length limit."""
        p = seq.group.params
        new_chars = 0
        if seq.detok is not None and (stopped_by_token is None or p.include_stop_str_in_output):
            delta = seq.detok.update(t)
            seq.text += delta
            new_chars = len(delta)
        if stopped_by_token is not None:
            self._finish(seq, "stop", None if stopped_by_token == -1 else stopped_by_token)
            return
        if p.stop and new_chars and seq.num_output >= p.min_tokens:
            hit = _find_stop(seq.text, new_chars, p.stop, p.include_stop_str_in_output)
            if hit is not None:
                stop, cut = hit
                if cut is not None:
                    seq.text = seq.text[:cut]
                self._finish(seq, "stop", stop, flush_text=False)  # bytes after the stop string are dropped
                return
        if len(seq.token_ids) >= seq.max_len:
            self._finish(seq, "length", None)

    def _finish(self, seq: Sequence, reason: str, stop_reason, flush_text: bool = True) -> None:
        if flush_text and seq.detok is not None and seq.num_output:
            seq.text += seq.detok.flush()  # a trailing partial UTF-8 character shows as U+FFFD, not lost
        if self.prefix is not None and reason != "abort" and seq.status is SeqStatus.RUNNING and \
                seq.num_computed > 0 and not seq.pending_children:
            self._snapshot_finished(seq)
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        for c in seq.pending_children:  # only on abort before the fork
            if c.slot is not None:
                self.slots.free(c.slot)
                c.slot = None
            c.status = SeqStatus.FINISHED
            c.finish_reason = reason
            self.seqs.pop(c.seq_id, None)
        seq.pending_children = []
        seq.status = SeqStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.seqs.pop(seq.seq_id, None)
        req = seq.group
        if req.finished and req.request_id in self.requests:
            req.finished_time = time.monotonic()
            del self.requests[req.request_id]

    def _snapshot_finished(self, seq: Sequence) -> None:
        """Keep a finished sequence's state (prompt + output fed so far) and KV in the prefix tree;
        its slot is read at the start of the next step, before anyone reuses it."""
        toks = seq.token_ids[:seq.num_computed]
        if len(seq.blocks) * self.cfg.block_size < len(toks) or self.prefix.has_snapshot(toks):
            return
        snap = self.prefix.alloc_snapshot()
        if snap is None:
            return
        if self.prefix.insert(toks, seq.blocks, snap):
            self._pending_saves.append((seq.slot, snap))
        else:
            self.prefix.snapshots.free(snap)

    def check_idle_integrity(self) -> None:
        """When nothing is queued, every state slot and KV block must be back in its free list."""
        if self.requests or self.running or self.waiting or self.seqs:
            raise RuntimeError(f"scheduler not idle: {len(self.requests)} requests, {len(self.running)} running, "
                               f"{len(self.waiting)} waiting, {len(self.seqs)} sequences")
        self.slots.check_all_free()
        if self.prefix is None:
            self.blocks.check_all_free()
        else:  # the tree's entries are the only holders left
            self.prefix.check_idle()


def _find_stop(text: str, new_chars: int, stops: list[str], include: bool) -> tuple[str, int | None] | None:
    """The first stop string that ends inside the newest `new_chars` characters: (stop, cut index or
    None to keep the whole text)."""
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        i = text.find(stop, start)
        if i == -1:
            continue
        if include:
            i += len(stop)
            return stop, (i if i < len(text) else None)
        return stop, i
    return None
