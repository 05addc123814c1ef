"""User errors of the console script's subcommands (issue #18): one line on stderr, exit status 2
(or 1 for a benchmark's own refusal), never a traceback; and benchmark results written whether or
not the optional matplotlib is installed (its absence simulated with a `sys.modules` None entry in
a subprocess)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import make_hf_checkpoint

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "linrnn_serve" / "assets" / "default-model"
HELDOUT = DEFAULT_MODEL / "heldout.txt"
NO_MATPLOTLIB = "import sys; sys.modules['matplotlib'] = None; "


def cli(*argv: str, hide_matplotlib: bool = False, cwd=None) -> subprocess.CompletedProcess:
    code = (NO_MATPLOTLIB if hide_matplotlib else "") + \
        "import sys; from linrnn_serve.cli import main; sys.exit(main(sys.argv[1:]))"
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300,
                          env=env, cwd=cwd)


def assert_one_line_error(r: subprocess.CompletedProcess, codes: tuple[int, ...], *needles: str) -> None:
    assert r.returncode in codes, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, r.stderr[-3000:]
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    import torch

    return make_hf_checkpoint(tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16)


# ---- quantize -------------------------------------------------------------------------------------------
def test_quantize_existing_output_dir(bf16_ckpt, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    r = cli("quantize", "--in", str(bf16_ckpt), "--out", str(out), "--format", "modelopt", "--no-progress")
    assert_one_line_error(r, (2,), "output directory exists", "--overwrite")
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("src", ["default", str(DEFAULT_MODEL)])
def test_quantize_already_quantized_input_incl_embedded_default(src, tmp_path):
    r = cli("quantize", "--in", src, "--out", str(tmp_path / "out"), "--format", "modelopt", "--no-progress")
    assert_one_line_error(r, (2,), "already quantized")
    assert not (tmp_path / "out").exists()


def test_quantize_missing_input(tmp_path):
    r = cli("quantize", "--in", str(tmp_path / "nope"), "--out", str(tmp_path / "out"), "--format", "modelopt")
    assert_one_line_error(r, (2,), "no such checkpoint directory")
    r = cli("quantize", "--in", "tiny", "--out", str(tmp_path / "out"), "--format", "modelopt")
    assert_one_line_error(r, (2,), "preset name")
    (tmp_path / "empty").mkdir()
    r = cli("quantize", "--in", str(tmp_path / "empty"), "--out", str(tmp_path / "out"), "--format", "modelopt")
    assert_one_line_error(r, (2,), "no config.json")
    assert not (tmp_path / "out").exists()


# ---- kl-gate and bench --------------------------------------------------------------------------------------
def test_kl_gate_user_errors(tmp_path):
    r = cli("kl-gate", "--model", str(tmp_path / "nope"), "--test", "ssm-bf16-tau=0")
    assert_one_line_error(r, (1, 2), "no such checkpoint directory")
    r = cli("kl-gate", "--model", "tiny", "--test", "bogus=1")
    assert_one_line_error(r, (1, 2), "unknown configuration key")
    r = cli("kl-gate", "--model", "tiny", "--device", "cpu")
    assert_one_line_error(r, (1, 2), "give --test")
    r = cli("kl-gate", "--model", "tiny", "--device", "cpu", "--test", "ssm-bf16-tau=0", "--text",
            str(tmp_path / "missing.txt"))
    assert_one_line_error(r, (1, 2), "missing.txt")


def test_bench_user_errors(tmp_path):
    r = cli("bench", "batched", "--model", "tiny", "--npl", "1,x")
    assert_one_line_error(r, (1, 2), "--npl must be a comma list")
    r = cli("bench", "batched", "--model", "tiny", "--npl", "1,4", "--max-num-seqs", "2")
    assert_one_line_error(r, (1, 2), "--max-num-seqs 2 is smaller")
    r = cli("bench", "batched", "--config", "model=tiny,bogus=1")
    assert_one_line_error(r, (1, 2), "unknown key")
    r = cli("bench", "serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--max-concurrency", "0")
    assert_one_line_error(r, (1, 2), "--max-concurrency values must be >= 1")
    r = cli("bench", "serve", "--base-url", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert_one_line_error(r, (1, 2), "cannot reach http://127.0.0.1:9")


@pytest.mark.parametrize("have_matplotlib", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_kl_gate_out_writes_tables_with_and_without_matplotlib(tmp_path, have_matplotlib):
    if have_matplotlib:
        pytest.importorskip("matplotlib")
    out = tmp_path / "kl"
    r = cli("kl-gate", "--model", "tiny", "--device", "cpu", "--text", str(HELDOUT), "--ctx", "32",
            "--max-scored", "32", "--test", "ssm-bf16-tau=0", "--max-mean-kld", "1", "--min-same-top-p", "0",
            "--out", str(out), hide_matplotlib=not have_matplotlib)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert json.loads((out / "kl_gate.json").read_text())["pass"] is True
    assert "| n_ctx |" in (out / "kl_gate.md").read_text()
    assert (out / "kl_gate.png").exists() == have_matplotlib
    notices = [ln for ln in r.stderr.splitlines() if "matplotlib is not installed" in ln]
    assert len(notices) == (0 if have_matplotlib else 1), r.stderr


@pytest.mark.parametrize("have_matplotlib", [True, False], ids=["matplotlib", "no-matplotlib"])
def test_bench_batched_out_writes_tables_with_and_without_matplotlib(tmp_path, have_matplotlib):
    if have_matplotlib:
        pytest.importorskip("matplotlib")
    out = tmp_path / "b"
    r = cli("bench", "batched", "--model", "tiny", "--npp", "8", "--ntg", "2", "--npl", "1", "--warmup-steps", "0",
            "--no-progress", "--out", str(out), hide_matplotlib=not have_matplotlib)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    assert json.loads((out / "batched.json").read_text())["configs"][0]["rows"]
    assert "S_TG" in (out / "batched.md").read_text()
    assert (out / "batched.png").exists() == have_matplotlib
    notices = [ln for ln in r.stderr.splitlines() if "matplotlib is not installed" in ln]
    assert len(notices) == (0 if have_matplotlib else 1), r.stderr
