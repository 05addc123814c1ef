"""Kernel benchmark registry (benchmarks/kernels/registry.py): a kernel whose correctness test is red
(or did not run) is refused and never timed; green ones are benchmarked and summarized."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from linrnn_bench.kernels import registry as R

FAKE_BENCH = """
import os, sys
out = sys.argv[sys.argv.index("--out") + 1]
os.makedirs(out, exist_ok=True)
with open(os.path.join(out, "result.md"), "w") as f:
    f.write("| fake | 1 us |\\n")
print("fake benchmark ran")
"""


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """A benchmark module `fake_kernel_bench` (importable by the subprocesses) and test files."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "fake_kernel_bench.py").write_text(FAKE_BENCH)
    monkeypatch.setenv("PYTHONPATH", str(mods) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    tests = tmp_path / "fake_tests"
    tests.mkdir()
    (tests / "test_red.py").write_text("def test_kernel_matches_reference():\n    assert 1.0 == 2.0\n")
    (tests / "test_green.py").write_text("def test_kernel_matches_reference():\n    assert 1.0 == 1.0\n")
    (tests / "test_skipped.py").write_text(
        "import pytest\n\n@pytest.mark.skip(reason='needs a GPU')\ndef test_kernel():\n    pass\n")

    def entry(name, test_file, est=(5, 5), **kw):
        return R.Entry(name, f"fake kernel {name}", ("fake peer",), "tiny", (str(tests / test_file),), None,
                       "fake_kernel_bench", ("--out", "{out}"), est_test_s=est[0], est_bench_s=est[1], marker=None,
                       **kw)

    return entry


def test_red_test_is_refused_and_not_timed(fake, tmp_path):
    results = tmp_path / "results"
    recs = R.run_registry([fake("red", "test_red.py")], str(results), timeout_factor=20, echo=False)
    (r,) = recs
    assert r["status"] == "refused"
    assert "FAILED (1 failed" in r["reason"]
    out = results / "red"
    assert (out / "test.log").exists()
    assert not (out / "bench.log").exists() and not (out / "result.md").exists()  # never timed
    summary = (results / "kernels_summary.md").read_text()
    assert "| red |" in summary and "refused" in summary
    data = json.loads((results / "kernels_summary.json").read_text())
    assert data["entries"][0]["status"] == "refused"


def test_skipped_test_is_refused(fake, tmp_path):
    (r,) = R.run_registry([fake("skipped", "test_skipped.py")], str(tmp_path), timeout_factor=20, echo=False)
    assert r["status"] == "refused" and "no test ran (1 skipped" in r["reason"]
    assert not (tmp_path / "skipped" / "result.md").exists()


def test_green_test_is_benchmarked_and_summarized(fake, tmp_path):
    recs = R.run_registry([fake("green", "test_green.py"), fake("red", "test_red.py")], str(tmp_path),
                          timeout_factor=20, echo=False)
    green, red = recs
    assert green["status"] == "ok" and green["test"]["status"] == "passed", green
    assert green["result_files"] == ["result.md"]
    assert "fake benchmark ran" in (tmp_path / "green" / "bench.log").read_text()
    assert red["status"] == "refused"
    summary = (tmp_path / "kernels_summary.md").read_text()
    assert "[result.md](green/result.md)" in summary and "passed: 1 passed" in summary


def test_max_seconds_skips_entries_that_do_not_fit(fake, tmp_path):
    recs = R.run_registry([fake("big", "test_green.py", est=(400, 400))], str(tmp_path), max_seconds=60, echo=False)
    assert recs[0]["status"] == "skipped" and "estimated 800 s" in recs[0]["reason"]
    assert not (tmp_path / "big").exists()


def test_select_rejects_unknown_names():
    assert [e.name for e in R.select(R.ENTRIES, "moe,gdn-decode")] == ["gdn-decode", "moe"]
    with pytest.raises(ValueError, match="unknown entries"):
        R.select(R.ENTRIES, "gdn-decode,nope")


def test_entries_are_well_formed():
    names = [e.name for e in R.ENTRIES]
    assert len(names) == len(set(names))
    assert {"gdn-decode", "gdn-prefill", "moe", "attention"} <= set(names)
    for e in R.ENTRIES:
        assert e.peers and e.shapes and e.estimate_s > 0
        assert any("{out}" in a for a in e.args), e.name
        assert importlib.util.find_spec(e.module) is not None, e.module
        for t in e.test:
            assert os.path.exists(os.path.join(R.REPO, t.split("::")[0])), t


def test_entry_tests_select_gpu_tests():
    """Each entry's pytest selection (-m gpu, -k) names at least one test (collection only)."""
    for e in R.ENTRIES:
        cmd = e.test_command() + ["--collect-only", "-q"]  # -qq: one "file: count" line per file
        r = subprocess.run(cmd, cwd=R.REPO, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (e.name, r.stdout[-2000:], r.stderr[-2000:])
        counts = [int(m) for m in re.findall(r"^\S+\.py: (\d+)$", r.stdout, re.M)]
        assert counts and sum(counts) > 0, (e.name, r.stdout[-1000:])


def test_cli_dry_run_prints_commands(capsys):
    from linrnn_serve.cli import main

    assert main(["bench", "kernels", "--dry-run", "--only", "moe"]) == 0
    out = capsys.readouterr().out
    assert "-m pytest" in out and "linrnn_bench.kernels.moe" in out and sys.executable in out


def test_summary_keeps_entries_of_earlier_runs(fake, tmp_path):
    R.run_registry([fake("red", "test_red.py")], str(tmp_path), timeout_factor=20, echo=False)
    R.run_registry([fake("big", "test_green.py", est=(400, 400))], str(tmp_path), max_seconds=1, echo=False)
    data = json.loads((tmp_path / "kernels_summary.json").read_text())
    assert {r["name"]: r["status"] for r in data["entries"]} == {"red": "refused", "big": "skipped"}
    assert "| red |" in (tmp_path / "kernels_summary.md").read_text()
