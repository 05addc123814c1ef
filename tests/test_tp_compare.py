"""tools/tp_compare.py's configuration names and its noise-floor perturbation (CPU)."""
import pytest
import torch

from tools.tp_compare import parse_config, perturb_one_ulp


def test_config_names():
    assert parse_config("tp2") == (2, False, False, False)
    assert parse_config("ep2e") == (2, True, True, False)
    assert parse_config("tp1p") == (1, False, False, True)
    assert parse_config("tp1pe") == (1, False, True, True)
    for bad in ("tp2p", "tp0", "tp", "xp2", "tp2x"):
        with pytest.raises(ValueError):
            parse_config(bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_perturb_moves_every_element_by_one_ulp(dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(64, 33, generator=g) * 3).to(dtype)
    w[0, :5] = torch.tensor([0.0, -0.0, float("inf"), float("nan"), 1.0])
    before = w.clone()
    perturb_one_ulp(w, seed=1)
    moved = (w.view(torch.int16).int() - before.view(torch.int16).int())
    assert torch.equal(moved[0, :4], torch.zeros(4, dtype=torch.int32))  # zeros, inf, nan untouched
    rest = moved.flatten()[4:]
    assert set(rest.unique().tolist()) == {-1, 1}  # one ulp, both directions
    assert torch.isfinite(w.flatten()[4:]).all()
    assert 0.4 < (rest > 0).float().mean() < 0.6
