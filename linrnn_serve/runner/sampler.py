"""Token sampling: greedy, temperature, top-k, top-p, min-p, seeded; penalties; logprobs.

Everything on the decode hot path is shape-static and sync-free, so it runs inside a CUDA graph:

* greedy rows take argmax of the raw logits (the captured decode graph always computes it);
* sampled rows draw by inverse CDF: probs = softmax(logits / T), tokens outside min-p / top-k /
  top-p get probability 0, then the token is the first index whose cumulative probability (f64,
  in vocabulary order) exceeds u * total. The uniform u is a pure function of (the sample's seed,
  output position), computed on the device (`uniform`, bit-identical to runner/plan.py::uniform_for,
  its pure-Python reference) from per-row seed and position tensors, so a seeded request draws the
  same token whatever its batch, row or step, and after preemption, with nothing drawn on the host.
* top-k / top-p need a sort of the vocabulary: a separate variant (`use_sort`) only used when some
  row of the batch asks for them.

logit_bias, penalties (presence / frequency / repetition) and the bans (min_tokens: EOS / stop ids;
bad_words) change the logits first, eagerly (`apply_logit_edits`), only for batches that have such a
row. Rows without edits are bit-unchanged by it. The penalties' token statistics live on the device per
state slot (`PenaltyState`): built once when a sequence's first penalised row reaches its slot, then
each step adds the sampled token there (O(1) per row and step, no host lists).

Logprobs are those of the raw model distribution (vLLM's default `raw_logprobs`): log_softmax of
the unprocessed logits, the sampled token's value and the top-N alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from linrnn_serve.runner.inputs import to_device as _to_device
from linrnn_serve.runner.plan import SamplingRow

GREEDY_EPS = 1e-5  # temperature below this is greedy (vLLM's _SAMPLING_EPS)


def _i64(c: int) -> int:
    """A 64-bit pattern as the int64 torch stores it."""
    c &= (1 << 64) - 1
    return c - (1 << 64) if c >> 63 else c


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """runner/plan.py::splitmix64 on int64 tensors (wrapping arithmetic = the same bits mod 2**64)."""
    x = x + _i64(0x9E3779B97F4A7C15)
    x = (x ^ _srl(x, 30)) * _i64(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * _i64(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def uniform(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in (0, 1): runner/plan.py::uniform_for(seed, index) elementwise, on the device
    (seed: int64 bit patterns of the 64-bit seeds; index: int64 output positions). Sync-free, shape-static."""
    h = splitmix64(seed ^ splitmix64(index + 0x5EED))
    return (_srl(h, 11).double() + 0.5) / float(1 << 53)




@dataclass
class SamplingTensors:
    """Per-row sampling parameters as device tensors [B]."""

    temperature: torch.Tensor  # float32
    top_k: torch.Tensor  # int64, 0 = off
    top_p: torch.Tensor  # float32
    min_p: torch.Tensor  # float32
    u: torch.Tensor  # float64 in (0, 1)

    @classmethod
    def from_rows(cls, rows: list[SamplingRow], device) -> "SamplingTensors":
        f = _to_device(torch.tensor([(r.temperature, r.top_p, r.min_p) for r in rows], dtype=torch.float32), device)
        i = _to_device(torch.tensor([(r.top_k, _i64(r.seed), r.out_index) for r in rows], dtype=torch.int64), device)
        return cls(f[:, 0], i[:, 0], f[:, 1], f[:, 2], uniform(i[:, 1], i[:, 2]))


def greedy(logits: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)


def sample(logits: torch.Tensor, t: SamplingTensors, use_sort: bool) -> torch.Tensor:
    """Token ids [B] (int64). Greedy rows (temperature < GREEDY_EPS) take argmax(logits)."""
    x = logits.float()
    V = x.shape[-1]
    is_greedy = t.temperature < GREEDY_EPS
    temp = torch.where(is_greedy, torch.ones_like(t.temperature), t.temperature)
    probs = torch.softmax(x / temp[:, None], dim=-1)
    # min-p: drop tokens below min_p x the most likely one (min_p = 0 keeps everything)
    probs = probs * (probs >= t.min_p[:, None] * probs.amax(-1, keepdim=True))
    if use_sort:
        ps, order = probs.sort(dim=-1, descending=True, stable=True)
        rank = torch.arange(V, device=x.device)
        k = torch.where(t.top_k > 0, t.top_k, V)
        ps = ps * (rank[None, :] < k[:, None])
        csum = ps.double().cumsum(-1)
        # top-p: keep the smallest prefix whose mass reaches top_p of what is left (always >= 1 token)
        before = csum - ps.double()
        ps = ps * (before < t.top_p.double()[:, None] * csum[:, -1:])
        probs = torch.zeros_like(probs).scatter_(1, order, ps)
    cdf = probs.double().cumsum(-1)
    target = t.u[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=V - 1)
    return torch.where(is_greedy, x.argmax(-1), ids)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Structured output: tokens whose bit is 0 get -inf, in place. `bitmask` int32 [B, ceil(V/32)]
    (xgrammar's layout: bit t % 32 of word t // 32; all ones = unconstrained, bit-unchanged row).
    Shape-static and sync-free (runs inside the decode CUDA graph): the words are read as
    little-endian bytes and expanded to one bool per token."""
    B, V = logits.shape
    by = bitmask.view(torch.uint8)  # [B, 4 * words]: byte k holds tokens 8k .. 8k + 7
    shifts = torch.arange(8, dtype=torch.uint8, device=logits.device)
    allowed = ((by.unsqueeze(-1) >> shifts) & 1).view(B, -1)[:, :V]
    logits.masked_fill_(allowed == 0, float("-inf"))


def needs_logit_edits(rows: list[SamplingRow | None]) -> bool:
    return any(r is not None and r.needs_logit_edits for r in rows)


def has_penalties(r: SamplingRow | None) -> bool:
    return r is not None and (r.presence_penalty != 0.0 or r.frequency_penalty != 0.0 or r.repetition_penalty != 1.0)


@dataclass
class PenaltyRows:
    """The penalised rows of one batch: their row indices and state slots, as device tensors."""

    rows: torch.Tensor  # int64 [P]
    slots: torch.Tensor  # int64 [P]


class PenaltyState:
    """Per state slot, on the device: the count of each token in the sequence's output (int32 [slots, V]),
    which tokens its prompt holds (bool [slots, V], for the repetition penalty) and its three penalties.
    Allocated at the first penalised request: slots x V x 5 bytes (e.g. 65 x 248k vocabulary: 81 MB).

    A sequence's first penalised row in a slot carries its prompt and output so far
    (`SamplingRow.output_token_ids is not None`: the scheduler attaches them once per slot assignment);
    the slot is rebuilt from them. Every later step adds only the token it sampled (`observe`, on the
    device). `owner` (host) checks that a row without lists finds its own sequence's statistics."""

    def __init__(self, num_slots: int, vocab: int, device):
        self.device, self.vocab = torch.device(device), vocab
        self.counts = torch.zeros(num_slots, vocab, dtype=torch.int32, device=device)
        self.prompt = torch.zeros(num_slots, vocab, dtype=torch.bool, device=device)
        self.params = torch.zeros(num_slots, 3, dtype=torch.float32, device=device)  # repetition, frequency, presence
        self.owner = [-1] * num_slots

    def prepare(self, rows: list[SamplingRow | None]) -> PenaltyRows | None:
        """The batch's penalised rows, their slots (re)built first where the row brings its lists."""
        pen = [i for i, r in enumerate(rows) if has_penalties(r)]
        if not pen:
            return None
        fresh = [rows[i] for i in pen if rows[i].output_token_ids is not None]
        for i in pen:
            r = rows[i]
            if r.output_token_ids is None and self.owner[r.slot] != r.seq_id:
                raise RuntimeError(f"penalty state of slot {r.slot} belongs to sequence {self.owner[r.slot]}, not "
                                   f"{r.seq_id}, and the row brings no token lists")
        if fresh:
            self._rebuild(fresh)
        slots = [rows[i].slot for i in pen]
        t = _to_device(torch.tensor([pen, slots], dtype=torch.int64), self.device)
        return PenaltyRows(t[0], t[1])

    def _rebuild(self, rows: list[SamplingRow]) -> None:
        V = self.vocab
        slots = [r.slot for r in rows]
        for r in rows:
            self.owner[r.slot] = r.seq_id
        idx = _to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        self.counts.index_fill_(0, idx, 0)
        self.prompt.index_fill_(0, idx, False)
        self.params.index_copy_(0, idx, _to_device(torch.tensor(
            [(r.repetition_penalty, r.frequency_penalty, r.presence_penalty) for r in rows], dtype=torch.float32),
            self.device))
        out = [r.slot * V + t for r in rows for t in r.output_token_ids if 0 <= t < V]
        if out:
            flat = _to_device(torch.tensor(out, dtype=torch.int64), self.device)
            self.counts.view(-1).scatter_add_(0, flat, torch.ones(len(out), dtype=torch.int32, device=self.device))
        seen = [r.slot * V + t for r in rows if r.repetition_penalty != 1.0 for t in (r.prompt_token_ids or ())
                if 0 <= t < V]
        if seen:
            self.prompt.view(-1).index_fill_(0, _to_device(torch.tensor(seen, dtype=torch.int64), self.device), True)

    def observe(self, pen: PenaltyRows, ids: torch.Tensor) -> None:
        """Count the tokens the penalised rows just sampled (`ids`: the batch's sampled ids, on the device)."""
        flat = pen.slots * self.vocab + ids.index_select(0, pen.rows).long()
        self.counts.view(-1).scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))

    def apply(self, x: torch.Tensor, pen: PenaltyRows) -> None:
        """vLLM's penalties on the rows of x (f32, in place): repetition on prompt + output tokens, then
        frequency and presence on output tokens."""
        counts = self.counts.index_select(0, pen.slots).float()
        seen = counts > 0
        prompt_seen = self.prompt.index_select(0, pen.slots)
        p = self.params.index_select(0, pen.slots)
        rep, freq, pres = p[:, 0:1], p[:, 1:2], p[:, 2:3]
        xr = x.index_select(0, pen.rows)
        xr = torch.where(seen | prompt_seen, torch.where(xr > 0, xr / rep, xr * rep), xr)
        xr = xr - freq * counts - pres * seen.float()
        x.index_copy_(0, pen.rows, xr)


def apply_logit_edits(logits: torch.Tensor, rows: list[SamplingRow | None],
                      penalties: PenaltyState | None = None, pen: PenaltyRows | None = None) -> torch.Tensor:
    """f32 copy of logits with logit_bias, penalties (`penalties.apply` on the rows `pen`, from
    `penalties.prepare(rows)`) and min_tokens / bad_words bans applied; `None` rows are padding."""
    x = logits.float().clone()
    B, V = x.shape
    dev = x.device
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r is not None and r.logit_bias]
    if biased:
        flat = [(i, t, v) for i, b in biased for t, v in b.items() if 0 <= t < V]
        if flat:
            bi = _to_device(torch.tensor([i for i, _, _ in flat], dtype=torch.long), dev)
            bt = _to_device(torch.tensor([t for _, t, _ in flat], dtype=torch.long), dev)
            bv = _to_device(torch.tensor([v for _, _, v in flat], dtype=torch.float32), dev)
            x.index_put_((bi, bt), bv, accumulate=True)
    if pen is not None:
        penalties.apply(x, pen)
    bans = [(i, t) for i, r in enumerate(rows) if r is not None for t in r.banned_token_ids if 0 <= t < V]
    if bans:
        t = _to_device(torch.tensor(bans, dtype=torch.long), dev)
        x[t[:, 0], t[:, 1]] = float("-inf")
    return x


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, n: int) -> list[torch.Tensor]:
    """On the device: [token ids [R], their logprobs [R], top-n logprobs [R, n], top-n ids [R, n]]
    (n = 0: the last two are empty). logits [R, V] raw."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = token_ids.long()
    chosen = lp.gather(1, ids[:, None]).squeeze(1)
    if n > 0:
        top_v, top_i = lp.topk(n, dim=-1)
    else:
        top_v, top_i = lp.new_empty(lp.shape[0], 0), ids.new_empty(lp.shape[0], 0)
    return [ids, chosen, top_v, top_i]


def logprob_dicts(parts: list[torch.Tensor], top_n: list[int]) -> list[dict[int, float]]:
    """logprob_tensors' output (on the host) -> per row {token_id: logprob}: the row's top_n[i] most
    likely tokens and the given token."""
    ids, vals, top_v, top_i = (t.tolist() for t in parts)
    out = []
    for r in range(len(ids)):
        d = {}
        tv, ti = top_v[r], top_i[r]
        for j in range(top_n[r]):
            d[ti[j]] = tv[j]
        d[ids[r]] = vals[r]
        out.append(d)
    return out


def logprobs_of(logits: torch.Tensor, token_ids: torch.Tensor, top_n: list[int]) -> list[dict[int, float]]:
    """Per row: {token_id: logprob} for the given token and the row's top_n[i] most likely tokens.

    logits [R, V] (raw), token_ids [R]. One host transfer per part for all rows."""
    if logits.shape[0] == 0:
        return []
    return logprob_dicts(logprob_tensors(logits, token_ids, max(top_n)), top_n)
