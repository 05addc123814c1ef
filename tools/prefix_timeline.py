"""Where a multi-turn request's time to first token goes: `bench serve --workload multi-turn` lined up
with the traced server (`python -m linrnn_bench.serve_probe server --trace-dir DIR -- ...`).

    python tools/prefix_timeline.py BENCH.json TRACE_DIR [SERVER_TRACE.json] [--steps-turn 4]

BENCH.json: the bench's result (its `requests` records: send time on CLOCK_MONOTONIC, TTFT); TRACE_DIR:
the core's `core-*.jsonl` (add, step with the launched plan's composition, per-step token sends);
SERVER_TRACE.json: the API server's `/probe/trace` (add_sent per request; http_in_rid: its ASGI call),
optional. Prints per turn the median of each TTFT part (client send -> server hands the request to the
core -> the core queues it -> the core sends its first token -> the client reads it; the first part also
split at the ASGI call: the client's send and HTTP parsing before it, body read and route after it), the burst's arrival spread at the core, and the
steps that ran while the turn's requests waited for their first token; over turns 2..T the hand-over -> first
token median and how many step calls ended in between (2: the request ran in the step after the one in flight,
as late binding does when it arrives in time; 3: one step later); each process's traced garbage collections
during the run; then one turn's steps in full.
"""
from __future__ import annotations

import argparse
import json

from linrnn_bench.handover import core_times, load_core, med  # the core trace reader, shared with the CPU repro


def analyse(bench: dict, core: list[list], server: dict | None, steps_turn: int) -> str:
    run = bench["runs"][0]
    adds, first = core_times(core)
    steps = sorted((e for e in core if e[0] == "step" and len(e) > 4 and e[4]), key=lambda e: e[1])
    handed = {e[2]: e[1] for e in server["events"] if e[0] == "add_sent"} if server else {}
    http_in = {e[2]: e[1] for e in server["events"] if e[0] == "http_in_rid"} if server else {}
    lines = ["| turn | TTFT ms | send -> server hands over | -> core add | core add -> first token sent | "
             "-> client | core arrival spread ms | steps until the last first token | of which with decode rows | "
             "prefill tokens / step | send -> ASGI call | ASGI call -> hands over |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    detail = []
    for turn in sorted({r[0] for r in run["requests"]}):
        rs = [r for r in run["requests"] if r[0] == turn and r[2] in adds and r[2] in first]
        if not rs:
            continue
        a = [adds[r[2]] for r in rs]
        f = [first[r[2]] for r in rs]
        t_lo, t_hi = min(a), max(f)
        burst = [s for s in steps if t_lo <= s[1] <= t_hi]
        ho = [1e3 * (handed[r[2]] - r[3]) for r in rs if r[2] in handed]
        hc = [1e3 * (adds[r[2]] - handed[r[2]]) for r in rs if r[2] in handed]
        hi = [1e3 * (http_in[r[2]] - r[3]) for r in rs if r[2] in http_in]
        ih = [1e3 * (handed[r[2]] - http_in[r[2]]) for r in rs if r[2] in http_in and r[2] in handed]
        lines.append(
            f"| {turn} | {med([1e3 * r[4] for r in rs]):.1f} | {med(ho):.1f} | {med(hc):.1f} | "
            f"{med([1e3 * (first[r[2]] - adds[r[2]]) for r in rs]):.1f} | "
            f"{med([1e3 * (r[3] + r[4] - first[r[2]]) for r in rs]):.1f} | {1e3 * (max(a) - min(a)):.1f} | "
            f"{len(burst)} | {sum(1 for s in burst if s[4][0])} | "
            f"{med([s[4][2] for s in burst if s[4][2]]):.0f} | {med(hi):.1f} | {med(ih):.1f} |")
        if turn == steps_turn:
            detail = [f"Turn {turn}, steps from its first core add (t = 0) to its last first token: t ms (step "
                      f"call start), host ms (the call's wall time), arrived (adds since the previous step), "
                      f"decode rows, prefill rows / tokens, cached, restores, waiting; first tokens sent after "
                      f"the call", "",
                      "| t ms | host ms | arrived | decode | prefill rows | prefill tokens | cached | restores | "
                      "waiting | first tokens sent |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
            prev = t_lo - 1e-9
            for s in burst:
                arrived = sum(1 for x in a if prev < x <= s[1])
                sent = sum(1 for x in f if s[1] <= x <= s[2] + 1e-3)
                d, pr, pt, ca, re, wa = s[4]
                detail.append(f"| {1e3 * (s[1] - t_lo):.1f} | {1e3 * (s[2] - s[1]):.1f} | {arrived} | {d} | {pr} | "
                              f"{pt} | {ca} | {re} | {wa} | {sent} |")
                prev = s[1]
    t0 = min(r[3] for r in run["requests"])  # the bench's first send: start-up collections are left out
    gc_lines = [gc_pauses("API server", server["events"] if server else [], t0), gc_pauses("engine core", core, t0)]
    return "\n".join(lines + [""] + waits(run, handed, first, steps) + gc_lines + [""] + detail)


def gc_pauses(who: str, events: list, t0: float) -> str:
    """The process's traced garbage collections during the run (serve_probe's `gc` events: start, generation,
    seconds, those over GC_MIN_S; each stalls every task of the process)."""
    d = sorted(1e3 * e[3] for e in events if e[0] == "gc" and e[1] >= t0)
    if not d:
        return f"{who}: no traced garbage collection during the run"
    return (f"{who}: {len(d)} traced garbage collections during the run, {sum(d):.1f} ms in all, "
            f"longest {d[-1]:.1f} ms")


def waits(run: dict, handed: dict, first: dict, steps: list) -> list[str]:
    """Turns 2..T: the hand-over -> first token sent median, and how many step calls ended in between
    (2: the request ran in the step after the one in flight; 3: one more, as without late binding)."""
    import bisect

    ends = sorted(s[2] for s in steps)
    w, n = [], []
    for r in run["requests"]:
        rid = r[2]
        if r[0] > 1 and rid in handed and rid in first:
            w.append(1e3 * (first[rid] - handed[rid]))
            n.append(bisect.bisect_left(ends, first[rid]) - bisect.bisect_left(ends, handed[rid]))
    if not w:
        return []
    counts = ", ".join(f"{k}: {n.count(k)}" for k in sorted(set(n)))
    return [f"Turns 2..T: the server's hand-over -> the core sends the first token, median {med(w):.1f} ms; step calls "
            f"ending in between (requests): {counts}"]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bench")
    p.add_argument("trace_dir")
    p.add_argument("server_trace", nargs="?")
    p.add_argument("--steps-turn", type=int, default=4)
    a = p.parse_args(argv)
    with open(a.bench) as f:
        bench = json.load(f)
    server = None
    if a.server_trace:
        with open(a.server_trace) as f:
            server = json.load(f)
    print(analyse(bench, load_core(a.trace_dir), server, a.steps_turn))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
