"""Where a decode step's host time goes: the B = 128 stubbed-forward step of benchmarks/host_overhead.py
split into its phases, median over 800 steps, one JSON line. Runs on this tree or an older one (tools/host_ab.sh
runs it for both: only interfaces they share are used).

    python tools/host_phases.py [--batch 128] [--tokens 1024]

Phases: schedule (Scheduler.schedule), execute_async (the runner: staging, uploads, the stubbed forward, the
sampled ids' copy), result (PendingStep.result: the ids to the host), postprocess (LLMEngine._complete:
Scheduler.postprocess + finish bookkeeping), outputs (EngineCore.step's per-request outputs for the core's
message), encode (msgspec of that message).
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import time

import torch

PHASES = ("schedule", "execute_async", "result", "postprocess", "outputs", "encode", "total")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=1024)
    a = ap.parse_args(argv)
    from linrnn_bench import host_overhead as H
    from linrnn_serve.engine.core import EngineCore
    from linrnn_serve.engine.protocol import AddRequest, StepOutputs, encoder
    from linrnn_serve.sampling_params import SamplingParams

    torch.set_num_threads(1)
    eng = H._engine(a.batch, a.tokens, "default")
    eng.detokenize_all = False
    core = EngineCore(eng)
    gc.collect()
    gc.freeze()
    p = SamplingParams(temperature=0, max_tokens=a.tokens, ignore_eos=True)
    for i in range(a.batch):
        core.add(AddRequest(f"r{i}", H.PROMPT, p, time.monotonic()))
    for _ in range(20):  # prefill and warm-up
        core.step()
    sch, ex, real = eng.scheduler, eng.executor, eng.step_requests
    times: dict[str, list[float]] = {k: [] for k in PHASES}
    pc = time.perf_counter
    for _ in range(min(800, a.tokens - 40)):
        t0 = pc()
        plan = eng.last_plan = sch.schedule()
        t1 = pc()
        pending = ex.execute_async(plan)
        t2 = pc()
        pending.result()
        t3 = pc()
        reqs = eng._complete((plan, pending))
        t4 = pc()
        eng.step_requests = lambda: reqs  # EngineCore.step's own part only
        out = core.step()
        eng.step_requests = real
        t5 = pc()
        encoder.encode(out if isinstance(out, StepOutputs) else StepOutputs(out))  # (older trees: a delta list)
        t6 = pc()
        for k, s, e in zip(PHASES, (t0, t1, t2, t3, t4, t5, t0), (t1, t2, t3, t4, t5, t6, t6)):
            times[k].append(1e3 * (e - s))
    print(json.dumps({k: round(statistics.median(v), 4) for k, v in times.items()}))


if __name__ == "__main__":
    main()
