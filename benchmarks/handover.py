"""The API server's hand-over latency under many streams, on the CPU (issue #16 "Benefit", issue #14 TTFT).

    python -m linrnn_bench.handover run --out DIR [--label L] [--users 32 --turns 8 --system-len 2048
        --user-len 128 --output-len 128] [--decode-ms 8.5 --prefill-tokens-per-ms 50] [-- server flags]

Reproduces the H200 multi-turn benefit run (tools/gpu_prefix.sh) without a GPU: the real API server
(`linrnn-serve` with the serve_probe trace) and engine-core process, the model's forward stubbed
(host_overhead.StubExecutor: no model math) and paced like the H200 (`PacedStubExecutor`: a virtual
device stream on which a step lasts decode-ms + prefill tokens / prefill-tokens-per-ms; the server runs with
--async-scheduling, so the core overlaps steps as on the GPU, late binding included), under `bench serve --workload multi-turn` (32 users x 8 turns, a 2048-token
shared system prompt, prefix caching on). Per request, tools/prefix_timeline.py's TTFT parts and two
more hops of the server trace:

    client send -> the ASGI app is called (`http_in`: uvicorn has parsed the request head)
                -> the body has been read (`body_in`)
                -> the route hands the request to the core (`add_sent`)
                -> the core queues it (`add`) -> the core sends its first token -> the client reads it

Writes DIR/handover_L.json (medians per turn and over turns 2..T) and DIR/handover_L.md, plus the
bench's JSON. `report DIR L1 L2 ...` prints the runs side by side.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

from linrnn_bench.host_overhead import StubExecutor

PACE_ENV = "LINRNN_STUB_PACE"  # "decode_ms,prefill_tokens_per_ms[,prefill_fixed_ms]" for the core process
UVICORN_ENV = "LINRNN_HANDOVER_UVICORN"  # "loop,http" forced on uvicorn (default: its "auto")


class PacedStubExecutor(StubExecutor):
    """The stubbed forward, paced like a GPU: each launched step occupies a virtual device stream for
    decode-ms + prefill tokens / prefill-tokens-per-ms (at least until its launch returns), starting when
    its launch starts or when the step before it ends, whichever is later; its sampled ids are ready at its
    end (`PacedStep`). So the overlapped loop (--async-scheduling) runs as on the GPU: the host prepares
    step N+1 while N "runs". With a third pace value, prefill-fixed-ms, the two forwards of a step are
    paced apart, as the GPU runs them without mixed batches: decode-ms if the step has decode rows, plus
    prefill-fixed-ms + tokens / prefill-tokens-per-ms if it has prefill rows."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        pace = [float(x) for x in os.environ.get(PACE_ENV, "8.5,50").split(",")]
        self.decode_s, self.prefill_tokens_per_s = pace[0] / 1e3, pace[1] * 1e3
        self.prefill_fixed_s = pace[2] / 1e3 if len(pace) > 2 else None
        self.device_free_at = 0.0

    def busy_s(self, plan) -> float:
        """The step's time on the virtual device."""
        if plan.empty:
            return 0.0  # snapshot copies only
        tokens = sum(len(r.token_ids) for r in plan.prefill)
        if self.prefill_fixed_s is None:
            return self.decode_s + tokens / self.prefill_tokens_per_s
        return (self.decode_s if plan.decode or plan.cached else 0.0) + \
            (self.prefill_fixed_s + tokens / self.prefill_tokens_per_s if plan.prefill else 0.0)

    def execute_async(self, plan):
        t0 = time.perf_counter()
        # the stub's host work: on the CPU it includes what a GPU does on its stream (state snapshot copies,
        # the "forward"), so the step starts on the virtual device at the launch's start, not its end
        pending = super().execute_async(plan)
        busy = self.busy_s(plan)
        end = self.device_free_at = max(max(t0, self.device_free_at) + busy, time.perf_counter())
        return PacedStep(pending, end)


class PacedStep:
    """A PendingStep whose ids reach the host at `end` (time.perf_counter())."""

    def __init__(self, inner, end: float):
        self.inner, self.end = inner, end

    def done(self) -> bool:
        return time.perf_counter() >= self.end

    def result(self):
        left = self.end - time.perf_counter()
        if left > 0:
            time.sleep(left)
        return self.inner.result()


def server_main(argv: list[str]) -> int:
    """The traced `linrnn-serve` (serve_probe) with the paced stub as the core's executor."""
    import dataclasses

    from linrnn_bench import serve_probe
    from linrnn_server import cli

    trace_dir = argv[0]
    os.makedirs(trace_dir, exist_ok=True)
    os.environ[serve_probe.TRACE_ENV] = os.path.abspath(trace_dir)
    serve_probe.install_server_probe(serve_probe.ServerTrace())
    forced = os.environ.get(UVICORN_ENV)
    if forced:  # e.g. "asyncio,h11": the server as it runs without uvloop / httptools installed
        import uvicorn

        loop, http = forced.split(",")
        real_init = uvicorn.Config.__init__

        def init(self, *a, **kw):
            real_init(self, *a, **{**kw, "loop": loop, "http": http})

        uvicorn.Config.__init__ = init
    real = cli.engine_config
    cli.engine_config = lambda args: dataclasses.replace(real(args), executor="linrnn_bench.handover:PacedStubExecutor")
    return cli.main(argv[1:])


def client_main(argv: list[str]) -> int:
    """`linrnn-serve bench serve ...` (argv) with the client's event-loop lag recorded into argv[0]."""
    import asyncio

    from linrnn_bench import serve
    from linrnn_bench.serve_probe import watch_loop_lag
    from linrnn_serve.cli import main as cli_main

    import contextvars

    from linrnn_bench import http_client

    lags: list[float] = []
    written: dict[str, float] = {}  # request id -> when its head and body were written to the socket
    conns = [0]
    current: contextvars.ContextVar = contextvars.ContextVar("handover_request", default=None)
    real_exchange, real_open = http_client.StreamClient._exchange, asyncio.open_connection

    async def exchange(self, reader, writer, data):
        holder = current.get()
        if holder is not None:
            holder["written"] = time.perf_counter()  # _exchange writes at once (no await before the write)
        return await real_exchange(self, reader, writer, data)

    async def open_connection(*a, **k):
        conns[0] += 1
        return await real_open(*a, **k)

    http_client.StreamClient._exchange = exchange
    asyncio.open_connection = open_connection
    if not hasattr(serve, "StreamClient"):  # a bench serve on httpx (before this client): hook httpcore
        import httpcore._async.http11 as conn11

        real_body, real_conn = conn11.AsyncHTTP11Connection._send_request_body, conn11.AsyncHTTP11Connection.__init__

        async def send_body(self, *a, **k):
            await real_body(self, *a, **k)
            holder = current.get()
            if holder is not None:
                holder["written"] = time.perf_counter()

        def conn_init(self, *a, **k):
            conns[0] += 1
            real_conn(self, *a, **k)

        conn11.AsyncHTTP11Connection._send_request_body = send_body
        conn11.AsyncHTTP11Connection.__init__ = conn_init
    real_send = serve.send_request

    async def send_request(*a, **k):
        holder: dict = {}
        current.set(holder)
        r = await real_send(*a, **k)
        if "written" in holder and r.request_id:
            written[r.request_id] = holder["written"]
        return r

    serve.send_request = send_request
    real = serve.run_multi_turn

    async def run_multi_turn(*a, **k):
        task = asyncio.ensure_future(watch_loop_lag(lags))
        try:
            return await real(*a, **k)
        finally:
            task.cancel()

    serve.run_multi_turn = run_multi_turn
    rc = cli_main(["bench", "serve", *argv[1:]])
    with open(argv[0], "w") as f:
        json.dump({"loop_lag": lags, "written": written, "connections": conns[0]}, f)
    return rc


def lag_stats(lags: list[float]) -> dict:
    """The event loop's lag (ms): median, p90, p99, and the share of wall time it was late by > 5 ms."""
    if not lags:
        return {}
    s = sorted(lags)
    q = lambda p: 1e3 * s[min(len(s) - 1, int(p * len(s)))]  # noqa: E731
    return {"median": q(0.5), "p90": q(0.9), "p99": q(0.99), "max": 1e3 * s[-1]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_health(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited during start-up (code {proc.returncode})")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


def load_core(trace_dir: str) -> list[list]:
    """The core's trace events (serve_probe core: add, step, per-step token sends)."""
    ev: list[list] = []
    for name in sorted(os.listdir(trace_dir)):
        if name.startswith("core-") and name.endswith(".jsonl"):
            with open(os.path.join(trace_dir, name)) as f:
                ev += [json.loads(line) for line in f if line.strip()]
    return ev


def core_times(core: list[list]) -> tuple[dict[str, float], dict[str, float]]:
    """(request id -> the core's add time, request id -> the time the core sent its first token)."""
    adds = {e[2]: e[1] for e in core if e[0] == "add"}
    first: dict[str, float] = {}
    for e in core:
        if e[0] == "core":
            for rid, cum in e[2]:
                if cum >= 1 and rid not in first:
                    first[rid] = e[1]
    return adds, first


def med(v: list[float]) -> float:
    return statistics.median(v) if v else float("nan")


PARTS = ("send -> body written", "body written -> ASGI call", "send -> ASGI call", "ASGI call -> body read", "body read -> hand-over", "send -> hand-over",
         "hand-over -> core add", "core add -> first token sent", "first token sent -> client", "TTFT")


def breakdown(bench: dict, core: list[list], server: dict, written: dict[str, float]) -> dict:
    """Per turn and over turns 2..T: the median of each TTFT part (ms)."""
    run = bench["runs"][0]
    adds, first = core_times(core)
    ev = server["events"]
    handed = {e[2]: e[1] for e in ev if e[0] == "add_sent"}
    http_in = {e[2]: e[1] for e in ev if e[0] == "http_in_rid"}
    body_in = {e[2]: e[1] for e in ev if e[0] == "body_in_rid"}
    per: dict[int, dict[str, list[float]]] = {}
    for turn, _u, rid, sent, ttft, *_ in run["requests"]:
        if rid not in handed or rid not in adds or rid not in first:
            continue
        p = per.setdefault(turn, {k: [] for k in PARTS})
        if rid in written:
            p["send -> body written"].append(written[rid] - sent)
            if rid in http_in:
                p["body written -> ASGI call"].append(http_in[rid] - written[rid])
        if rid in http_in and rid in body_in:
            p["send -> ASGI call"].append(http_in[rid] - sent)
            p["ASGI call -> body read"].append(body_in[rid] - http_in[rid])
            p["body read -> hand-over"].append(handed[rid] - body_in[rid])
        p["send -> hand-over"].append(handed[rid] - sent)
        p["hand-over -> core add"].append(adds[rid] - handed[rid])
        p["core add -> first token sent"].append(first[rid] - adds[rid])
        p["first token sent -> client"].append(sent + ttft - first[rid])
        p["TTFT"].append(ttft)
    turns = {t: {k: 1e3 * med(v) for k, v in p.items()} | {"n": len(p["TTFT"])} for t, p in sorted(per.items())}
    later = {k: 1e3 * med([x for t, p in per.items() if t > 1 for x in p[k]]) for k in PARTS}
    return {"turns": turns, "turns_2_plus": later}


def run_traced(out: str, label: str, pace: str, server_flags: list[str], client_argv) -> tuple[str, dict]:
    """Start the paced, traced server (`linrnn_bench.handover server`, the default model) with `server_flags`
    (a leading "--" dropped), run the client command `client_argv(url)` against it, keep the server's trace beside
    the core's (as tools/gpu_prefix.sh keeps it) and stop the server. Returns the trace directory and the server's
    trace. Shared by this module's and benchmarks/wave.py's `run`."""
    trace = os.path.join(out, f"trace_{label}")
    subprocess.run(["rm", "-rf", trace])
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    flags = [f for f in server_flags if f != "--"]  # (the callers' own flags come before a `-- flags` remainder)
    log = open(os.path.join(out, f"server_{label}.log"), "w")
    srv = subprocess.Popen([sys.executable, "-m", "linrnn_bench.handover", "server", trace, "--model", "default",
                            "--host", "127.0.0.1", "--port", str(port), *flags],
                           env={**os.environ, PACE_ENV: pace}, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_health(url, srv)
        r = subprocess.run(client_argv(url), capture_output=True, text=True, timeout=900)
        if r.returncode != 0:
            print(r.stdout[-3000:], r.stderr[-3000:], file=sys.stderr)
        import httpx

        server = httpx.get(url + "/probe/trace", timeout=60).json()
        with open(os.path.join(trace, "server.json"), "w") as f:
            json.dump(server, f)
    finally:
        srv.send_signal(signal.SIGINT)
        try:
            srv.wait(30)
        except subprocess.TimeoutExpired:
            srv.kill()
        log.close()
    return trace, server


def run_stamp() -> dict:
    """The commit and date a run's record carries."""
    return {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def run_main(a) -> int:
    os.makedirs(a.out, exist_ok=True)
    bench_json = os.path.join(a.out, f"multi_turn_{a.label}.json")
    client_lag = os.path.join(a.out, f"client_lag_{a.label}.json")
    trace, server = run_traced(
        a.out, a.label, f"{a.decode_ms},{a.prefill_tokens_per_ms}",
        ["--max-num-seqs", "64", "--enable-prefix-caching", "--max-model-len", "8192", "--num-prefix-snapshots", "256",
         "--async-scheduling", *a.server_args],
        lambda url: [sys.executable, "-m", "linrnn_bench.handover", "client", client_lag, "--base-url", url,
                     "--workload", "multi-turn", "--num-users", str(a.users), "--num-turns", str(a.turns),
                     "--system-len", str(a.system_len), "--user-len", str(a.user_len), "--output-len",
                     str(a.output_len), "--out", bench_json])
    with open(bench_json) as f:
        bench = json.load(f)
    with open(client_lag) as f:
        client = json.load(f)
    b = breakdown(bench, load_core(trace), server, client["written"])
    run = bench["runs"][0]
    b.update(label=a.label, args={k: v for k, v in vars(a).items() if k != "func"},
             ttft_p50_turns_2_plus_ms=run["ttft_ms_turns_2_plus"]["median"], output_throughput=run["output_throughput"],
             failed=run["failed"], server_loop_lag_ms=lag_stats(server.get("loop_lag", [])),
             client_loop_lag_ms=lag_stats(client["loop_lag"]), client_connections=client["connections"],
             hit_rate=run["hit_rate"], load_avg_1m=os.getloadavg()[0], **run_stamp())
    with open(os.path.join(a.out, f"handover_{a.label}.json"), "w") as f:
        json.dump(b, f, indent=1)
    md = format_runs([b])
    with open(os.path.join(a.out, f"handover_{a.label}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if run["failed"] == 0 else 1


def format_runs(runs: list[dict]) -> str:
    lines = ["| part (median over turns 2..T, ms) | " + " | ".join(r["label"] for r in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    for k in PARTS:
        lines.append(f"| {k} | " + " | ".join(f"{r['turns_2_plus'][k]:.1f}" for r in runs) + " |")
    for who in ("server", "client"):
        for q in ("median", "p90", "p99"):
            lines.append(f"| {who} event-loop lag {q} | " + " | ".join(
                f"{r.get(who + '_loop_lag_ms', {}).get(q, float('nan')):.1f}" for r in runs) + " |")
    for name, key, fmt in (("bench TTFT p50 turns 2..T", "ttft_p50_turns_2_plus_ms", "{:.1f}"),
                           ("output tok/s", "output_throughput", "{:.0f}"), ("hit rate", "hit_rate", "{:.3f}"),
                           ("failed", "failed", "{}"), ("1-min load average", "load_avg_1m", "{:.1f}"),
                           ("commit", "commit", "{}")):
        lines.append(f"| {name} | " + " | ".join(fmt.format(r[key]) for r in runs) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "server":
        return server_main(argv[1:])
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m linrnn_bench.handover")
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--label", default="run")
    r.add_argument("--users", type=int, default=32)
    r.add_argument("--turns", type=int, default=8)
    r.add_argument("--system-len", type=int, default=2048)
    r.add_argument("--user-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--decode-ms", type=float, default=8.5)
    r.add_argument("--prefill-tokens-per-ms", type=float, default=50.0)
    r.add_argument("server_args", nargs=argparse.REMAINDER)
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    rep.add_argument("labels", nargs="+")
    a = p.parse_args(argv)
    if a.mode == "run":
        return run_main(a)
    runs = []
    for label in a.labels:
        with open(os.path.join(a.dir, f"handover_{label}.json")) as f:
            runs.append(json.load(f))
    print(format_runs(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
