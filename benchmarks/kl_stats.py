"""KL-gate statistics, following llama.cpp's `llama-perplexity --kl-divergence` (BENCH.md "KL gate").

Inputs are per-position log-probabilities over the full vocabulary of a reference and a test
configuration on the same tokens. Per scored position i with next token y_i:
  KLD_i      = sum_v p_ref(v) (log p_ref(v) - log p_test(v))        (KL(ref || test), nats)
  same_top_i = [argmax p_ref == argmax p_test]
  dp_i       = p_test(y_i) - p_ref(y_i)
  nll_i      = -log p(y_i)  (for each configuration's perplexity)
Reported: mean KLD +- standard error (std / sqrt(N)), 99.0 / 99.9 percentiles and max, same-top-p
+- s.e. (binomial sqrt(p(1-p)/N)), RMS delta-p, and PPL = exp(mean nll) of both.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class KLAccumulator:
    """Streams per-position values so long texts never hold all log-probs at once."""

    kld: list[float] = field(default_factory=list)
    same_top: list[bool] = field(default_factory=list)
    dp: list[float] = field(default_factory=list)
    nll_ref: list[float] = field(default_factory=list)
    nll_test: list[float] = field(default_factory=list)

    def add(self, logp_ref: torch.Tensor, logp_test: torch.Tensor, targets: torch.Tensor) -> None:
        """logp_* [N, V] log-probabilities (log_softmax of logits), targets [N] next tokens."""
        lr, lt = logp_ref.double(), logp_test.double()
        pr = lr.exp()
        # 0 * (-inf) terms (p_ref = 0) contribute nothing
        kld = torch.where(pr > 0, pr * (lr - lt), torch.zeros_like(pr)).sum(-1)
        t = targets.long()[:, None]
        self.kld += kld.tolist()
        self.same_top += (lr.argmax(-1) == lt.argmax(-1)).tolist()
        self.dp += (lt.gather(1, t).exp() - lr.gather(1, t).exp()).squeeze(1).tolist()
        self.nll_ref += (-lr.gather(1, t)).squeeze(1).tolist()
        self.nll_test += (-lt.gather(1, t)).squeeze(1).tolist()

    def result(self) -> "KLResult":
        return KLResult.from_values(self.kld, self.same_top, self.dp, self.nll_ref, self.nll_test)


@dataclass
class KLResult:
    n: int
    mean_kld: float
    mean_kld_se: float
    kld_p99: float
    kld_p999: float
    kld_max: float
    same_top_p: float  # fraction in [0, 1]
    same_top_p_se: float
    rms_dp: float
    ppl_ref: float
    ppl_test: float

    @classmethod
    def from_values(cls, kld, same_top, dp, nll_ref, nll_test) -> "KLResult":
        n = len(kld)
        if n == 0:
            raise ValueError("no scored positions (text shorter than one context?)")
        k = torch.tensor(kld, dtype=torch.float64)
        mean = k.mean().item()
        se = (k.std(unbiased=True).item() / math.sqrt(n)) if n > 1 else float("nan")
        p = sum(same_top) / n
        return cls(
            n=n, mean_kld=mean, mean_kld_se=se,
            kld_p99=percentile(kld, 99.0), kld_p999=percentile(kld, 99.9), kld_max=k.max().item(),
            same_top_p=p, same_top_p_se=math.sqrt(p * (1 - p) / n),
            rms_dp=math.sqrt(sum(d * d for d in dp) / n),
            ppl_ref=math.exp(sum(nll_ref) / n), ppl_test=math.exp(sum(nll_test) / n),
        )

    def passes(self, max_mean_kld: float, min_same_top_p: float) -> bool:
        return self.mean_kld < max_mean_kld and self.same_top_p >= min_same_top_p

    def to_dict(self) -> dict:
        return asdict(self)


def percentile(values, q: float) -> float:
    """Linear-interpolated percentile (numpy's default method) of a list."""
    v = sorted(values)
    if not v:
        return float("nan")
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def scored_positions(n_ctx: int) -> tuple[int, int]:
    """llama-perplexity scores the second half of each chunk: logits at positions
    [n_ctx/2, n_ctx - 1) predict tokens [n_ctx/2 + 1, n_ctx)."""
    first = n_ctx // 2
    return first, n_ctx - 1


def chunks(tokens: list[int], n_ctx: int) -> list[list[int]]:
    """Non-overlapping chunks of exactly n_ctx tokens (the remainder is dropped, as llama.cpp)."""
    return [tokens[i: i + n_ctx] for i in range(0, len(tokens) - n_ctx + 1, n_ctx)]
