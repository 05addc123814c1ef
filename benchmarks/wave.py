"""Where a c = 64 wave's time goes beyond its decode steps, on the CPU (issue #14, the c = 64 output line).

    python -m linrnn_bench.wave run --out DIR [--label L] [--concurrency 64 --num-prompts 256 --input-len 128
        --output-len 128] [--decode-ms 10.15 --prefill-tokens-per-ms 58.8] [-- server flags]
    python -m linrnn_bench.wave report DIR L1 L2 ...
    python -m linrnn_bench.wave timeline DIR/trace_L [--wave 2]

`bench serve` (random prompts, in 128 / out 128, concurrency 64) against the real API server and engine-core
process with the forward stubbed and paced like the H200 (handover.PacedStubExecutor: a step lasts decode-ms +
prefill tokens / prefill-tokens-per-ms on a virtual device stream; defaults: npl 64's 10.15 ms/step and
8192 prompt tokens in ~139 ms, final_run_7). At concurrency c the requests run in waves: all c finish within a
step or two, their clients send the next c, and those must reach the core and be prefilled before the wave
decodes again. From the core's trace (serve_probe core: adds, step calls with the launched plan's composition,
token sends), per wave:

    hand-back     the previous wave's last token sent by the core -> this wave's first request at the core
    to launch     ... -> the first step call launching a prefill of the wave: the whole hand-back (a synchronized
                  wave's GPU idles for it); from the API server's trace, its parts: the server writes the
                  finished streams' last SSE frames, the clients turn around (-> the server's first ASGI call of
                  the wave), the server parses the wave's requests and hands them to the core (-> the last one)
    spread        first -> last request of the wave at the core
    wait          first request at the core -> the first step call launching a prefill of the wave
    prefill steps step calls launching prefill rows of the wave, and their token counts
    first token   first request at the core -> the last first token of the wave sent
    wave          this wave's first add -> the next wave's first add

and the run's output tok/s against the paced decode-only rate c x 1000 / decode-ms (what `bench batched` S_TG
is on the GPU). Writes DIR/wave_L.json and DIR/wave_L.md.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from linrnn_bench.handover import load_core, med, run_stamp, run_traced


def waves(core: list[list], concurrency: int, output_len: int, gap_s: float = 0.3,
          server: list[list] | None = None) -> list[dict]:
    """Group the core's adds into waves (adds more than gap_s apart: a new wave; at c = 64, out 128 waves are
    ~1.4 s apart, a split wave's adds < 0.3 s) and time each. With the API server's trace (`server`), the
    hand-back's parts on its side too (`hand_back_parts`)."""
    adds = sorted((e[1], e[2]) for e in core if e[0] == "add")
    steps = sorted((e for e in core if e[0] == "step" and len(e) > 4 and e[4]), key=lambda e: e[1])
    sends = sorted((e for e in core if e[0] == "core"), key=lambda e: e[1])
    first, last = {}, {}
    for e in sends:
        for rid, n in e[2]:
            if n >= 1 and rid not in first:
                first[rid] = e[1]
            if n >= output_len:
                last.setdefault(rid, e[1])
    groups: list[list] = []
    for t, rid in adds:
        if groups and t - groups[-1][-1][0] < gap_s:
            groups[-1].append((t, rid))
        else:
            groups.append([(t, rid)])
    out = []
    for i, g in enumerate(groups):
        rids = {r for _, r in g}
        t0, t1 = g[0][0], g[-1][0]
        prev_last = max((last[r] for _, r in groups[i - 1] if r in last), default=None) if i else None
        f = [first[r] for r in rids if r in first]
        t_first = max(f) if f else None
        pre = [s for s in steps if t0 - 1e-6 <= s[1] and (t_first is None or s[1] <= t_first) and s[4][1]]
        to_launch = 1e3 * (pre[0][1] - prev_last) if pre and prev_last is not None else None
        out.append({
            "requests": len(g), "hand_back_ms": 1e3 * (t0 - prev_last) if prev_last is not None else None,
            "to_launch_ms": to_launch,
            **(hand_back_parts(server, {r for _, r in groups[i - 1]}, rids, prev_last, output_len)
               if server is not None and prev_last is not None else {}),
            "spread_ms": 1e3 * (t1 - t0), "wait_ms": 1e3 * (pre[0][1] - t0) if pre else None,
            "prefill_steps": len(pre), "prefill_tokens": [s[4][2] for s in pre],
            "decode_rows_beside": [s[4][0] for s in pre],
            "first_token_ms": 1e3 * (t_first - t0) if t_first is not None else None,
            "wave_ms": 1e3 * (groups[i + 1][0][0] - t0) if i + 1 < len(groups) else None})
    return out


def hand_back_parts(server: list[list], prev: set[str], rids: set[str], prev_last: float, output_len: int) -> dict:
    """The API server's and client's parts of a wave's hand-back (ms), from the core's last token of the previous
    wave (`prev` requests) at `prev_last`: until the server has written the last of their final SSE frames, then
    until its first ASGI call of this wave's requests (`rids`: the clients' turnaround, as the server's event loop
    sees it), then until it hands the last of them to the core."""
    final = [e[1] + (e[3] if len(e) > 3 else 0.0) for e in server
             if e[0] == "sse" and any(r in prev and n >= output_len for r, n in e[2])]
    asgi = [e[1] for e in server if e[0] == "http_in_rid" and e[2] in rids]
    handed = [e[1] for e in server if e[0] == "add_sent" and e[2] in rids]
    if not (final and asgi and handed):
        return {}
    return {"server_finish_ms": 1e3 * (max(final) - prev_last), "turnaround_ms": 1e3 * (min(asgi) - max(final)),
            "server_intake_ms": 1e3 * (max(handed) - min(asgi))}


def format_waves(ws: list[dict]) -> str:
    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    lines = ["| wave | requests | hand-back ms | spread ms | wait ms | prefill steps (tokens; decode rows beside) | "
             "last first token ms | wave ms |", "|---:|---:|---:|---:|---:|---|---:|---:|"]
    for i, w in enumerate(ws):
        pf = ", ".join(f"{t}; {d}" for t, d in zip(w["prefill_tokens"], w["decode_rows_beside"]))
        lines.append(f"| {i} | {w['requests']} | {f(w['hand_back_ms'])} | {f(w['spread_ms'])} | {f(w['wait_ms'])} | "
                     f"{w['prefill_steps']} ({pf}) | {f(w['first_token_ms'])} | {f(w['wave_ms'])} |")
    return "\n".join(lines)


def summary(ws: list[dict], concurrency: int) -> dict:
    full = [w for w in ws[1:] if w["requests"] == concurrency]  # wave 0: the warm-up's tail and the start
    pick = lambda k: med([w[k] for w in full if w.get(k) is not None])  # noqa: E731
    return {"waves": len(full), "hand_back_ms": pick("hand_back_ms"), "to_launch_ms": pick("to_launch_ms"),
            **{k: pick(k) for k in ("server_finish_ms", "turnaround_ms", "server_intake_ms")
               if any(k in w for w in full)}, "spread_ms": pick("spread_ms"),
            "wait_ms": pick("wait_ms"), "prefill_steps": pick("prefill_steps"),
            "first_token_ms": pick("first_token_ms"), "wave_ms": pick("wave_ms")}


def run_main(a) -> int:
    os.makedirs(a.out, exist_ok=True)
    bench_json = os.path.join(a.out, f"serve_{a.label}.json")
    client_gc = os.path.join(a.out, f"client_gc_{a.label}.json")
    trace, server = run_traced(
        a.out, a.label, f"{a.decode_ms},{a.prefill_tokens_per_ms},{a.prefill_fixed_ms}",
        ["--max-num-seqs", str(a.concurrency), "--max-model-len", str(a.input_len + a.output_len + 64),
         "--max-num-batched-tokens", "8192", "--async-scheduling", "--disable-log-requests", *a.server_args],
        lambda url: [sys.executable, "-m", "linrnn_bench.wave", "client", client_gc, "--base-url", url,
                     "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--max-concurrency",
                     str(a.concurrency), "--num-prompts", str(a.num_prompts), "--out", bench_json])
    with open(bench_json) as f:
        run = json.load(f)["runs"][0]
    core = load_core(trace)
    ws = waves(core, a.concurrency, a.output_len, server=server["events"])
    s = summary(ws, a.concurrency)
    adds = [e[1] for e in core if e[0] == "add"]
    span = (min(adds), max(e[1] for e in core)) if adds else (0.0, 0.0)  # the measured run (warm-up included)
    with open(client_gc) as f:
        s["gc"] = {"core": gc_stats(core, *span), "server": gc_stats(server["events"], *span),
                   "client": gc_stats(json.load(f), *span)}
    paced = a.concurrency * 1e3 / a.decode_ms
    res = {"label": a.label, "summary": s, "waves": ws, "output_throughput": run["output_throughput"],
           "paced_decode_tok_s": paced, "ratio": run["output_throughput"] / paced,
           "ttft_median_ms": run["ttft_ms"]["median"], "failed": run["failed"],
           "args": {k: v for k, v in vars(a).items() if k != "func"}, "load_avg_1m": os.getloadavg()[0],
           **run_stamp()}
    with open(os.path.join(a.out, f"wave_{a.label}.json"), "w") as f:
        json.dump(res, f, indent=1)
    md = format_runs([res]) + "\n\n" + format_waves(ws)
    with open(os.path.join(a.out, f"wave_{a.label}.md"), "w") as f:
        f.write(md + "\n")
    print(md)
    return 0 if run["failed"] == 0 else 1


def format_runs(runs: list[dict]) -> str:
    keys = (("full waves", "waves", "{}"), ("hand-back ms", "hand_back_ms", "{:.1f}"),
            ("hand-back to the prefill launch ms", "to_launch_ms", "{:.1f}"),
            ("... server: last final SSE written ms", "server_finish_ms", "{:.1f}"),
            ("... clients' turnaround: then the first ASGI call ms", "turnaround_ms", "{:.1f}"),
            ("... server: first ASGI call -> last hand-over ms", "server_intake_ms", "{:.1f}"),
            ("arrival spread ms", "spread_ms", "{:.1f}"), ("first add -> first prefill launch ms", "wait_ms", "{:.1f}"),
            ("prefill steps", "prefill_steps", "{:.1f}"), ("first add -> last first token ms", "first_token_ms",
                                                            "{:.1f}"), ("wave ms", "wave_ms", "{:.1f}"))
    lines = ["| per wave (median of full waves) | " + " | ".join(r["label"] for r in runs) + " |",
             "|---|" + "---:|" * len(runs)]
    for name, k, fmt in keys:
        lines.append(f"| {name} | " + " | ".join(fmt.format(r["summary"][k]) if r["summary"].get(k) is not None
                                                 else "-" for r in runs) + " |")
    for who in ("server", "core", "client"):
        lines.append(f"| GC pauses > 2 ms, {who}: count / total / max ms | " + " | ".join(
            "{count} / {total_ms:.0f} / {max_ms:.0f}".format(**r["summary"]["gc"][who]) if "gc" in r["summary"]
            else "-" for r in runs) + " |")
    for name, k, fmt in (("output tok/s", "output_throughput", "{:.0f}"), ("x paced decode rate", "ratio", "{:.3f}"),
                         ("TTFT median ms", "ttft_median_ms", "{:.1f}"), ("failed", "failed", "{}"),
                         ("1-min load average", "load_avg_1m", "{:.1f}"), ("commit", "commit", "{}")):
        lines.append(f"| {name} | " + " | ".join(fmt.format(r[k]) for r in runs) + " |")
    return "\n".join(lines)


def client_main(argv: list[str]) -> int:
    """`linrnn-serve bench serve ...` (argv[1:]) with its garbage-collection pauses written to argv[0]."""
    from linrnn_bench.serve_probe import watch_gc
    from linrnn_serve.cli import main as cli_main

    pauses: list = []
    watch_gc(lambda t, gen, d: pauses.append(["gc", t, gen, d]))
    rc = cli_main(["bench", "serve", *argv[1:]])
    with open(argv[0], "w") as f:
        json.dump(pauses, f)
    return rc


def gc_stats(events: list[list], t0: float, t1: float) -> dict:
    """Collections that stopped a process for more than serve_probe.GC_MIN_S between t0 and t1: count, total and
    longest ms."""
    d = [e[3] for e in events if e[0] == "gc" and t0 <= e[1] <= t1]
    return {"count": len(d), "total_ms": 1e3 * sum(d), "max_ms": 1e3 * max(d, default=0.0)}


def timeline(trace: str, wave: int, concurrency: int, output_len: int, before_s: float = 0.04,
             after_s: float = 0.2) -> str:
    """One wave's events, core and API server merged (ms from the wave's first request at the core; repeats of an
    event folded into one line with their count): the hand-back from the previous wave's last tokens to the
    prefill step, and that step's first tokens."""
    core = load_core(trace)
    with open(os.path.join(trace, "server.json")) as f:
        server = json.load(f)["events"]
    ev = []
    for e in core:
        if e[0] == "step" and len(e) > 4 and e[4]:
            ev.append((e[1], "core step call: launched decode rows {}, prefill rows {} / tokens {}".format(*e[4][:3])))
        elif e[0] == "core":
            fin, first = sum(n >= output_len for _, n in e[2]), sum(n == 1 for _, n in e[2])
            if fin or first:
                ev.append((e[1], f"core sends: {fin} finished, {first} first tokens"))
        elif e[0] == "add":
            ev.append((e[1], "core add"))
        elif e[0] == "gc":
            ev.append((e[1], f"core GC pause {1e3 * e[3]:.1f} ms"))
    names = {"http_in_rid": "server: a request's ASGI call", "add_sent": "server: a request to the core"}
    for e in server:
        if e[0] in names:
            ev.append((e[1], names[e[0]]))
        elif e[0] == "recv" and any(n >= output_len for _, n in e[2]):
            ev.append((e[1], "server receives the finished"))
        elif e[0] == "sse" and any(n >= output_len for _, n in e[2]):
            ev.append((e[1], "server: SSE of a finished stream"))
        elif e[0] == "gc":
            ev.append((e[1], f"server GC pause {1e3 * e[3]:.1f} ms"))
    ws = waves(core, concurrency, output_len)
    adds = sorted(e[1] for e in core if e[0] == "add")
    t0 = adds[sum(w["requests"] for w in ws[:wave])]
    out, prev = [], None
    for t, what in sorted(ev):
        if not t0 - before_s <= t <= t0 + after_s:
            continue
        if out and what == prev:
            out[-1][2] += 1
            out[-1][1] = t
        else:
            out.append([t, t, 1, what])
        prev = what
    return "\n".join(f"{1e3 * (a - t0):8.1f} ms  {what}" + (f"  (x{n}, until {1e3 * (b - t0):.1f})" if n > 1 else "")
                     for a, b, n, what in out)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "client":
        return client_main(argv[1:])
    p = argparse.ArgumentParser(prog="python -m linrnn_bench.wave", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="mode", required=True)
    r = sub.add_parser("run")
    r.add_argument("--out", required=True)
    r.add_argument("--label", default="run")
    r.add_argument("--concurrency", type=int, default=64)
    r.add_argument("--num-prompts", type=int, default=256)
    r.add_argument("--input-len", type=int, default=128)
    r.add_argument("--output-len", type=int, default=128)
    r.add_argument("--decode-ms", type=float, default=10.15)
    r.add_argument("--prefill-tokens-per-ms", type=float, default=58.8)
    r.add_argument("--prefill-fixed-ms", type=float, default=6.5)
    r.add_argument("server_args", nargs=argparse.REMAINDER)
    tl = sub.add_parser("timeline", help="one wave's core and server events (a run's trace_LABEL directory)")
    tl.add_argument("trace")
    tl.add_argument("--wave", type=int, default=2)
    tl.add_argument("--concurrency", type=int, default=64)
    tl.add_argument("--output-len", type=int, default=128)
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    rep.add_argument("labels", nargs="+")
    a = p.parse_args(argv)
    if a.mode == "run":
        return run_main(a)
    if a.mode == "timeline":
        print(timeline(a.trace, a.wave, a.concurrency, a.output_len))
        return 0
    runs = []
    for label in a.labels:
        with open(os.path.join(a.dir, f"wave_{label}.json")) as f:
            runs.append(json.load(f))
    print(format_runs(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
