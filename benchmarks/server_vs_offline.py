"""Single-request decode speed through the HTTP server vs the offline `LLM` API, in one run (CPU).

    python -m linrnn_bench.server_vs_offline [--model default] [--tokens 64] [--rounds 3] [--out DIR]

offline  LLM(model).generate in a worker process: decode tok/s = (N - 1) / (time for N tokens - time
         for 1 token)
served   `linrnn-serve` (engine core in its own process) with one streaming /v1/completions request:
         decode tok/s = (N - 1) / (last chunk time - first chunk time), N from the usage block
Greedy, ignore_eos, the same prompt; rounds alternate offline / served so load drift hits both alike.
The offline worker and the server each start in a new session: Linux gives every session (autogroup)
a fair CPU share, so on a loaded machine a process alone in its session runs up to ~1.6x faster than
one sharing its session: both sides get one session each.
The verdict line compares the medians (the acceptance bar is served >= 0.8x offline).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import time

PROMPT = "The capital of France is"


def offline_rate(llm, tokens: int) -> float:
    from linrnn_serve.sampling_params import SamplingParams

    def run(n):
        t0 = time.perf_counter()
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == n
        return time.perf_counter() - t0

    t1 = min(run(1) for _ in range(2))
    tn = run(tokens)
    return (tokens - 1) / (tn - t1)


def offline_worker(model: str) -> int:
    """Reads a token count per line from stdin, answers one decode tok/s per line."""
    from linrnn_serve.llm import LLM

    llm = LLM(model, progress=False)
    print("ready", flush=True)
    for line in sys.stdin:
        print(offline_rate(llm, int(line)), flush=True)
    return 0


class OfflineWorker:
    def __init__(self, model: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "linrnn_bench.server_vs_offline", "--offline-worker",
                                      "--model", model], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     start_new_session=True)
        assert self.proc.stdout.readline().strip() == "ready"

    def rate(self, tokens: int) -> float:
        self.proc.stdin.write(f"{tokens}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(60)


def served_rate(url: str, tokens: int) -> float:
    import httpx

    body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    first = last = None
    n = 0
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            d = json.loads(line[6:])
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            if d.get("choices"):
                now = time.perf_counter()
                first = first or now
                last = now
    assert n == tokens, n
    return (n - 1) / (last - first)


def start_server(model: str, port: int) -> subprocess.Popen:
    import httpx

    exe = shutil.which("linrnn-serve", path=os.path.dirname(sys.executable)) or "linrnn-serve"
    proc = subprocess.Popen([exe, "--model", model, "--host", "127.0.0.1", "--port", str(port), "--log-level",
                             "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(1200):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"linrnn-serve exited with {proc.returncode}")
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("linrnn-serve did not become healthy")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--offline-worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.offline_worker:
        return offline_worker(a.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    llm = OfflineWorker(a.model)
    server = start_server(a.model, port)
    url = f"http://127.0.0.1:{port}"
    off, srv = [], []
    try:
        served_rate(url, 4)  # warm-up
        llm.rate(4)
        for i in range(a.rounds):
            off.append(llm.rate(a.tokens))
            srv.append(served_rate(url, a.tokens))
            print(f"round {i}: offline {off[-1]:.1f} tok/s, served {srv[-1]:.1f} tok/s", flush=True)
    finally:
        server.terminate()
        server.wait(60)
        llm.close()
    mo, ms = statistics.median(off), statistics.median(srv)
    verdict = f"served / offline = {ms / mo:.2f} (median {ms:.1f} / {mo:.1f} tok/s; bar >= 0.80: " \
              f"{'pass' if ms >= 0.8 * mo else 'FAIL'})"
    print(verdict)
    if a.out:
        env = {"cores": os.cpu_count(), "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(),
               "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip(),
               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": "python -m linrnn_bench.server_vs_offline " + " ".join(argv or sys.argv[1:])}
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "server_vs_offline.json"), "w") as f:
            json.dump({"env": env, "offline_tok_s": off, "served_tok_s": srv, "verdict": verdict}, f, indent=1)
        with open(os.path.join(a.out, "server_vs_offline.md"), "w") as f:
            f.write(f"# Single-request decode, server vs offline LLM ({a.model}, CPU)\n\n`{env['command']}` at "
                    f"{env['commit']}, {env['date']}, {env['cores']} cores (1-min load average "
                    f"{env['load_avg_1m']:.1f}), OMP_NUM_THREADS={env['omp_num_threads']}\n\n| round | offline tok/s | "
                    f"served tok/s |\n|---|---|---|\n")
            for i, (o, s_) in enumerate(zip(off, srv)):
                f.write(f"| {i} | {o:.1f} | {s_:.1f} |\n")
            f.write(f"\n{verdict}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
