"""Sampler (runner/sampler.py) against exact distributions: with the inverse-CDF draw, a uniform grid
of u values reproduces the target distribution up to 1/N, so the checks are tight."""
from __future__ import annotations

import pytest
import torch

from linrnn_serve.runner import sampler as S
from linrnn_serve.runner.plan import SamplingRow, uniform_for

V = 64


def tensors(rows, device="cpu", u=None):
    t = S.SamplingTensors.from_rows(rows, device)
    if u is not None:  # explicit uniforms instead of the rows' seeded ones
        t.u = torch.tensor(u, dtype=torch.float64)
    return t


def grid_freqs(logits_row: torch.Tensor, N: int = 4000, **kw) -> torch.Tensor:
    """Empirical token frequencies of one row over u = (i + 0.5) / N."""
    rows = [SamplingRow(0, **kw)] * N
    ids = S.sample(logits_row.expand(N, -1), tensors(rows, u=[(i + 0.5) / N for i in range(N)]),
                   use_sort=SamplingRow(0, **kw).needs_sort)
    return torch.bincount(ids, minlength=logits_row.numel()).double() / N


@pytest.fixture
def logits():
    g = torch.Generator().manual_seed(0)
    return torch.randn(V, generator=g) * 2


def test_greedy_is_argmax(logits):
    x = torch.randn(5, V)
    rows = [SamplingRow(i, temperature=0.0) for i in range(5)]
    assert torch.equal(S.sample(x, tensors(rows), False), x.argmax(-1))
    assert torch.equal(S.sample(x, tensors(rows), True), x.argmax(-1))
    assert torch.equal(S.greedy(x), x.argmax(-1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_temperature_distribution(logits, temperature):
    f = grid_freqs(logits, temperature=temperature)
    p = torch.softmax(logits.double() / temperature, -1)
    assert (f - p).abs().max() < 2e-3


def test_top_k(logits):
    f = grid_freqs(logits, temperature=1.0, top_k=5)
    top = logits.topk(5).indices
    p = torch.zeros(V, dtype=torch.float64)
    p[top] = torch.softmax(logits[top].double(), -1)
    assert (f - p).abs().max() < 2e-3
    assert f[[i for i in range(V) if i not in top.tolist()]].sum() == 0


def test_top_p(logits):
    f = grid_freqs(logits, temperature=1.0, top_p=0.8)
    p = torch.softmax(logits.double(), -1)
    ps, order = p.sort(descending=True)
    keep = (ps.cumsum(0) - ps) < 0.8
    want = torch.zeros(V, dtype=torch.float64)
    want[order[keep]] = ps[keep] / ps[keep].sum()
    assert (f - want).abs().max() < 2e-3


def test_top_k_then_top_p(logits):
    f = grid_freqs(logits, temperature=0.8, top_k=10, top_p=0.6)
    p = torch.softmax(logits.double() / 0.8, -1)
    ps, order = p.sort(descending=True)
    ps, order = ps[:10] / ps[:10].sum(), order[:10]
    keep = (ps.cumsum(0) - ps) < 0.6
    want = torch.zeros(V, dtype=torch.float64)
    want[order[keep]] = ps[keep] / ps[keep].sum()
    assert (f - want).abs().max() < 2e-3


def test_min_p(logits):
    f = grid_freqs(logits, temperature=1.0, min_p=0.1)
    p = torch.softmax(logits.double(), -1)
    keep = p >= 0.1 * p.max()
    want = torch.where(keep, p, 0.0)
    want /= want.sum()
    assert (f - want).abs().max() < 2e-3


def test_rows_are_independent_of_the_batch():
    """A row's token depends only on its logits, params and u: not on its row or neighbours."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(9, V, generator=g)
    rows = [SamplingRow(i, temperature=[0.0, 0.7, 1.0][i % 3], top_k=[0, 7][i % 2], top_p=[1.0, 0.9][i % 2],
                        min_p=0.02 * (i % 2), seed=i, out_index=3) for i in range(9)]
    batch = S.sample(x, tensors(rows), True)
    for i in range(9):
        perm = torch.tensor([i] + [j for j in range(9) if j != i])
        alone = S.sample(x[i:i + 1], tensors([rows[i]]), True)
        shuffled = S.sample(x[perm], tensors([rows[j] for j in perm.tolist()]), True)
        assert alone.item() == batch[i].item() == shuffled[0].item()
    # the sort variant draws the same tokens as the plain one for rows that need no sort
    plain = [SamplingRow(i, temperature=1.0, seed=i, out_index=0) for i in range(9)]
    assert torch.equal(S.sample(x, tensors(plain), False), S.sample(x, tensors(plain), True))


def test_device_uniform_matches_the_python_reference():
    """sampler.uniform (int64 tensors, in the decode graph) == plan.uniform_for bit for bit, for 64-bit
    seeds (the high bit set too) and output positions up to 2**31."""
    import random

    from linrnn_serve.runner.plan import sample_seed

    rng = random.Random(7)
    seeds = [sample_seed(rng.getrandbits(63), i % 4) for i in range(500)] + [0, 1, (1 << 64) - 1, 1 << 63]
    idx = [rng.randrange(0, 1 << 31) for _ in range(500)] + [0, 1, 2, 3]
    got = S.uniform(torch.tensor([S._i64(s) for s in seeds]), torch.tensor(idx)).tolist()
    assert got == [uniform_for(s, i) for s, i in zip(seeds, idx)]
    assert len({round(u, 9) for u in got}) == len(got) and all(0 < u < 1 for u in got)
    # from_rows draws the same
    rows = [SamplingRow(0, temperature=1.0, seed=s, out_index=i) for s, i in zip(seeds[:20], idx[:20])]
    assert tensors(rows).u.tolist() == got[:20]


def edit(x, rows, state=None):
    """apply_logit_edits with a penalty state (built from the rows' lists, as the runner does)."""
    state = state or S.PenaltyState(4, x.shape[1], x.device)
    return S.apply_logit_edits(x, rows, state, state.prepare(rows))


def reference_penalties(x: torch.Tensor, out_ids: list[int], prompt_ids: list[int], rep: float, freq: float,
                        pres: float) -> torch.Tensor:
    """vLLM's formula from the token lists, one row."""
    want = x.clone()
    counts = torch.bincount(torch.tensor(out_ids, dtype=torch.long), minlength=x.numel()).float()
    for t in set(out_ids) | (set(prompt_ids) if rep != 1.0 else set()):
        want[t] = want[t] / rep if want[t] > 0 else want[t] * rep
    return want - freq * counts - pres * (counts > 0).float()


def test_penalties_match_formula():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, V, generator=g)
    out_ids, prompt_ids = [1, 1, 2, 5], [5, 6, 7]
    rows = [SamplingRow(0, slot=3, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3,
                        output_token_ids=out_ids, prompt_token_ids=prompt_ids),
            None,
            SamplingRow(2, banned_token_ids=[3, 4])]
    y = edit(x, rows)
    assert torch.allclose(y[0], reference_penalties(x[0], out_ids, prompt_ids, 1.3, 0.3, 0.5))
    assert torch.equal(y[1], x[1])  # untouched rows are bit-identical
    assert torch.isinf(y[2, [3, 4]]).all() and torch.equal(y[2, 5:], x[2, 5:])
    assert not S.needs_logit_edits([SamplingRow(0), None])
    assert S.needs_logit_edits([rows[2]])


def test_penalty_state_is_incremental_and_rebuilt_per_slot():
    """The device statistics follow the sampled tokens step by step (no lists after the first row), a
    slot taken over by another sequence (or the same one after preemption) is rebuilt from its lists, and
    every step equals the formula on the full lists."""
    g = torch.Generator().manual_seed(5)
    state = S.PenaltyState(3, V, "cpu")
    prompts = {7: [3, 4, 4, 9], 8: [1, 2]}
    outs = {7: [], 8: [5, 5]}
    params = {7: (1.4, 0.2, 0.3), 8: (1.0, -0.5, 0.7)}
    slots = {7: 1, 8: 2}

    def row(sid, first):
        rep, freq, pres = params[sid]
        return SamplingRow(sid, slot=slots[sid], repetition_penalty=rep, frequency_penalty=freq, presence_penalty=pres,
                           output_token_ids=list(outs[sid]) if first else None,
                           prompt_token_ids=prompts[sid] if first else None)

    first = {7: True, 8: True}
    for step in range(12):
        if step == 6:  # sequence 8 preempted and re-admitted into slot 0; 7 moves to 8's old slot
            slots[8], slots[7] = 0, 2
            first = {7: True, 8: True}
        rows = [row(7, first[7]), None, row(8, first[8])]
        first = {7: False, 8: False}
        x = torch.randn(3, V, generator=g)
        pen = state.prepare(rows)
        y = S.apply_logit_edits(x, rows, state, pen)
        for i, sid in ((0, 7), (2, 8)):
            assert torch.allclose(y[i], reference_penalties(x[i], outs[sid], prompts[sid], *params[sid]), atol=1e-6)
        ids = torch.randint(0, V, (3,), generator=g)
        state.observe(pen, ids)
        outs[7].append(int(ids[0]))
        outs[8].append(int(ids[2]))
    # a row without lists in a slot that holds another sequence's statistics is a bookkeeping error
    with pytest.raises(RuntimeError, match="penalty state of slot"):
        state.prepare([SamplingRow(99, slot=1, presence_penalty=0.1)])


def test_logit_bias_comes_before_the_penalties():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, V, generator=g)
    bias = {4: 2.5, 9: -100.0, V + 3: 7.0}  # an id past the logits row (a padded vocab) is ignored
    rows = [SamplingRow(0, logit_bias=bias), None,
            SamplingRow(2, logit_bias={4: 1.5}, repetition_penalty=1.5, output_token_ids=[4], prompt_token_ids=[])]
    assert S.needs_logit_edits([rows[0]]) and S.needs_logit_edits([rows[2]])
    y = edit(x, rows)
    want = x[0].clone()
    want[4] += 2.5
    want[9] -= 100.0
    assert torch.equal(y[0], want) and torch.equal(y[1], x[1])
    b = x[2, 4] + 1.5
    assert torch.allclose(y[2, 4], b / 1.5 if b > 0 else b * 1.5)  # vLLM order: bias, then penalties
    assert torch.equal(y[2, 5:], x[2, 5:])


def test_logprobs_of():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, V, generator=g)
    ids = torch.tensor([0, 5, 9, 63])
    out = S.logprobs_of(x, ids, [0, 1, 3, 20])
    lp = torch.log_softmax(x, -1)
    for r in range(4):
        assert out[r][ids[r].item()] == pytest.approx(lp[r, ids[r]].item(), abs=1e-6)
        top = lp[r].topk(max(1, [0, 1, 3, 20][r])).indices.tolist()[: [0, 1, 3, 20][r]]
        assert set(top) <= set(out[r])
        assert len(out[r]) <= [0, 1, 3, 20][r] + 1
