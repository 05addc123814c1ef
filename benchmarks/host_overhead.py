"""Host time per decode step, with the forward stubbed out (CPU; no model math).

The engine runs for real — scheduler, runner (input staging, upload, buckets, sampling-row
bookkeeping, the sampled ids' transfer), postprocess, per-step deltas, the message to the API server,
its detokenization and 128 streaming HTTP clients — but the model forward + sampler is replaced by
one tiny elementwise op (`StubRunner._decode_forward`: next token = f(last token)). So the wall time of
one core-loop iteration is the host's cost of a decode step: what the GPU waits for when it is not
hidden.

    python -m linrnn_bench.host_overhead [--batch 1,128] [--tokens 256] [--out benchmarks/results/host_overhead]

Two numbers per batch size:
  bare    the engine core alone in this process: EngineCore.step() (schedule -> execute -> postprocess
          -> deltas) + msgspec encoding of the step's message, timed per step
  served  the core in its own process (engine/core.py) behind the API server (uvicorn in this process)
          with B streaming HTTP clients (another process): the core's own timing of its loop
          iterations (`core_decode_step_seconds_total` / `core_decode_steps_total` from /metrics),
          over every decode-only step of the run (the mean batch is reported beside it: the requests
          arrive over tens of ms, so the run ramps up and down), and over the steps at the full batch B
          alone (`core_full_decode_*`: the acceptance line's "at B = 128")
Prefill steps are left out. Mean and median are both given for `bare`: on a loaded shared machine
the mean carries the scheduler's preemptions of this process.

Structured output (`--structured`, bare only): the same batch free, then with every sequence under
batched.STRUCTURED_SCHEMA (a JSON array of integers: never completes, so every step fills a real
grammar mask; the stub's mask step takes each row's lowest allowed token: `[-0,-0,...`). Per step:
the whole host time, the part spent in the grammar callback (`fill`: queued tokens fed to the matchers +
the bitmask rows; on a GPU it runs while the forward is queued, runner/model_runner.py), the stubbed
mask step (device work on a GPU, one graph replay) and the rest ("exposed": what the GPU would wait for;
it counts the mask's host -> "device" copy, an asynchronous DMA on a GPU). `--model qwen35moe-nvfp4` gives the 248k-token vocabulary of
the GPU bench (the stub loads no weights, so the weights-fit check is skipped; the caches are real).
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import subprocess
import sys
import time

import torch

from linrnn_serve.engine.executor import UniProcExecutor
from linrnn_serve.runner.model_runner import ModelRunner
from linrnn_serve.runner.worker import Worker

STUB = "linrnn_bench.host_overhead:StubExecutor"
TEXT_IDS = (300, 8000)  # stub tokens stay among ordinary text tokens of the default model's vocabulary


class StubModel(torch.nn.Module):
    """The model's interface without its math: zero logits for prefill rows."""

    def __init__(self, cfg, dtype, device):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device), requires_grad=False)

    def forward(self, batch, caches, all_logits: bool = False):
        rows = batch.logits_indices.numel() if getattr(batch, "logits_indices", None) is not None else \
            batch.cu_seqlens.numel() - 1
        return torch.zeros(rows, self.cfg.vocab_size, dtype=self.dtype, device=self.anchor.device)


class StubRunner(ModelRunner):
    def _decode_forward(self, b: int) -> None:
        lo, hi = TEXT_IDS
        ids = self._decode_input_ids(b)
        self._publish(b, (ids * 7 + 13) % (hi - lo) + lo)

    def _mask_static(self, b: int) -> None:
        """The grammar mask's device part, stubbed like the forward (on a GPU it is one graph replay): each
        constrained row takes its lowest allowed token; free rows (all ones) keep the stub's token."""
        t0 = time.perf_counter()
        words = self._mask[:b]
        w = words.ne(0).int().argmax(1)
        word = words.gather(1, w[:, None]).squeeze(1).long() & 0xFFFFFFFF
        tok = w.long() * 32 + torch.log2((word & -word).double()).long()
        self._publish(b, torch.where(words.eq(-1).all(1), self.step_ids[:b], tok))
        self.mask_device_s += time.perf_counter() - t0  # device work on a GPU: not host cost

    mask_device_s = 0.0


class StubWorker(Worker):
    def load_model(self, calibration_tokens=None) -> None:
        self.model = StubModel(self.model_config, self.dtype, self.device)
        self.head_map_description = "stub (no model)"

    def init_caches(self, budget) -> None:
        super().init_caches(budget)
        c = self.config
        self.runner = StubRunner(self.model, self.caches, max_num_seqs=c.max_num_seqs,
                                 max_model_len=self.max_model_len, block_size=c.block_size,
                                 enforce_eager=c.enforce_eager, progress=False)


class StubExecutor(UniProcExecutor):
    worker_cls = StubWorker


def engine_config(batch: int, tokens: int, executor: str = STUB, model: str = "default"):
    from linrnn_serve.config import EngineConfig

    return EngineConfig(model=model, load_format="dummy" if model != "default" else "auto", executor=executor,
                        max_num_seqs=max(batch, 1), max_num_batched_tokens=max(2048, batch), max_model_len=tokens + 64)


PROMPT = [1000, 2000, 3000, 4000]


# ---- bare: the core in this process ----------------------------------------------------------------
def _engine(batch: int, tokens: int, model: str):
    from linrnn_serve.engine import llm_engine
    from linrnn_serve.engine.llm_engine import LLMEngine

    if model != "default":  # the stub loads no weights: a big model's weights-fit check does not apply
        llm_engine.check_weights_fit = lambda *a, **k: None
    return LLMEngine(engine_config(batch, tokens, model=model), progress=False)


def bench_bare(batch: int, tokens: int, eng=None, structured: bool = False) -> dict:
    from linrnn_serve.engine.core import EngineCore
    from linrnn_serve.engine.protocol import AddRequest, encoder
    from linrnn_serve.sampling_params import SamplingParams, StructuredOutputsParams
    from linrnn_bench.batched import STRUCTURED_SCHEMA

    eng = eng or _engine(batch, tokens, "default")
    eng.detokenize_all = False
    core = EngineCore(eng)
    gc.collect()
    gc.freeze()  # as the core process does
    so = StructuredOutputsParams(json=STRUCTURED_SCHEMA) if structured else None
    p = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True, structured_outputs=so)
    fill_s = [0.0]
    fill = eng.structured.fill

    def timed_fill(host, seq_ids):  # the grammar callback: on a GPU it runs while the forward is queued
        t = time.perf_counter()
        fill(host, seq_ids)
        fill_s[0] += time.perf_counter() - t

    eng.structured.fill = timed_fill
    for i in range(batch):
        core.add(AddRequest(f"r{i}-{int(structured)}", PROMPT, p, time.monotonic()))
    runner = eng.executor.worker.runner
    times, fills, devs = [], [], []
    try:
        while eng.has_unfinished_requests():
            fill_s[0] = runner.mask_device_s = 0.0
            t0 = time.perf_counter()
            encoder.encode(core.step())
            t1 = time.perf_counter()
            plan = eng.last_plan
            if plan.decode and not plan.prefill and len(plan.decode) == batch:
                times.append(t1 - t0)
                fills.append(fill_s[0])
                devs.append(runner.mask_device_s)
    finally:
        del eng.structured.fill
    k = len(times) // 8  # warm-up
    times, fills, devs = times[k:], fills[k:], devs[k:]
    exposed = sorted(t - f - d for t, f, d in zip(times, fills, devs))
    fills.sort()
    devs.sort()
    times.sort()
    med = len(times) // 2
    return {"steps": len(times), "mean_ms": 1e3 * sum(times) / len(times), "median_ms": 1e3 * times[med],
            "fill_median_ms": 1e3 * fills[med], "mask_device_median_ms": 1e3 * devs[med],
            "exposed_median_ms": 1e3 * exposed[med]}


def bench_structured(batch: int, tokens: int, model: str) -> dict:
    """The same engine and batch: free, then every row under a JSON grammar."""
    eng = _engine(batch, tokens, model)
    return {"batch": batch, "model": model, "vocab_size": eng.model_config.vocab_size,
            "free": bench_bare(batch, tokens, eng), "constrained": bench_bare(batch, tokens, eng, structured=True)}


# ---- served: core process + API server + streaming clients ----------------------------------------
async def _clients(url: str, batch: int, tokens: int) -> dict:
    import httpx

    limits = httpx.Limits(max_connections=batch + 8, max_keepalive_connections=batch + 8)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def one(i):
            n = 0
            body = {"prompt": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0, "ignore_eos": True}
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        n += 1
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(i) for i in range(batch)))
        return {"chunks": sum(counts), "seconds": time.perf_counter() - t0}


def bench_served(batch: int, tokens: int) -> dict:
    import uvicorn

    from linrnn_serve.engine.core_client import AsyncMPClient
    from linrnn_serve.engine.protocol import STATS_INTERVAL_S
    from linrnn_server.app import build_app

    client = AsyncMPClient(engine_config(batch, tokens))
    app = build_app(client)
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False)
    server = uvicorn.Server(config)

    async def main():
        serve = asyncio.ensure_future(server.serve())
        while not server.started:
            await asyncio.sleep(0.05)
        port = server.servers[0].sockets[0].getsockname()[1]
        url = f"http://127.0.0.1:{port}"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "linrnn_bench.host_overhead", "--clients", url, "--batch", str(batch),
            "--tokens", str(tokens), stdout=subprocess.PIPE, start_new_session=True)  # its own CPU autogroup
        out, _ = await proc.communicate()
        await asyncio.sleep(2 * STATS_INTERVAL_S + 0.1)  # the core's next stats snapshot
        end = client.stats()
        server.should_exit = True
        await serve
        return end, json.loads(out)

    try:
        end, clients = asyncio.run(main())
    finally:
        client.shutdown_sync(timeout=10)
    steps, secs = end["core_decode_steps_total"], end["core_decode_step_seconds_total"]
    rows = end["core_decode_rows_total"]
    full, full_secs = end["core_full_decode_steps_total"], end["core_full_decode_step_seconds_total"]
    return {"steps": steps, "mean_ms": 1e3 * secs / max(steps, 1), "mean_batch": rows / max(steps, 1),
            "median_ms": 1e3 * histogram_median(end["core_decode_step_seconds"]),
            "full_steps": full, "full_mean_ms": 1e3 * full_secs / max(full, 1),
            "full_median_ms": 1e3 * histogram_median(end["core_full_decode_step_seconds"]),
            "client_chunks": clients["chunks"], "client_seconds": clients["seconds"]}


def histogram_median(h: dict) -> float:
    """Median of a cumulative histogram snapshot, linear within its bucket."""
    half, lo, below = h["count"] / 2, 0.0, 0
    for le, cum in h["buckets"]:
        if cum >= half:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (half - below) / max(cum - below, 1)
        lo, below = le, cum
    return lo


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", default="1,128")
    ap.add_argument("--tokens", type=int, default=1024, help="output tokens per request")
    ap.add_argument("--out", default=None, help="folder for host_overhead.json / .md")
    ap.add_argument("--structured", action="store_true", help="bare only: free vs every row JSON-constrained")
    ap.add_argument("--model", default="default", help="with --structured: e.g. qwen35moe-nvfp4 (248k vocabulary)")
    ap.add_argument("--clients", default=None, help=argparse.SUPPRESS)  # internal: run the clients against URL
    a = ap.parse_args(argv)
    if a.clients:
        print(json.dumps(asyncio.run(_clients(a.clients, int(a.batch), a.tokens))))
        return 0
    torch.set_num_threads(1)
    if a.structured:
        return _main_structured(a, argv)
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        bare = bench_bare(b, a.tokens)
        served = bench_served(b, a.tokens)
        rows.append({"batch": b, "bare": bare, "served": served})
        print(f"B={b:4d}  bare {bare['mean_ms']:.3f} ms/step (median {bare['median_ms']:.3f}, {bare['steps']} steps)"
              f"  served {served['mean_ms']:.3f} ms/step (median {served['median_ms']:.3f}, {served['steps']} steps, mean batch "
              f"{served['mean_batch']:.1f}; clients got {served['client_chunks']} chunks)  served at B={b}: "
              f"{served['full_mean_ms']:.3f} ms/step (median {served['full_median_ms']:.3f}, {served['full_steps']} steps)",
              flush=True)
    env = {**_env(argv), "tokens": a.tokens}
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "host_overhead.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "host_overhead.md"), "w") as f:
            f.write("# Host time per decode step, stubbed forward (CPU)\n\n")
            f.write(f"`{env['command']}` at {env['commit']}, {env['date']}, {env['cores']} cores "
                    f"(1-min load average {env['load_avg_1m']:.1f}), torch {env['torch']}\n\n")
            f.write("| B | bare core ms/step (mean / median) | served: core process + API server + B streaming "
                    "clients, ms/step (mean / median) | served, steps at batch B only (mean / median) | steps timed "
                    "(bare / served / served at B) | served mean batch |\n|---|---|---|---|---|---|\n")
            for r in rows:
                s = r["served"]
                f.write(f"| {r['batch']} | {r['bare']['mean_ms']:.3f} / {r['bare']['median_ms']:.3f} | "
                        f"{s['mean_ms']:.3f} / {s['median_ms']:.3f} | {s['full_mean_ms']:.3f} / {s['full_median_ms']:.3f} | "
                        f"{r['bare']['steps']} / {s['steps']} / {s['full_steps']} | {s['mean_batch']:.1f} |\n")
    return 0


def _env(argv) -> dict:
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_avg_1m": os.getloadavg()[0], "python": platform.python_version(), "torch": torch.__version__,
            "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                     text=True).stdout.strip(),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python -m linrnn_bench.host_overhead " + " ".join(argv if argv is not None else sys.argv[1:])}


def _main_structured(a, argv) -> int:
    rows = []
    for b in [int(x) for x in a.batch.split(",")]:
        r = bench_structured(b, a.tokens, a.model)
        rows.append(r)
        f, c = r["free"], r["constrained"]
        print(f"B={b:4d} {a.model} (vocab {r['vocab_size']}): free {f['median_ms']:.3f} ms/step; JSON-constrained "
              f"{c['median_ms']:.3f} ms/step, of which grammar fill {c['fill_median_ms']:.3f} (overlaps the "
              f"forward on a GPU), stubbed mask device work {c['mask_device_median_ms']:.3f}, exposed {c['exposed_median_ms']:.3f} (+{c['exposed_median_ms'] - f['median_ms']:.3f} "
              f"vs free); medians of {c['steps']} steps", flush=True)
    env = _env(argv)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "host_structured.json"), "w") as f:
            json.dump({"env": env, "rows": rows}, f, indent=1)
        with open(os.path.join(a.out, "host_structured.md"), "w") as f:
            f.write("# Host time per decode step with grammar masks, stubbed forward (CPU)\n\n")
            f.write(f"`{env['command']}` at {env['commit']}, {env['date']}, {env['cores']} cores "
                    f"(1-min load average {env['load_avg_1m']:.1f}), torch {env['torch']}\n\n")
            f.write("| B | model (vocab) | free ms/step | constrained ms/step | of which grammar fill (overlapped "
                    "on a GPU) | stubbed mask (device work on a GPU) | exposed host | exposed - free |\n"
                    "|---|---|---|---|---|---|---|---|\n")
            for r in rows:
                fr, c = r["free"], r["constrained"]
                f.write(f"| {r['batch']} | {r['model']} ({r['vocab_size']}) | {fr['median_ms']:.3f} | "
                        f"{c['median_ms']:.3f} | {c['fill_median_ms']:.3f} | {c['mask_device_median_ms']:.3f} | "
                        f"{c['exposed_median_ms']:.3f} | "
                        f"{c['exposed_median_ms'] - fr['median_ms']:+.3f} |\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
