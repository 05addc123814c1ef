"""The multi-process CUDA path of tensor / expert parallelism on ONE GPU (run on the device machine:
`pytest -m gpu tests/test_tensor_parallel_gpu.py -q`; tools/gpu_tp_single.sh).

LINRNN_TP_SINGLE_DEVICE=1 puts both ranks on cuda:0 with gloo over host copies of the CUDA tensors
and CUDA graphs off (engine/multiproc_executor.py): process spawn, device selection, the rank
start-up stages, sharded dummy loading with the NVFP4 repack of sliced experts, the checked
collective warm-up, the budget exchange and the step loop all run as they do over NCCL, which alone
is left out. TP 2 and EP 2 of a 4-layer Qwen3.5-35B-A3B-shaped NVFP4 dummy decode the same greedy
streams as TP 1 (the usual single-process engine, CUDA graphs on), up to near-ties that the bf16
summation order may flip (tools/tp_compare.py: such a difference is explained when the baseline's
margin is within the logits difference), and logits within twice the noise floor: the logits change of
the single process when its embedding moves by one ulp (config tp1p). A fixed bf16 bound said little:
this random model amplifies a one-ulp change to a few 1e-2 relative by itself. Each rank's stage log
must reach "ready" (the diagnosis a hang on NCCL would rely on).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from test_engine_gpu import a3b_dir  # noqa: F401 (fixture)

pytestmark = pytest.mark.gpu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOOR_FACTOR = 2.0  # as the CPU test (test_tensor_parallel.py): 2x the measured single-process noise floor


def test_tp2_ep2_on_one_gpu_match_tp1(a3b_dir, tmp_path):  # noqa: F811
    out, dumps = tmp_path / "cmp", tmp_path / "dumps"
    env = dict(os.environ, LINRNN_TP_SINGLE_DEVICE="1", LINRNN_TP_HANG_S="90", LINRNN_TP_DUMP_DIR=str(dumps))
    cmd = [sys.executable, "-m", "tools.tp_compare", "--model", a3b_dir, "--load-format", "dummy", "--device", "cuda",
           "--configs", "tp1,tp1p,tp2,ep2", "--num-prompts", "4", "--max-tokens", "12", "--timeout", "100",
           "--check-floor", str(FLOOR_FACTOR), "--out", str(out)]
    p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        stdout, stderr = p.communicate(timeout=200)
    except subprocess.TimeoutExpired:  # SIGTERM: tp_compare ends its configuration's ranks (stacks dumped)
        p.terminate()
        stdout, stderr = p.communicate(timeout=30)
    stages = "".join(f"--- {f}\n{open(os.path.join(dumps, f)).read()}" for f in sorted(os.listdir(dumps))) \
        if dumps.exists() else "(no dump directory)"
    print("\n".join(line for line in stdout.splitlines() if line.startswith(("|", "noise floor")) or "ready in" in line))
    assert p.returncode == 0, f"{stdout[-4000:]}\n{stderr[-4000:]}\n{stages[-4000:]}"
    with open(out / "tp_compare.json") as f:
        rep = json.load(f)
    floor = rep["report"]["tp1p"]["logits_rel_max"]
    assert floor > 0, "the one-ulp perturbation did not move the logits"
    for c in ("tp2", "ep2"):
        r = rep["report"][c]
        # every stream's logits are compared at least at its first position (the prompt's last token)
        assert not r["unexplained"] and r["logits_rel_max"] <= FLOOR_FACTOR * floor, (c, r, floor)
        d = rep["describe"][c]
        assert d["tensor_parallel_size"] == 2 and d["comm_backend"] == "gloo" and d["device"] == "cuda:0"
    assert rep["describe"]["ep2"]["expert_parallel"] and not rep["describe"]["tp2"]["expert_parallel"]
    for rank in (0, 1):  # every rank logged its stages up to ready, twice (tp2, ep2)
        with open(dumps / f"rank{rank}.log") as f:
            assert f.read().count("] ready (") == 2, stages
