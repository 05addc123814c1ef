"""`linrnn-serve bench kernels`: the kernel benchmark registry (BENCH.md "Kernel benchmarks").

Each entry names the kernel, its peer(s), the shapes, its correctness test (pytest targets and a -k
expression, run with `-m gpu`) and its benchmark command (a module run with `python -m`, `{out}` in
its arguments standing for the entry's results directory). For every selected entry the runner

  1. runs the correctness test in a subprocess; unless at least one test ran and none failed or
     errored (all skipped, e.g. without a GPU, does not count) the kernel is REFUSED: not timed;
  2. runs the benchmark in a subprocess, its output teed to <results>/<entry>/bench.log, and kills
     it after --timeout-factor x its time estimate;
  3. writes <results>/kernels_summary.{md,json}: kernel, test status, benchmark status, time,
     result files (after every entry; entries of an earlier run into the same directory are kept,
     so several device calls with --only build one summary).

--only picks entries; --max-seconds skips entries whose estimate (test + benchmark) no longer fits in
the time left; --list / --dry-run print the entries / commands. The estimates are guesses for an
H100/H200 with a cold Triton cache; the summary JSON records the real times (update the estimates
from it). Tests run with 4 pytest-xdist workers when xdist is installed (--test-workers).

    linrnn-serve bench kernels                       # everything
    linrnn-serve bench kernels --only gdn-decode,moe --max-seconds 540
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))  # through symlinks
DEFAULT_RESULTS = os.path.join(REPO, "benchmarks", "results")
LOG_FILES = ("test.log", "test.xml", "bench.log")


@dataclass(frozen=True)
class Entry:
    name: str  # results go to <results>/<name>/
    kernel: str  # what is timed
    peers: tuple[str, ...]
    shapes: str
    test: tuple[str, ...]  # pytest targets (files or node ids), relative to the repository root
    test_k: str | None  # pytest -k expression (None: every selected test in the targets)
    module: str  # benchmark module, run as `python -m module *args`
    args: tuple[str, ...] = ()  # "{out}" -> the entry's results directory
    est_test_s: int = 60
    est_bench_s: int = 120
    marker: str | None = "gpu"  # pytest -m expression

    @property
    def estimate_s(self) -> int:
        return self.est_test_s + self.est_bench_s

    def test_command(self, python: str = sys.executable, junit: str | None = None, workers: int = 0) -> list[str]:
        cmd = [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *self.test]
        if workers > 1:  # pytest-xdist: Triton compilation of the test shapes in parallel
            cmd += ["-n", str(workers)]
        if self.marker:
            cmd += ["-m", self.marker]
        if self.test_k:
            cmd += ["-k", self.test_k]
        if junit:
            cmd += [f"--junitxml={junit}"]
        return cmd

    def bench_command(self, out: str, python: str = sys.executable) -> list[str]:
        return [python, "-m", self.module, *(a.replace("{out}", out) for a in self.args)]


SHAPES_GDN = "Qwen3.5-35B-A3B GDN layer: Hk 16, Hv 32, Dk = Dv 128, conv_dim 8192, bf16 activations"
ENTRIES: list[Entry] = [
    Entry("gdn-decode", "GDN fused recurrent decode (hybrid f32/bf16 state pool) + conv decode",
          ("fla-core fused_recurrent_gated_delta_rule (f32 state)",),
          SHAPES_GDN + "; B in 1, 8, 32, 64, 128, 256; all-f32, all-bf16, 30 % / 50 % f32 heads",
          ("tests/test_gdn_kernels.py",), "gpu_decode or gpu_conv",
          "linrnn_bench.kernels.gdn", ("--prefill", "", "--out", "{out}"), est_test_s=90, est_bench_s=240),
    Entry("gdn-prefill", "GDN chunked varlen prefill (bf16 / tf32 matmuls) + varlen conv",
          ("fla-core chunk_gated_delta_rule (cu_seqlens varlen)",),
          SHAPES_GDN + "; BxL 1x8192, 4x2048, 64x512",
          ("tests/test_gdn_kernels.py",), "gpu_prefill or gpu_conv",
          "linrnn_bench.kernels.gdn", ("--batches", "", "--out", "{out}"), est_test_s=150, est_bench_s=300),
    Entry("moe", "NVFP4 MoE layer (route, align, grouped GEMM gate_up, SiLU*mul, grouped GEMM down, combine)",
          ("bf16 torch._grouped_mm layer", "dequantize-then-bf16 grouped_mm baseline"),
          "one Qwen3.5-35B-A3B MoE layer: E 256, top-8, H 2048, I 512; B in 1, 8, 32, 64, 128, 256; "
          "realistic routing",
          ("tests/test_moe_kernels.py",), None,
          "linrnn_bench.kernels.moe", ("--out", "{out}"), est_test_s=120, est_bench_s=180),
    Entry("gemv", "skinny GEMM / split-K GEMV (+ fused router) vs cuBLAS on the model's dense decode projections",
          ("cuBLAS (F.linear)",),
          "Qwen3.5-35B-A3B dense projections (GDN in/out, attention qkv/o, shared expert, router, lm_head); "
          "M in 1, 2, 4, 8, 16, 32",
          ("tests/test_gemv_kernels.py",), "gpu",
          "linrnn_bench.kernels.gemv", ("--out", "{out}"), est_test_s=60, est_bench_s=150),
    Entry("attention", "paged attention: split-K decode and varlen causal prefill (+ KV write)",
          ("torch SDPA (prefill, K/V expanded, contiguous)",),
          "Qwen3.5-35B-A3B attention: Hq 16, Hkv 2, D 256, block 16, bf16; decode B in 1..128 x context "
          "256, 2048, 8192; prefill 1x8192, 8x1024",
          ("tests/test_attention_kernels.py",), None,
          "linrnn_bench.kernels.attention", ("--out", "{out}/attention_kernels"), est_test_s=60, est_bench_s=150),
]


# ---- subprocess plumbing --------------------------------------------------------------------------

def run_logged(cmd: list[str], log_path: str, timeout: float | None, echo: bool, cwd: str = REPO) -> tuple[int, bool]:
    """Run `cmd` with stdout+stderr teed to `log_path` (and to our stdout when echo). Returns
    (returncode, timed_out); on timeout the child's whole process group is killed."""
    with open(log_path, "w") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                errors="replace", start_new_session=True)

        def pump():
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if echo:
                    sys.stdout.write("    " + line)
                    sys.stdout.flush()

        reader = threading.Thread(target=pump, daemon=True)
        reader.start()
        timed_out = False
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill(proc)
        except BaseException:  # SIGTERM (see run) or Ctrl-C: do not leave the child running
            _kill(proc)
            raise
        reader.join(timeout=10)
        if timed_out:
            log.write(f"\n[registry] killed after {timeout:.0f} s\n")
    return proc.returncode, timed_out


def _kill(proc: subprocess.Popen) -> None:
    """Kill our child's process group (it runs in its own session: start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def junit_counts(path: str) -> dict[str, int] | None:
    """tests / failures / errors / skipped / passed from a pytest --junitxml file (None if unreadable)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return None
    suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
    c = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    c["passed"] = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
    return c


def run_test(entry: Entry, out: str, python: str, timeout: float | None, echo: bool, workers: int = 0) -> dict:
    """The entry's correctness test -> {"status": "passed" | why not, counts, seconds}."""
    missing = [t for t in entry.test if not os.path.exists(os.path.join(REPO, t.split("::")[0]))]
    if missing:
        return {"status": f"test file missing: {', '.join(missing)}", "seconds": 0.0}
    junit = os.path.join(out, "test.xml")
    if os.path.exists(junit):
        os.remove(junit)
    t0 = time.monotonic()
    rc, timed_out = run_logged(entry.test_command(python, junit, workers), os.path.join(out, "test.log"), timeout,
                               echo)
    res = {"returncode": rc, "seconds": time.monotonic() - t0}
    counts = junit_counts(junit)
    res.update(counts or {})
    if timed_out:
        res["status"] = f"test timed out after {timeout:.0f} s"
    elif counts is None:
        res["status"] = f"test did not run (pytest exit code {rc}, no report)"
    elif counts["failures"] or counts["errors"]:
        res["status"] = f"FAILED ({counts['failures']} failed, {counts['errors']} errors, {counts['passed']} passed)"
    elif counts["passed"] == 0:
        res["status"] = (f"no test ran ({counts['skipped']} skipped{': no GPU?' if counts['skipped'] else ''})")
    elif rc != 0:
        res["status"] = f"pytest exit code {rc}"
    else:
        res["status"] = "passed"
        res["summary"] = f"{counts['passed']} passed" + (f", {counts['skipped']} skipped" if counts["skipped"] else "")
    return res


def result_files(out: str, since: float) -> list[str]:
    """Files the benchmark wrote under `out` (modified after `since`), logs excluded."""
    found = []
    for d, _, files in os.walk(out):
        for f in files:
            p = os.path.join(d, f)
            if f not in LOG_FILES and os.path.getmtime(p) >= since:
                found.append(os.path.relpath(p, out))
    return sorted(found)


def run_entry(entry: Entry, results_dir: str, python: str = sys.executable, timeout_factor: float = 3.0,
              echo: bool = True, test_workers: int = 0) -> dict:
    out = os.path.join(os.path.abspath(results_dir), entry.name)
    os.makedirs(out, exist_ok=True)
    rec = {"name": entry.name, "kernel": entry.kernel, "peers": list(entry.peers), "shapes": entry.shapes,
           "test_command": shlex.join(entry.test_command(python, workers=test_workers)),
           "bench_command": shlex.join(entry.bench_command(out, python)),
           "estimate_s": entry.estimate_s, "out": out}
    _say(f"[{entry.name}] correctness test: {rec['test_command']}")
    t = run_test(entry, out, python, timeout_factor * entry.est_test_s if timeout_factor else None, echo,
                 test_workers)
    rec["test"] = t
    if t["status"] != "passed":
        rec["status"] = "refused"
        rec["reason"] = f"correctness test not green: {t['status']}"
        _say(f"[{entry.name}] REFUSED: {rec['reason']} (log: {os.path.join(out, 'test.log')})")
        return rec
    _say(f"[{entry.name}] test passed ({t.get('summary', '')}, {t['seconds']:.0f} s); "
         f"benchmark: {rec['bench_command']}")
    since = time.time() - 1
    t0 = time.monotonic()
    timeout = timeout_factor * entry.est_bench_s if timeout_factor else None
    rc, timed_out = run_logged(entry.bench_command(out, python), os.path.join(out, "bench.log"), timeout, echo)
    rec["bench_seconds"] = time.monotonic() - t0
    rec["bench_returncode"] = rc
    rec["result_files"] = result_files(out, since)
    if timed_out:
        rec["status"] = f"benchmark timed out after {timeout:.0f} s"
    elif rc != 0:
        rec["status"] = f"benchmark exit code {rc}"  # the scripts exit 1 when one of their own checks fails
    else:
        rec["status"] = "ok"
    files = ", ".join(rec["result_files"]) or "none"
    _say(f"[{entry.name}] {rec['status']} in {rec['bench_seconds']:.0f} s; results: {files}")
    return rec


def select(entries: list[Entry], only: str | None) -> list[Entry]:
    if not only:
        return list(entries)
    names = [n.strip() for n in only.split(",") if n.strip()]
    known = {e.name for e in entries}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise ValueError(f"unknown entries {unknown}; known: {', '.join(sorted(known))}")
    return [e for e in entries if e.name in names]


def run_registry(entries: list[Entry], results_dir: str, only: str | None = None, max_seconds: float | None = None,
                 python: str = sys.executable, timeout_factor: float = 3.0, echo: bool = True,
                 test_workers: int = 0) -> list[dict]:
    """Run the selected entries in order (tests first; refused / skipped ones are recorded), write the
    summary, return the records."""
    start = time.monotonic()
    records = []
    for e in select(entries, only):
        left = None if max_seconds is None else max_seconds - (time.monotonic() - start)
        if left is not None and e.estimate_s > left:
            records.append({"name": e.name, "kernel": e.kernel, "peers": list(e.peers), "shapes": e.shapes,
                            "estimate_s": e.estimate_s, "status": "skipped",
                            "reason": f"estimated {e.estimate_s} s, {max(left, 0):.0f} s left of --max-seconds"})
            _say(f"[{e.name}] skipped: {records[-1]['reason']}")
            continue
        records.append(run_entry(e, results_dir, python, timeout_factor, echo, test_workers))
        write_summary(results_dir, records, time.monotonic() - start)  # after each: a killed run keeps it
    write_summary(results_dir, records, time.monotonic() - start)
    return records


# ---- summary ------------------------------------------------------------------------------------

def environment() -> dict:
    def cmd(*a):
        try:
            r = subprocess.run(list(a), cwd=REPO, capture_output=True, text=True, timeout=20)
            return r.stdout.strip() if r.returncode == 0 else None
        except (OSError, subprocess.SubprocessError):
            return None

    return {"gpu": cmd("nvidia-smi", "--query-gpu=name", "--format=csv,noheader"),
            # the device machine runs a copy of the tree without its .git: the caller names the commit
            "commit": os.environ.get("LINRNN_COMMIT") or cmd("git", "rev-parse", "HEAD"),
            "dirty": False if os.environ.get("LINRNN_COMMIT") else bool(cmd("git", "status", "--porcelain",
                                                                             "--untracked-files=no")),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "command": shlex.join(["linrnn-serve", "bench", "kernels"] + sys.argv[sys.argv.index("kernels") + 1:])
            if "kernels" in sys.argv else shlex.join(sys.argv), "python": sys.executable}


def summary_markdown(records: list[dict], env: dict, seconds: float) -> str:
    lines = ["# Kernel benchmarks (registry run)", "",
             f"{env.get('gpu') or 'no GPU found'}, commit {(env.get('commit') or '?')[:12]}"
             f"{' (dirty)' if env.get('dirty') else ''}, {env['date']}, {seconds:.0f} s in this run", "",
             f"`{env['command']}`", "",
             "A kernel whose correctness test is not green is refused (not timed). Entries dated before this "
             "run come from an earlier run into the same directory.", "",
             "| entry | kernel | peers | test | benchmark | time s | result files | date |",
             "|---|---|---|---|---|---:|---|---|"]
    for r in records:
        test = r.get("test", {})
        tstat = test.get("summary") or test.get("status") or "-"
        if test.get("status") == "passed":
            tstat = "passed: " + tstat
        bench = r["status"] + (f" ({r['reason']})" if r["status"] == "skipped" else "")
        secs = test.get("seconds", 0) + r.get("bench_seconds", 0)
        files = ", ".join(f"[{f}]({r['name']}/{f})" for f in r.get("result_files", [])) or "-"
        lines.append(f"| {r['name']} | {r['kernel']} | {'; '.join(r['peers'])} | {tstat} | {bench} | "
                     f"{secs:.0f} | {files} | {r.get('date', '')} |")
    return "\n".join(lines) + "\n"


def write_summary(results_dir: str, records: list[dict], seconds: float) -> None:
    """kernels_summary.{md,json}; entries of an earlier summary in the same directory that this run did
    not run are kept (so several device calls, each with --only, build one summary)."""
    os.makedirs(results_dir, exist_ok=True)
    env = environment()
    base = os.path.join(results_dir, "kernels_summary")
    for r in records:
        r.setdefault("date", env["date"])
    merged = {r["name"]: r for r in _previous_records(base + ".json")}
    merged.update({r["name"]: r for r in records})
    order = {e.name: i for i, e in enumerate(ENTRIES)}
    all_records = sorted(merged.values(), key=lambda r: order.get(r["name"], len(order)))
    with open(base + ".md", "w") as f:
        f.write(summary_markdown(all_records, env, seconds))
    with open(base + ".json", "w") as f:
        json.dump({"env": env, "seconds": seconds, "entries": all_records}, f, indent=1, default=str)
    _say(f"wrote {base}.md and .json")


def _previous_records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [r for r in json.load(f).get("entries", []) if isinstance(r, dict) and "name" in r]
    except (OSError, ValueError, AttributeError):
        return []


def _say(msg: str) -> None:
    print(msg, flush=True)


# ---- CLI ----------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.add_argument("--only", default=None, help="comma list of entry names (default: all)")
    p.add_argument("--list", action="store_true", help="print the entries and exit")
    p.add_argument("--dry-run", action="store_true", help="print the test and benchmark commands and exit")
    p.add_argument("--max-seconds", type=float, default=None,
                   help="skip entries whose estimate no longer fits in this many seconds from the start")
    p.add_argument("--results-dir", default=DEFAULT_RESULTS, help="results/<entry>/ and kernels_summary.{md,json}")
    p.add_argument("--timeout-factor", type=float, default=3.0,
                   help="kill a test or benchmark after this many times its estimate (0: never)")
    p.add_argument("--quiet", action="store_true", help="do not echo the subprocesses' output (logs only)")
    p.add_argument("--test-workers", type=int, default=None,
                   help="pytest-xdist workers for the correctness tests (default: 4 when pytest-xdist is installed)")


def default_test_workers() -> int:
    import importlib.util

    return 4 if importlib.util.find_spec("xdist") is not None else 0


def run(args) -> int:
    try:
        entries = select(ENTRIES, args.only)
    except ValueError as e:
        raise SystemExit(f"bench kernels: {e}") from None
    if args.list or args.dry_run:
        for e in entries:
            print(f"{e.name}: {e.kernel}\n  peers: {'; '.join(e.peers)}\n  shapes: {e.shapes}\n"
                  f"  estimate: {e.est_test_s} s test + {e.est_bench_s} s benchmark")
            if args.dry_run:
                out = os.path.join(os.path.abspath(args.results_dir), e.name)
                workers = args.test_workers if args.test_workers is not None else default_test_workers()
                print(f"  test:  {shlex.join(e.test_command(workers=workers))}\n"
                      f"  bench: {shlex.join(e.bench_command(out))}")
        return 0
    workers = args.test_workers if args.test_workers is not None else default_test_workers()
    # `timeout` sends SIGTERM: unwind (run_logged kills the running child) instead of dying silently
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    records = run_registry(entries, args.results_dir, max_seconds=args.max_seconds, timeout_factor=args.timeout_factor,
                           echo=not args.quiet, test_workers=workers)
    for r in records:
        print(f"{r['name']:<12} {r['status']}" + (f": {r['reason']}" if r.get("reason") else ""))
    return 0 if all(r["status"] == "ok" for r in records) else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="linrnn-serve bench kernels")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
