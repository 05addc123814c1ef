"""`linrnn-serve kl-gate` end to end on the tiny preset (CPU): the hybrid state shows in decode
scoring and not in single-prefill scoring; save / compare of the reference; files written."""
import argparse
import json
import os

import pytest

import linrnn_bench.kl_gate as kl

TEXT = os.path.join(os.path.dirname(kl.__file__), "..", "linrnn_serve", "assets", "default-model", "heldout.txt")


def _run(tmp_path, *argv):
    p = argparse.ArgumentParser()
    kl.add_arguments(p)
    args = p.parse_args(["--model", "tiny", "--device", "cpu", "--text", TEXT, "--ctx", "32,64",
                         "--max-scored", "96", "--out", str(tmp_path), *argv])
    return kl.run(args), json.load(open(tmp_path / "kl_gate.json"))


def test_bf16_state_shows_only_when_decoding(tmp_path):
    status, rep = _run(tmp_path / "d", "--ref", "ssm-bf16-tau=inf", "--test", "ssm-bf16-tau=0")
    kld = [r["mean_kld"] for r in rep["runs"][0].values()]
    assert all(k > 0 for k in kld)  # every head's state rounded to bf16 after each token
    status, rep = _run(tmp_path / "p", "--ref", "ssm-bf16-tau=inf", "--test", "ssm-bf16-tau=0",
                       "--scoring", "prefill")
    assert all(r["mean_kld"] == 0.0 for r in rep["runs"][0].values())  # state stays f32 inside prefill
    assert status == 0 and (tmp_path / "p" / "kl_gate.png").exists() and (tmp_path / "p" / "kl_gate.md").exists()


def test_identical_configs_pass_and_saved_reference_round_trips(tmp_path):
    ref = tmp_path / "ref.pt"
    status, rep = _run(tmp_path / "a", "--ref", "ssm-bf16-tau=inf", "--test", "ssm-bf16-tau=inf",
                       "--save-ref", str(ref))
    assert status == 0 and rep["pass"] and ref.exists()
    assert all(r["mean_kld"] == 0.0 and r["same_top_p"] == 1.0 for r in rep["runs"][0].values())
    status, rep = _run(tmp_path / "b", "--compare-ref", str(ref), "--test", "ssm-bf16-tau=0")
    assert all(r["mean_kld"] > 0 for r in rep["runs"][0].values())


def test_tau_sweep_reports_fraction_bytes_and_pick(tmp_path):
    status, rep = _run(tmp_path, "--sweep-tau", "0,inf", "--ctx", "32", "--max-mean-kld", "1.0",
                       "--min-same-top-p", "0.0")
    rows = {r["tau"]: r for r in rep["sweep"]}
    assert rows[0.0]["f32_fraction"] == 0.0 and rows[float("inf")]["f32_fraction"] == 1.0
    assert rows[0.0]["state_bytes_per_seq"] < rows[float("inf")]["state_bytes_per_seq"]
    assert rep["picked_tau"] == 0.0  # both pass the loose gate: the smaller f32 fraction wins
    assert (tmp_path / "kl_tau_sweep.png").exists()


def test_bad_configuration_key():
    with pytest.raises(SystemExit, match="unknown configuration key"):
        kl.parse_config("foo=1", kl.RunConfig(model="tiny"))
