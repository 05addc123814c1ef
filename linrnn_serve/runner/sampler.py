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
bad_words) change the logits first; they need per-sequence token lists, so they run eagerly (`apply_logit_edits`), only
for batches that have such a row. Rows without edits are bit-unchanged by it.

Logprobs are those of the raw model distribution (vLLM's default `raw_logprobs`): log_softmax of
the unprocessed logits, the sampled token's value and the top-N alternatives.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


def _to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host -> device without a host sync on CUDA (through pinned memory)."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


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


def apply_logit_edits(logits: torch.Tensor, rows: list[SamplingRow | None]) -> torch.Tensor:
    """f32 copy of logits with logit_bias, penalties (vLLM order: bias, repetition on prompt+output
    tokens, then frequency and presence on output tokens) and min_tokens / bad_words bans applied;
    `None` rows are padding."""
    x = logits.float().clone()
    B, V = x.shape
    dev = x.device
    biased = [(i, r.logit_bias) for i, r in enumerate(rows) if r is not None and r.logit_bias]
    if biased:
        bi = torch.tensor([i for i, b in biased for _ in b], dtype=torch.long)
        bt = torch.tensor([t for _, b in biased for t in b], dtype=torch.long)
        bv = torch.tensor([v for _, b in biased for v in b.values()], dtype=torch.float32)
        keep = bt < V
        x.index_put_((bi[keep].to(dev), bt[keep].to(dev)), bv[keep].to(dev), accumulate=True)
    pen = [i for i, r in enumerate(rows) if r is not None and (
        r.presence_penalty or r.frequency_penalty or r.repetition_penalty != 1.0)]
    if pen:
        ri, ti = _flat([rows[i].output_token_ids or [] for i in pen])
        counts = torch.zeros(len(pen), V, dtype=torch.float32, device=dev)
        counts.index_put_((ri.to(dev), ti.to(dev)), torch.ones(ri.numel(), device=dev), accumulate=True)
        seen = counts > 0
        pi, pt = _flat([rows[i].prompt_token_ids or [] for i in pen])
        prompt_seen = torch.zeros(len(pen), V, dtype=torch.bool, device=dev)
        prompt_seen[pi.to(dev), pt.to(dev)] = True
        rep = torch.tensor([rows[i].repetition_penalty for i in pen], dtype=torch.float32, device=dev)[:, None]
        freq = torch.tensor([rows[i].frequency_penalty for i in pen], dtype=torch.float32, device=dev)[:, None]
        pres = torch.tensor([rows[i].presence_penalty for i in pen], dtype=torch.float32, device=dev)[:, None]
        idx = torch.tensor(pen, device=dev)
        xr = x.index_select(0, idx)
        xr = torch.where(seen | prompt_seen, torch.where(xr > 0, xr / rep, xr * rep), xr)
        xr = xr - freq * counts - pres * seen.float()
        x.index_copy_(0, idx, xr)
    bi, bt = _flat([(r.banned_token_ids if r is not None else []) for r in rows])
    if bi.numel():
        keep = bt < V
        x[bi[keep].to(dev), bt[keep].to(dev)] = float("-inf")
    return x


def _flat(lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [i for i, lst in enumerate(lists) for _ in lst]
    vals = [v for lst in lists for v in lst]
    return torch.tensor(rows, dtype=torch.long), torch.tensor(vals, dtype=torch.long)


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
