"""What the scheduler asks the runner to do in one step: plain host data, no tensors.

The scheduler decides who runs (scheduler.py); the runner turns a `StepPlan` into device inputs and
hands back a `StepResult`. Keeping the hand-off in plain dataclasses keeps the scheduler free of
CUDA and lets scheduler tests run without a model.

One engine step = one decode forward over every running sequence that has exactly one new token
(bucket-padded, CUDA graph) + one varlen forward over the prefill chunks (new prompts, continuing
chunked prefills, and re-prefills after preemption; padded and graph-captured when short). With
--no-mixed-batch decode rows never ride in the prefill forward, so a sequence's decode math does not
depend on who else is prefilling (batch invariance, bit for bit). With --mixed-batch a step that has
prefill rows runs its decode rows inside that one forward as one-token chunks: the same tokens and
sampling, but those rows go through the prefill kernels (another summation order; on the GPU bf16
operands in the GDN chunk matmuls), so their logits then depend on who else is prefilling in the last
bits (tests/test_mixed_batch.py: within 1e-4 relative on the CPU f32 model). A step without prefill rows
is the decode forward either way.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

_MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """A 64-bit integer mixer (Steele et al.'s SplitMix64 finaliser), pure Python."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def sample_seed(request_seed: int, sample_index: int) -> int:
    """Seed of the sample_index-th of a request's n samples (distinct streams for n > 1)."""
    return splitmix64((request_seed & _MASK64) ^ splitmix64(sample_index + 1))


def uniform_for(seed: int, position: int) -> float:
    """The uniform in (0, 1) that decides the token at output `position` of a seeded stream.

    Counter-based: a pure function of (seed, position), so a request draws the same numbers
    whatever batch, row or step it lands in (and after preemption). 53 bits, never 0 or 1.
    """
    h = splitmix64(seed ^ splitmix64(position + 0x5EED))
    return ((h >> 11) + 0.5) / float(1 << 53)


@dataclass(slots=True)
class SamplingRow:
    """How to pick one sequence's next token from one logits row."""

    seq_id: int
    temperature: float = 0.0  # < 1e-5: greedy (argmax of the raw, penalised logits)
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    # the seeded draw: the device computes uniform_for(seed, out_index) (sampler.uniform); a decode row's
    # out_index is derived on the device from its position and prompt_len (runner's per-slot parameters)
    seed: int = 0
    out_index: int = 0  # output position of the token this row picks
    prompt_len: int = 0
    slot: int = 0  # the sequence's state slot (where its sampled id is kept on the device for the next step)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # penalties: the sequence's output so far and (repetition penalty) its prompt, only on its first row
    # after a slot assignment: the runner then builds the slot's statistics (sampler.PenaltyState) and
    # later rows (None) only add the sampled token there, on the device
    output_token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    banned_token_ids: list[int] = field(default_factory=list)  # EOS / stop ids while < min_tokens
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (first of the edits)
    logprobs: int | None = None  # top-N alternatives + the sampled token's logprob

    @property
    def needs_logit_edits(self) -> bool:
        """True when this row's logits must be changed before sampling (the eager path)."""
        return bool(self.banned_token_ids) or bool(self.logit_bias) or self.presence_penalty != 0.0 or \
            self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-5

    @property
    def needs_sort(self) -> bool:
        return not self.is_greedy and (self.top_k > 0 or self.top_p < 1.0)


@dataclass(slots=True)
class DecodeRow:
    token_id: int  # the token fed now (the last sampled one); -1: still on the device (overlapped steps:
    #                the runner feeds the id the previous step sampled for this slot)
    position: int  # its position (= tokens already cached)
    slot: int  # recurrent-state slot (its block table lives in the runner's per-slot table)
    sampling: SamplingRow


@dataclass
class PrefillRow:
    seq_id: int
    token_ids: list[int]  # this chunk
    start_pos: int
    slot: int
    block_table: list[int]
    # rows to sample from the chunk's last token (empty for a non-final chunk; n > 1 on a fork)
    samples: list[SamplingRow] = field(default_factory=list)
    # prompt logprobs: top-N per position; next_token_ids[j] is the prompt token after chunk token j
    # (None past the prompt's end)
    prompt_logprobs: int | None = None
    next_token_ids: list[int | None] | None = None
    # prefix cache: snapshot slot that keeps the state after this chunk and its last token's logits
    snapshot: int | None = None


@dataclass
class CachedSampleRow:
    """A sequence whose whole prompt is a prefix-cache snapshot with logits: no forward; its first
    token(s) (n > 1: one per sample) are drawn from the snapshot's stored logits row."""

    snapshot: int
    samples: list[SamplingRow] = field(default_factory=list)


@dataclass
class StepPlan:
    decode: list[DecodeRow] = field(default_factory=list)
    prefill: list[PrefillRow] = field(default_factory=list)
    cached: list[CachedSampleRow] = field(default_factory=list)
    reset_slots: list[int] = field(default_factory=list)  # zero before the forward (fresh sequences)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # KV (src, dst) copy-on-write, before
    # slot -> the first `len(blocks)` entries of its block table, given from index `start`
    block_table_updates: list[tuple[int, int, list[int]]] = field(default_factory=list)
    slot_copies: list[tuple[int, int]] = field(default_factory=list)  # state (src, dst) after the forward (n>1)
    # sequences of this plan (in order) whose state was preempted: for logs/metrics only
    preempted: list[int] = field(default_factory=list)
    # prefix caching (cache/prefix_cache.py): state slot <-> snapshot slot copies. Order in a step:
    # saves_before (finished sequences' last state, read before their slots are reused), restores
    # (snapshot -> a new sequence's slot, instead of a reset), the forward, then the prefill rows'
    # own snapshots (PrefillRow.snapshot: prompt ends and divergence points, with logits)
    snapshot_saves_before: list[tuple[int, int]] = field(default_factory=list)  # (state slot, snapshot)
    snapshot_restores: list[tuple[int, int]] = field(default_factory=list)  # (snapshot, state slot)
    # scheduler bookkeeping (not for the runner): (seq_id, depth, snapshot) to enter into the tree
    # once this step's forward has run
    snapshot_inserts: list[tuple[int, int, int]] = field(default_factory=list)
    # structured output (engine/structured_output.py): fill(host int32 [rows, words] preset to -1, seq ids of
    # those rows) writes the token bitmask of the constrained rows. The one non-data member: the runner
    # calls it after launching the forward so the host work overlaps the GPU; an executor whose workers live
    # in other processes calls it in the core and ships the rows instead. None: no row is constrained.
    fill_bitmask: Callable | None = None

    @property
    def empty(self) -> bool:
        return not self.decode and not self.prefill and not self.cached

    @property
    def num_tokens(self) -> int:
        return len(self.decode) + sum(len(p.token_ids) for p in self.prefill)


@dataclass
class StepResult:
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> sampled token id
    prompt_logprobs: dict[int, list[dict[int, float] | None]] = field(default_factory=dict)  # seq_id -> chunk's
    # seq_id -> {token_id: logprob} (the sampled token + top-N alternatives), rows that asked for logprobs only
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)
