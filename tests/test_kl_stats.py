"""KL-gate statistics against hand-computed values (issue #7)."""
import math

import pytest
import torch

from linrnn_bench.kl_stats import KLAccumulator, chunks, percentile, scored_positions


def logp(rows):
    return torch.tensor(rows, dtype=torch.float64).log()


def test_two_positions_by_hand():
    # position 0: ref (0.5, 0.5), test (0.9, 0.1), next token 1
    # position 1: ref (0.2, 0.8), test (0.2, 0.8), next token 1
    acc = KLAccumulator()
    acc.add(logp([[0.5, 0.5], [0.2, 0.8]]), logp([[0.9, 0.1], [0.2, 0.8]]), torch.tensor([1, 1]))
    r = acc.result()
    kld0 = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)  # 0.5108256
    assert r.n == 2
    assert r.mean_kld == pytest.approx(kld0 / 2, rel=1e-9)
    # sample std of (kld0, 0) is kld0 / sqrt(2); s.e. = std / sqrt(2) = kld0 / 2
    assert r.mean_kld_se == pytest.approx(kld0 / 2, rel=1e-9)
    assert r.kld_max == pytest.approx(kld0) and r.kld_p99 == pytest.approx(0.99 * kld0)
    # argmax: position 0 ties in ref -> index 0 (first max) vs 0 in test: same; position 1 same
    assert r.same_top_p == 1.0 and r.same_top_p_se == 0.0
    # delta-p of the actual token: (0.1 - 0.5, 0.8 - 0.8)
    assert r.rms_dp == pytest.approx(math.sqrt((0.4 ** 2 + 0) / 2))
    assert r.ppl_ref == pytest.approx(math.exp((-math.log(0.5) - math.log(0.8)) / 2))
    assert r.ppl_test == pytest.approx(math.exp((-math.log(0.1) - math.log(0.8)) / 2))


def test_same_top_p_and_its_error():
    acc = KLAccumulator()
    ref = [[0.7, 0.2, 0.1]] * 4
    test = [[0.6, 0.3, 0.1]] * 3 + [[0.3, 0.6, 0.1]]
    acc.add(logp(ref), logp(test), torch.tensor([0, 0, 0, 0]))
    r = acc.result()
    assert r.same_top_p == 0.75
    assert r.same_top_p_se == pytest.approx(math.sqrt(0.75 * 0.25 / 4))


def test_identical_distributions_give_zero():
    acc = KLAccumulator()
    lp = torch.log_softmax(torch.randn(50, 11, dtype=torch.float64), -1)
    acc.add(lp, lp.clone(), torch.randint(0, 11, (50,)))
    r = acc.result()
    assert r.mean_kld == 0.0 and r.same_top_p == 1.0 and r.rms_dp == 0.0 and r.ppl_ref == r.ppl_test
    assert r.passes(1e-3, 0.995)


def test_zero_reference_probability_contributes_nothing():
    acc = KLAccumulator()
    acc.add(logp([[1.0, 0.0]]), logp([[0.5, 0.5]]), torch.tensor([0]))
    assert acc.result().mean_kld == pytest.approx(math.log(2.0))


def test_percentile_linear_interpolation():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(1001)), 99.9) == pytest.approx(999.0)


def test_chunking_and_scored_range():
    assert chunks(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert scored_positions(512) == (256, 511)  # 255 predictions per chunk
