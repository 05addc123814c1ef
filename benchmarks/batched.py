"""`linrnn-serve bench batched`: in-process batched decode benchmark with llama.cpp's
`llama-batched-bench` conventions (BENCH.md "Batched decode (the headline)").

For each (npp, ntg, npl): npl sequences of npp random prompt tokens (fixed seed) are added at once;
greedy, ignore_eos.
  T_PP  prefill of all prompts: from adding the requests until every sequence has its first token
        (engine steps with chunked prefill; sequences already done may decode meanwhile)
  T_TG  ntg engine steps, each decoding one token of all npl sequences: wall clock around the step
        loop with torch.cuda.synchronize, host overhead included (a step is LLMEngine.step_requests(), what
        the engine core runs; with overlapped steps, step N+1 is launched before step N is postprocessed)
  PP = npp, TG = ntg, B = npl, N_KV = npl * (npp + ntg)
  S_PP = npl * npp / T_PP,  S_TG = npl * ntg / T_TG,  S = N_KV / (T_PP + T_TG),  ms/step = T_TG / ntg
  floor ms/step and % of floor: linrnn_bench.floor (BENCH.md "The floor") from the model's stored
  bytes, the actual hybrid state pool and the KV at the mean decode context npp + ntg/2, over the
  copy bandwidth measured at the start of this run.
  vs vLLM (--vllm-ref): S_TG / vLLM's S_TG on one H200 from BENCH.md's table (PP = TG = 128 only).

Several configurations run in one invocation, one after the other, freeing GPU memory in between
(configurations with the same weights reuse the loaded model): `--model a,b` x `--ssm-bf16-tau x,y`,
or repeated `--config "model=qwen35moe-nvfp4,ssm-bf16-tau=inf,label=nvfp4 f32"`. A comparison table
gives each configuration's S_TG relative to a baseline (the first unquantized one by default).

Before timing, a warm-up round per batch size and prompt length (--warmup-steps decode steps).
CUDA graphs are captured for the npl values only (--graph-sizes all: the engine's buckets).
--profile NPL[,NPL...] records a torch.profiler trace of --profile-steps decode steps at NPL sequences
with the last configuration, after every timed row of the run (a profiler session may leave CUPTI
attached and slow down what follows), and prints the top kernels by total time; in the results table,
rows at a profiled B get a host gap (timed ms/step minus the profile's kernel ms/step, the union of the
kernels' device intervals, so overlapping kernels under programmatic dependent launch count once: the
time per step the GPU waits for the host). Writes batched.{md,json,png} into --out.

    linrnn-serve bench batched --model qwen35moe-nvfp4 --load-format dummy \\
        --npp 128 --ntg 128 --npl 1,8,32,64,128 --ssm-bf16-tau inf,32 --vllm-ref --out benchmarks/results/batched
    linrnn-serve bench batched --model tiny --npp 32 --ntg 16 --npl 1,4      # CPU, tiny preset
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import datetime
import gc
import json
import math
import os
import platform
import random
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from linrnn_bench.floor import ModelBytes, copy_bandwidth
from linrnn_bench.plotting import pyplot
from linrnn_serve.engine_args import EngineArgs

# flags of the serve CLI that mean nothing to a batched decode benchmark
BENCH_SKIPPED_ENGINE_ARGS = ("served_model_name", "device", "max_queue_len", "chat_template", "reasoning_parser",
                             "tool_call_parser", "enable_auto_tool_choice", "generation_config",
                             "override_generation_config")

# BENCH.md, "The peer to beat: vLLM 0.26.0 on one H200 (measured 2026-11-22)": Qwen3.5-35B-A3B shapes,
# dummy weights, CUDA graphs, f32 SSM state, PP=128, TG=128; npl -> S_TG (t/s).
VLLM_H200_S_TG = {
    "bf16": {1: 240, 8: 1012, 32: 2106, 64: 3386, 128: 5525},
    "nvfp4": {1: 219, 8: 1258, 32: 3386, 64: 4991, 128: 7797},  # Marlin W4A16 NVFP4 experts
}
VLLM_PP, VLLM_TG = 128, 128
CONFIG_KEYS = ("model", "load-format", "dtype", "ssm-bf16-tau", "enforce-eager", "label", "peer-row", "tp", "ep",
               "prefill-graphs", "async-scheduling")
COMM_STEPS = 4  # eager decode steps per row with every collective timed (tensor / expert parallel only)
_T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _T0:7.1f}s] {msg}", flush=True)


# ---- configurations ------------------------------------------------------------------------------

@dataclass
class BenchConfig:
    model: str
    load_format: str = "auto"
    dtype: str = "auto"
    ssm_bf16_tau: float = math.inf
    enforce_eager: bool = False
    label: str = ""
    peer_row: str = "auto"  # auto | nvfp4 | bf16 (which vLLM column --vllm-ref compares with)
    tp: int = 1  # tensor-parallel ranks
    ep: bool = False  # expert-parallel MoE over the tp ranks
    prefill_graphs: bool = True  # False: LINRNN_PREFILL_GRAPHS=0 (short prefills eager and unpadded)
    async_scheduling: bool | None = None  # overlapped steps (None: the --[no-]async-scheduling flag / engine default)

    def __post_init__(self):
        self.tp, self.ep, self.prefill_graphs = int(self.tp), bool(self.ep), bool(self.prefill_graphs)
        if not self.label:
            name = os.path.basename(os.path.normpath(self.model))
            self.label = f"{name} " + ("f32 state" if math.isinf(self.ssm_bf16_tau) else f"tau={self.ssm_bf16_tau:g}")
            if self.tp > 1:
                self.label += f" {'EP' if self.ep else 'TP'}{self.tp}"
            if not self.prefill_graphs:
                self.label += " eager prefill"
            if self.async_scheduling is not None:
                self.label += " overlapped" if self.async_scheduling else " sync"
        if self.peer_row not in ("auto", "nvfp4", "bf16"):
            raise ValueError(f"peer-row must be auto, nvfp4 or bf16, got {self.peer_row!r}")

    @property
    def weights_key(self) -> tuple:
        """Configurations with the same key share one loaded model (never a sharded one: its other
        ranks live in worker processes that end with the engine)."""
        return (self.model, self.load_format, self.dtype) if self.tp == 1 else (id(self),)


def parse_bool(v: str) -> bool:
    if v.lower() in ("1", "true", "yes", "on", ""):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"expected a boolean, got {v!r}")


def parse_config(spec: str, defaults: BenchConfig) -> BenchConfig:
    """'model=qwen35moe-nvfp4,ssm-bf16-tau=inf,label=...' over the command line's defaults."""
    kw = asdict(defaults)
    kw["label"] = ""
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, eq, value = item.partition("=")
        key = key.strip().replace("_", "-")
        if key not in CONFIG_KEYS:
            raise ValueError(f"--config {spec!r}: unknown key {key!r} (keys: {', '.join(CONFIG_KEYS)})")
        if not eq and key not in ("enforce-eager", "ep", "prefill-graphs", "async-scheduling"):
            raise ValueError(f"--config {spec!r}: {key!r} needs a value ({key}=...)")
        value = value.strip()
        if key == "ssm-bf16-tau":
            kw["ssm_bf16_tau"] = float(value)
        elif key in ("enforce-eager", "ep", "prefill-graphs", "async-scheduling"):
            kw[key.replace("-", "_")] = parse_bool(value)
        elif key == "tp":
            kw["tp"] = int(value)
        else:
            kw[key.replace("-", "_")] = value
    if not kw.get("model"):
        raise ValueError(f"--config {spec!r}: model=... is required")
    return BenchConfig(**kw)


def build_configs(args) -> list[BenchConfig]:
    models = [m.strip() for m in args.model.split(",") if m.strip()]
    taus = [float(t) for t in str(args.ssm_bf16_tau).split(",") if t.strip()]
    if not models or not taus:
        raise ValueError("--model and --ssm-bf16-tau need at least one value")
    par = dict(tp=args.tensor_parallel_size, ep=args.enable_expert_parallel)
    base = BenchConfig(models[0], args.load_format, args.dtype, taus[0], args.enforce_eager,
                       peer_row=args.peer_row, **par)
    if args.config:
        return [parse_config(s, base) for s in args.config]
    return [BenchConfig(m, args.load_format, args.dtype, t, args.enforce_eager, peer_row=args.peer_row, **par)
            for m in models for t in taus]


def int_list(s: str, what: str) -> list[int]:
    try:
        out = [int(x) for x in str(s).split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--{what} must be a comma list of integers, got {s!r}") from None
    if not out or any(v < 1 for v in out):
        raise ValueError(f"--{what} must be a comma list of positive integers, got {s!r}")
    return out


# ---- engine construction -------------------------------------------------------------------------

@contextlib.contextmanager
def engine_overrides(model=None, graph_sizes: list[int] | None = None, prefill_graphs: bool = True):
    """While an LLMEngine is built: reuse an already loaded `model` (same weights, another state
    configuration) and capture CUDA graphs only for `graph_sizes` (the batch sizes timed), instead of
    every engine bucket; prefill_graphs False sets LINRNN_PREFILL_GRAPHS=0. All are restored on exit."""
    import linrnn_serve.runner.model_runner as model_runner
    import linrnn_serve.runner.worker as worker

    saved = worker.load_model, model_runner.decode_buckets
    saved_env = os.environ.get("LINRNN_PREFILL_GRAPHS")
    if not prefill_graphs:
        os.environ["LINRNN_PREFILL_GRAPHS"] = "0"
    if model is not None:
        worker.load_model = lambda *a, **k: model
    if graph_sizes:
        sizes = sorted(set(graph_sizes))
        model_runner.decode_buckets = lambda max_num_seqs: [b for b in sizes if b < max_num_seqs] + [max_num_seqs]
    try:
        yield
    finally:
        worker.load_model, model_runner.decode_buckets = saved
        if saved_env is None:
            os.environ.pop("LINRNN_PREFILL_GRAPHS", None)
        else:
            os.environ["LINRNN_PREFILL_GRAPHS"] = saved_env


def expert_format(model) -> str | None:
    from linrnn_serve.layers.moe import Experts

    for m in model.modules():
        if isinstance(m, Experts):
            return m.w13.fmt
    return None


def prefill_steps_bound(npp: int, npl: int, max_batched: int) -> int:
    """Engine steps the prefill phase can take (decodes of finished prompts share each step's budget)."""
    return -(-npl * (npp + 1) // max(max_batched - npl, 1)) + 2


# ---- one row ------------------------------------------------------------------------------------

def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


# the structured-output row's grammar: a JSON array of integers never completes, so every timed step
# fills and applies a real JSON grammar mask
STRUCTURED_SCHEMA = {"type": "array", "items": {"type": "integer"}}


def add_batch(eng, tag: str, npp: int, npl: int, seed: int, structured: bool = False):
    """npl requests of npp random prompt tokens (fixed seed), greedy, ignore_eos, long enough to never
    finish inside the timed steps (they are aborted afterwards); `structured`: each constrained by
    STRUCTURED_SCHEMA (the grammar-mask cost row)."""
    from linrnn_serve.sampling_params import SamplingParams, StructuredOutputsParams

    rng = random.Random(f"{seed}-{npp}-{npl}")
    V = eng.model_config.vocab_size
    params = SamplingParams(temperature=0.0, max_tokens=eng.max_model_len - npp, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=STRUCTURED_SCHEMA) if structured
                            else None)
    ids = []
    for i in range(npl):
        rid = f"{tag}-{i}"
        eng.add_request(rid, [rng.randrange(V) for _ in range(npp)], params)
        ids.append(rid)
    return ids


def prefill_all(eng, max_steps: int) -> int:
    """Step until no sequence waits and every running one is decode-ready; returns the steps taken."""
    sch, steps = eng.scheduler, 0
    while sch.waiting or any(not s.decode_ready for s in sch.running):
        eng.step_requests()
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"prefill did not finish in {max_steps} steps ({len(sch.waiting)} waiting)")
    return steps


def finish(eng, ids: list[str]) -> None:
    for rid in ids:
        eng.abort(rid)
    eng.check_integrity()


def measure(eng, npp: int, ntg: int, npl: int, seed: int, tag: str, structured: bool = False) -> dict:
    """One llama-batched-bench row (times only)."""
    sch = eng.scheduler
    pre0 = sch.stats.num_preemptions
    _sync(eng)
    t0 = time.perf_counter()
    ids = add_batch(eng, tag, npp, npl, seed, structured)
    steps_pp = prefill_all(eng, 10 * prefill_steps_bound(npp, npl, eng.config.max_num_batched_tokens) + 100)
    _sync(eng)
    t_pp = time.perf_counter() - t0
    running = sch.num_running_seqs
    gen0 = sch.stats.generation_tokens
    _sync(eng)
    t0 = time.perf_counter()
    for _ in range(ntg):
        eng.step_requests()
    _sync(eng)
    t_tg = time.perf_counter() - t0
    decoded = sch.stats.generation_tokens - gen0
    preempted = sch.stats.num_preemptions - pre0
    comm = measure_comm(eng, npl)
    finish(eng, ids)
    row = {"PP": npp, "TG": ntg, "B": npl, "N_KV": npl * (npp + ntg), "T_PP": t_pp, "S_PP": npl * npp / t_pp,
           "T_TG": t_tg, "S_TG": npl * ntg / t_tg, "S": npl * (npp + ntg) / (t_pp + t_tg),
           "ms_per_step": 1e3 * t_tg / ntg, "prefill_steps": steps_pp, "decoded_tokens": decoded,
           "preemptions": preempted, "complete": decoded == npl * ntg and running == npl and preempted == 0,
           "structured": structured, **comm}
    if not row["complete"]:
        log(f"WARNING: B={npl}: {decoded} of {npl * ntg} tokens decoded in the timed steps ({running} running, "
            f"{preempted} preemptions): the row is not a clean lockstep batch")
    return row


def measure_comm(eng, npl: int) -> dict:
    """Tensor / expert parallel: COMM_STEPS more decode steps, eager, with every collective of rank 0
    timed (synchronised before and after): communication ms per step, bytes per step, and the
    all-reduce bandwidth (algorithm and bus: x 2 (N - 1) / N, as nccl-tests). {} for one rank."""
    ex = eng.executor
    if not hasattr(ex, "set_comm_timing"):
        return {}
    ex.set_comm_timing(True)
    try:
        _sync(eng)
        t0 = time.perf_counter()
        for _ in range(COMM_STEPS):
            eng.step_requests()
        _sync(eng)
        wall = time.perf_counter() - t0
        st = copy.deepcopy(ex.comm_stats())
    finally:
        ex.set_comm_timing(False)
    n = ex.parallel.tensor_parallel_size
    ar = st.by_op.get("all_reduce", [0, 0, 0.0])
    alg = ar[1] / ar[2] if ar[2] else 0.0
    return {"comm_ms_per_step": 1e3 * st.seconds / COMM_STEPS, "comm_calls_per_step": st.calls / COMM_STEPS,
            "comm_bytes_per_step": st.bytes / COMM_STEPS, "comm_eager_ms_per_step": 1e3 * wall / COMM_STEPS,
            "allreduce_algbw_GBs": alg / 1e9, "allreduce_busbw_GBs": alg * 2 * (n - 1) / n / 1e9}


def add_floor(row: dict, mb: ModelBytes, bw: float) -> None:
    ctx = row["PP"] + row["TG"] / 2  # mean context during decode
    parts = mb.step_bytes(row["B"], ctx)
    row["floor_context"] = ctx
    row["floor_bytes"] = parts
    row["floor_ms"] = 1e3 * parts["total"] / bw
    row["pct_floor"] = 100 * row["floor_ms"] / row["ms_per_step"]


def add_peer(row: dict, peer_row: str | None) -> None:
    ref = VLLM_H200_S_TG.get(peer_row or "", {}).get(row["B"]) \
        if (row["PP"], row["TG"]) == (VLLM_PP, VLLM_TG) else None
    row["vllm_S_TG"] = ref
    row["vs_vllm"] = row["S_TG"] / ref if ref else None


# ---- profiling ----------------------------------------------------------------------------------

def profile_decode(eng, npl: int, npp: int, steps: int, top: int, seed: int) -> dict:
    """torch.profiler over `steps` decode steps at npl sequences: top kernels by total device time
    (on CPU: top operators by self CPU time), kernel time per step vs wall time per step."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    ids = add_batch(eng, "profile", npp, npl, seed)
    prefill_all(eng, 10 * prefill_steps_bound(npp, npl, eng.config.max_num_batched_tokens) + 100)
    for _ in range(2):
        eng.step_requests()

    def trace():
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        _sync(eng)
        with profile(activities=acts) as prof:
            t0 = time.perf_counter()
            for _ in range(steps):
                eng.step_requests()
            _sync(eng)
            wall = time.perf_counter() - t0
        return prof, wall

    prof, wall = trace()
    note = ""
    kernels: dict[str, list[float]] = {}
    if cuda:
        spans: list[tuple[float, float]] = []

        def collect(p):
            out: dict[str, list[float]] = {}
            spans.clear()
            for e in p.events():
                if e.device_type == DeviceType.CUDA:
                    k = out.setdefault(e.name, [0, 0.0])
                    k[0] += 1
                    k[1] += e.time_range.elapsed_us()
                    spans.append((e.time_range.start, e.time_range.end))
            return out
        kernels = collect(prof)
        if not kernels and eng.runner.use_graphs:
            # kernels inside CUDA-graph replays were not reported: the eager path runs the same kernels
            note = "no kernels reported inside CUDA-graph replays: profiled the eager path (same kernels)"
            eng.runner.use_graphs = False
            try:
                prof, _ = trace()
            finally:
                eng.runner.use_graphs = True
            kernels = collect(prof)
        what = "kernel"
    else:
        for e in prof.key_averages():
            if e.self_cpu_time_total > 0:
                kernels[e.key] = [e.count, e.self_cpu_time_total]
        what = "CPU op (self time)"
    finish(eng, ids)
    total = sum(v[1] for v in kernels.values())
    # busy = the union of the kernels' device intervals: with programmatic dependent launch a kernel starts
    # while its predecessor runs and waits inside, so the durations overlap and their sum exceeds the step
    busy = covered_us(spans) if cuda else total
    rows = sorted(({"name": n, "calls": c, "total_us": t, "pct": 100 * t / total if total else 0.0,
                    "us_per_step": t / steps} for n, (c, t) in kernels.items()), key=lambda r: -r["total_us"])
    res = {"B": npl, "steps": steps, "wall_ms_per_step": 1e3 * wall / steps,
           "busy_ms_per_step": busy / steps / 1e3, "summed_ms_per_step": total / steps / 1e3, "what": what,
           "note": note, "top": rows[:top],
           "num_distinct": len(rows),
           # every device activity of a step: kernels plus the input copies (memcpy / memset)
           "launches_per_step": sum(c for c, _ in kernels.values()) / steps}
    print(format_profile(res), flush=True)
    return res


def covered_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (the time at least one of them was running)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def format_profile(p: dict) -> str:
    lines = [f"profile: B={p['B']}, {p['steps']} decode steps, wall {p['wall_ms_per_step']:.3f} ms/step, "
             f"{p['what']} time {p['busy_ms_per_step']:.3f} ms/step"
             + (f" (durations summed {p['summed_ms_per_step']:.3f}: kernels overlap)"
                if p.get("summed_ms_per_step", 0) > p["busy_ms_per_step"] + 1e-3 else "") + ", "
             f"{p.get('launches_per_step', 0):.0f} launches/step"
             + (f" ({100 * p['busy_ms_per_step'] / p['wall_ms_per_step']:.0f}% busy)" if p['wall_ms_per_step'] else ""),
             *([f"note: {p['note']}"] if p["note"] else []),
             f"| {p['what']} | calls/step | us/step | % |", "|---|---:|---:|---:|"]
    for r in p["top"]:
        name = r["name"] if len(r["name"]) <= 90 else r["name"][:87] + "..."
        lines.append(f"| `{name}` | {r['calls'] / p['steps']:.1f} | {r['us_per_step']:.1f} | {r['pct']:.1f} |")
    return "\n".join(lines)


# ---- one configuration --------------------------------------------------------------------------

def run_config(c: BenchConfig, args, shape: dict, bw: float, cached_model, profile: bool = False
               ) -> tuple[dict, object]:
    """Build the engine, warm up, time every (npp, ntg, npl), then profile if asked. Returns (result,
    model for reuse)."""
    import dataclasses

    from linrnn_serve.engine.llm_engine import LLMEngine

    npps, ntgs, npls = shape["npp"], shape["ntg"], shape["npl"]
    ec = dataclasses.replace(
        EngineArgs.from_cli_args(args), model=c.model, load_format=c.load_format, dtype=c.dtype,
        max_num_seqs=shape["max_num_seqs"], max_num_batched_tokens=shape["max_num_batched_tokens"],
        max_model_len=shape["max_model_len"], enforce_eager=c.enforce_eager, ssm_bf16_tau=c.ssm_bf16_tau,
        tensor_parallel_size=c.tp, enable_expert_parallel=c.ep,
        **({} if c.async_scheduling is None else {"async_scheduling": c.async_scheduling}),
        # the context is sized to the rows (timing, not quality): a small model's limit may be short
        allow_long_max_model_len=True,
    ).create_engine_config()
    source = "reusing the loaded weights" if cached_model is not None else f"loading {c.model} ({c.load_format})"
    graphs = "all buckets" if shape["graph_sizes"] is None else shape["graph_sizes"]
    log(f"config '{c.label}': building the engine ({source}; CUDA graphs for {graphs})")
    t0 = time.perf_counter()
    with engine_overrides(cached_model, shape["graph_sizes"], prefill_graphs=c.prefill_graphs):
        eng = LLMEngine(ec, progress=not args.no_progress)
    engine_s = time.perf_counter() - t0
    mb = ModelBytes.from_engine(eng)
    fmt = expert_format(eng.model)
    peer = c.peer_row if c.peer_row != "auto" else ("nvfp4" if fmt == "nvfp4" else "bf16")
    res = {"label": c.label, "config": asdict(c), "engine_s": engine_s, "device": str(eng.device),
           "dtype": str(eng.dtype).replace("torch.", ""), "expert_format": fmt, "peer_row": peer,
           "state_f32_fraction": eng.caches.state.f32_fraction(), "head_map": eng.head_map_description,
           "state_bytes_per_seq": eng.caches.state.bytes_per_seq(), "cuda_graphs": eng.runner.use_graphs,
           "graph_buckets": list(eng.runner.buckets), "graph_capture_s": eng.runner.graphs.capture_seconds,
           "model_bytes": mb.to_dict(), "rows": [], "profile": [],
           "parallel": eng.executor.describe().get("parallel", "TP1"),
           "comm_backend": eng.executor.describe().get("comm_backend")}
    log(f"engine ready in {engine_s:.1f} s: {res['dtype']}, experts {fmt}, state f32 fraction "
        f"{res['state_f32_fraction']:.2f} ({mb.ssm_state_bytes_per_seq / 2**20:.2f} MiB/seq), non-expert weights "
        f"{mb.nonexpert_weight_bytes / 1e9:.2f} GB, {mb.expert_bytes / 1e6:.2f} MB per expert, graphs "
        f"{'on, buckets ' + str(res['graph_buckets']) if res['cuda_graphs'] else 'off'}")
    try:
        if args.warmup_steps > 0:
            t0 = time.perf_counter()
            for npp in sorted(set(npps)):  # every prompt length: T_PP must not time a first compilation
                for npl in sorted(set(npls)):
                    measure(eng, npp, min(args.warmup_steps, ntgs[0]), npl, args.seed + 1, "warmup")
            log(f"warm-up ({len(set(npls))} batch sizes x {len(set(npps))} prompt lengths, "
                f"{min(args.warmup_steps, ntgs[0])} decode steps each) took {time.perf_counter() - t0:.1f} s")
        for npp in npps:
            for ntg in ntgs:
                for npl in npls:
                    row = measure(eng, npp, ntg, npl, args.seed, f"pp{npp}-tg{ntg}-b{npl}")
                    add_floor(row, mb, bw)
                    add_peer(row, peer if args.vllm_ref else None)
                    res["rows"].append(row)
                    log(format_row(row, args.vllm_ref))
                    if args.structured_output:  # the same batch, every sequence grammar-constrained
                        so = measure(eng, npp, ntg, npl, args.seed, f"so-pp{npp}-tg{ntg}-b{npl}", structured=True)
                        so["grammar_overhead_pct"] = 100 * (so["ms_per_step"] / row["ms_per_step"] - 1)
                        so["cuda_graphs"] = eng.runner.use_graphs if hasattr(eng, "runner") else None
                        res.setdefault("structured_rows", []).append(so)
                        log(f"  structured output (JSON grammar on every row): {so['ms_per_step']:.2f} ms/step, "
                            f"{so['grammar_overhead_pct']:+.1f} % vs unconstrained")
        for npl in shape["profile"] if profile else []:
            res["profile"].append(profile_decode(eng, npl, npps[0], args.profile_steps, args.profile_top, args.seed))
        add_host_gap(res)
    finally:
        model = eng.model if c.tp == 1 else None
        eng.shutdown()
        del eng
        gc.collect()
    return res, model


def add_host_gap(res: dict, profile: list[dict] | None = None) -> None:
    """Host gap = timed wall ms/step - profiled kernel (device) ms/step at the same B: the time per step
    the GPU waits for the host. Rows whose B was not profiled get none. `profile`: another configuration's
    (the same weights and kernels, e.g. overlapped vs synchronous steps: only the last one is profiled)."""
    busy = {p["B"]: p["busy_ms_per_step"] for p in (profile or res.get("profile") or []) if p["what"] == "kernel"}
    for r in res["rows"]:
        if r["B"] in busy:
            r["kernel_ms"] = busy[r["B"]]
            r["host_gap_ms"] = r["ms_per_step"] - busy[r["B"]]


# ---- output -------------------------------------------------------------------------------------

COLUMNS = ["PP", "TG", "B", "N_KV", "T_PP s", "S_PP t/s", "T_TG s", "S_TG t/s", "S t/s", "ms/step",
           "host gap ms/step", "floor ms/step", "% of floor"]


def row_cells(r: dict, peer: bool) -> list[str]:
    b = str(r["B"]) + ("" if r.get("complete", True) else " (incomplete)")
    cells = [str(r["PP"]), str(r["TG"]), b, str(r["N_KV"]), f"{r['T_PP']:.3f}", f"{r['S_PP']:.1f}",
             f"{r['T_TG']:.3f}", f"{r['S_TG']:.1f}", f"{r['S']:.1f}", f"{r['ms_per_step']:.3f}",
             f"{r['host_gap_ms']:.3f}" if "host_gap_ms" in r else "-",
             f"{r['floor_ms']:.3f}", f"{r['pct_floor']:.1f}"]
    if peer:
        cells += [f"{r['vllm_S_TG']}" if r.get("vllm_S_TG") else "-",
                  f"{r['vs_vllm']:.2f}x" if r.get("vs_vllm") else "-"]
    return cells


def comm_table(rows: list[dict]) -> str:
    """Per-step communication of the tensor-parallel rows (COMM_STEPS eager steps, rank 0)."""
    lines = ["Communication per decode step (eager steps, every collective timed on rank 0):", "",
             "| B | collectives | MB | comm ms | eager step ms | all-reduce algbw GB/s | busbw GB/s |",
             "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "comm_ms_per_step" in r:
            lines.append(f"| {r['B']} | {r['comm_calls_per_step']:.0f} | {r['comm_bytes_per_step'] / 1e6:.3f} | "
                         f"{r['comm_ms_per_step']:.3f} | {r['comm_eager_ms_per_step']:.3f} | "
                         f"{r['allreduce_algbw_GBs']:.3g} | {r['allreduce_busbw_GBs']:.3g} |")
    return "\n".join(lines)


def format_row(r: dict, peer: bool) -> str:
    return "| " + " | ".join(row_cells(r, peer)) + " |"


def format_table(rows: list[dict], peer: bool) -> str:
    cols = COLUMNS + (["vLLM S_TG", "vs vLLM"] if peer else [])
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    lines += [format_row(r, peer) for r in rows]
    return "\n".join(lines)


def baseline_index(results: list[dict], baseline: str | None) -> int:
    """--baseline (a label or an index into `results`) when it names one of them, else the first
    unquantized all-f32 configuration, else the first."""
    if baseline is not None:
        for i, r in enumerate(results):
            if r["label"] == baseline:
                return i
        if baseline.isdigit() and int(baseline) < len(results):
            return int(baseline)
    for i, r in enumerate(results):
        if r["expert_format"] not in ("nvfp4", "fp8") and math.isinf(r["config"]["ssm_bf16_tau"]):
            return i
    return 0


def comparison_table(results: list[dict], base: int) -> str:
    """S_TG of every configuration per (PP, TG, B), and its ratio to the baseline's."""
    keys = [(r["PP"], r["TG"], r["B"]) for r in results[0]["rows"]]
    for res in results[1:]:
        keys += [(r["PP"], r["TG"], r["B"]) for r in res["rows"] if (r["PP"], r["TG"], r["B"]) not in keys]
    by = [{(r["PP"], r["TG"], r["B"]): r for r in res["rows"]} for res in results]
    head = ["PP", "TG", "B"] + [f"{r['label']}: S_TG" for r in results] + \
           [f"{r['label']} / {results[base]['label']}" for i, r in enumerate(results) if i != base]
    lines = ["| " + " | ".join(head) + " |", "|" + "---:|" * len(head)]
    for k in keys:
        cells = [str(x) for x in k] + [f"{b[k]['S_TG']:.1f}" if k in b else "-" for b in by]
        ref = by[base].get(k)
        for i, b in enumerate(by):
            if i != base:
                # three decimals: targets sit at e.g. 1.08x, and 1.076 printed as 1.08x once
                cells.append(f"{b[k]['S_TG'] / ref['S_TG']:.3f}x" if k in b and ref else "-")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def environment(device: torch.device) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    env = {"gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
           "device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda,
           "python": platform.python_version(), "host": platform.node(), # the device machine runs a copy of the tree without its .git: the caller names the commit
           "commit": os.environ.get("LINRNN_COMMIT") or git("rev-parse", "HEAD"),
           "dirty": False if os.environ.get("LINRNN_COMMIT") else bool(git("status", "--porcelain", "--untracked-files=no")),
           "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
           "command": shlex.join(["linrnn-serve", "bench", "batched"] + sys.argv[sys.argv.index("batched") + 1:])
           if "batched" in sys.argv else shlex.join(sys.argv)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    return env


def markdown(report: dict, peer: bool) -> str:
    env = report["env"]
    out = ["# Batched decode (llama-batched-bench conventions)", "",
           f"{env['gpu'] or env['device']}, torch {env['torch']}, triton {env['triton']}, commit "
           f"{(env['commit'] or '?')[:12]}{' (dirty)' if env['dirty'] else ''}, {env['date']}", "",
           f"`{env['command']}`", "",
           f"Copy bandwidth (read + write): {report['copy_bandwidth_Bps'] / 1e9:.0f} GB/s. S_TG = B*TG/T_TG with host "
           f"overhead; floor = BENCH.md bytes per step (KV at context PP + TG/2) / copy bandwidth."]
    if peer:
        where = env["gpu"] or env["device"]
        out += ["", "vs vLLM: S_TG / vLLM 0.26.0 S_TG on one H200 (BENCH.md, PP=TG=128)"
                + ("" if "H200" in where else f"; NOTE: this run is on {where}, not an H200")]
    for res in report["configs"]:
        mb = res["model_bytes"]
        out += ["", f"## {res['label']}", "",
                f"model `{res['config']['model']}` ({res['config']['load_format']}), {res['dtype']}, experts "
                f"{res['expert_format']}, state: {res['head_map'].splitlines()[0]} "
                f"(f32 fraction {res['state_f32_fraction']:.2f}, "
                f"{res['state_bytes_per_seq'] / 2**20:.2f} MiB/seq incl. conv), CUDA graphs "
                f"{'on ' + str(res['graph_buckets']) if res['cuda_graphs'] else 'off'}; non-expert weights "
                f"{mb['nonexpert_weight_bytes'] / 1e9:.3f} GB, {mb['expert_bytes'] / 1e6:.3f} MB per expert x "
                f"{mb['num_moe_layers']} layers; engine built in {res['engine_s']:.1f} s"
                + (f"; {res['parallel']} over {res['comm_backend']} (weights, state and floor per rank)"
                   if res.get("parallel", "TP1") != "TP1" else ""), "",
                format_table(res["rows"], peer)]
        if any("comm_ms_per_step" in r for r in res["rows"]):
            out += ["", comm_table(res["rows"])]
        for prof in res.get("profile") or []:
            out += ["", format_profile(prof)]
    if len(report["configs"]) > 1:
        base = report["baseline"]
        out += ["", f"## S_TG ratios (one run; baseline: {report['configs'][base]['label']})", "",
                comparison_table(report["configs"], base)]
    return "\n".join(out) + "\n"


def plot(path: str, report: dict, peer: bool) -> None:
    plt = pyplot(path)
    if plt is None:
        return
    import matplotlib.ticker

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    peers_drawn = set()
    for res in report["configs"]:
        groups: dict[tuple, list] = {}
        for r in res["rows"]:
            groups.setdefault((r["PP"], r["TG"]), []).append(r)
        for (pp, tg), rows in groups.items():
            rows = sorted(rows, key=lambda r: r["B"])
            tag = res["label"] + (f" PP{pp} TG{tg}" if len(groups) > 1 else "")
            B = [r["B"] for r in rows]
            ax1.plot(B, [r["S_TG"] for r in rows], "o-", label=tag)
            ax2.plot(B, [r["pct_floor"] for r in rows], "o-", label=tag)
        matched = any((r["PP"], r["TG"]) == (VLLM_PP, VLLM_TG) for r in res["rows"])
        if peer and matched and res["peer_row"] not in peers_drawn:
            peers_drawn.add(res["peer_row"])
            ref = VLLM_H200_S_TG[res["peer_row"]]
            ax1.plot(list(ref), list(ref.values()), "x--", color="gray" if res["peer_row"] == "bf16" else "black",
                     label=f"vLLM H200 ({res['peer_row']}, BENCH.md)")
    ticks = sorted({r["B"] for res in report["configs"] for r in res["rows"]})
    for ax, title in ((ax1, "S_TG (t/s, host overhead included)"), (ax2, "% of the memory-traffic floor")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(ticks)
        ax.xaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("B (parallel sequences)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    ax2.set_ylim(bottom=0)
    env = report["env"]
    fig.suptitle(f"linrnn-serve batched decode, {env['gpu'] or env['device']}, commit {(env['commit'] or '?')[:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(out: str, report: dict, peer: bool) -> None:
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, "batched")
    with open(base + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(base + ".md", "w") as f:
        f.write(markdown(report, peer))
    if any(r["rows"] for r in report["configs"]):
        plot(base + ".png", report, peer)


# ---- CLI ----------------------------------------------------------------------------------------

def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = __doc__
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    g = p.add_argument_group("batch shapes (comma lists; every combination is a row)")
    g.add_argument("--npp", default="128", help="prompt tokens per sequence")
    g.add_argument("--ntg", default="128", help="generated (timed decode) tokens per sequence")
    g.add_argument("--npl", default="1,8,32,64,128", help="parallel sequences (batch sizes)")
    # the engine flags are the serve CLI's (one definition: linrnn_serve.engine_args), with comma lists for
    # --model / --ssm-bf16-tau and batch-shaped defaults
    EngineArgs.add_cli_args(p, skip=BENCH_SKIPPED_ENGINE_ARGS, overrides={
        "model": {"default": "qwen35moe-nvfp4",
                  "help": "preset, checkpoint directory or repo id; a comma list runs each in turn"},
        "ssm_bf16_tau": {"type": str, "default": "inf",
                         "help": "hybrid-state threshold(s): heads with decay timescale <= tau keep bf16 state "
                                 "(inf: all f32, 0: all bf16); a comma list runs each in turn"},
        "max_num_seqs": {"default": None, "help": "default: the largest npl"},
        "max_num_batched_tokens": {"default": None, "help": "prefill token budget per step (default: all prompts "
                                   "of the largest batch in one step, at most 16384, at least 2048)"},
        "max_model_len": {"help": "default: what the rows need (k/m/K/M suffixes)"}})
    e = p.add_argument_group("bench configurations")
    e.add_argument("--config", action="append", default=None, metavar="SPEC",
                   help="a configuration 'model=...,ssm-bf16-tau=...,load-format=...,dtype=...,enforce-eager=..."
                        ",label=...,peer-row=...,tp=N,ep=true,prefill-graphs=false,async-scheduling=false' (repeat for several; replaces the --model x --ssm-bf16-tau product, "
                        "unset keys default to the flags)")
    e.add_argument("--graph-sizes", default="npl",
                   help="CUDA-graph batch sizes: 'npl' (only the timed batch sizes: faster start), 'all' "
                        "(the engine's buckets) or a comma list")
    r = p.add_argument_group("run and report")
    r.add_argument("--warmup-steps", type=int, default=4,
                   help="decode steps of the warm-up round run at each batch size before timing (0: none)")
    r.add_argument("--structured-output", action="store_true",
                   help="after each row, the same batch with every sequence constrained by a JSON grammar "
                        "(token bitmask in the decode step): ms/step and overhead vs unconstrained")
    r.add_argument("--vllm-ref", action="store_true", help="add BENCH.md's vLLM H200 S_TG and our ratio to it")
    r.add_argument("--peer-row", default="auto", choices=["auto", "nvfp4", "bf16"],
                   help="which vLLM column to compare with (auto: nvfp4 for NVFP4 experts, else bf16)")
    r.add_argument("--baseline", default=None, help="label or index of the configuration the S_TG ratios divide by "
                                                    "(default: the first unquantized all-f32 one, else the first)")
    r.add_argument("--profile", default=None, metavar="NPL[,NPL]",
                   help="after all timed rows, profile --profile-steps decode steps at NPL sequences with the "
                        "last configuration (top kernels), for each NPL of the comma list")
    r.add_argument("--profile-steps", type=int, default=5)
    r.add_argument("--profile-top", type=int, default=20)
    r.add_argument("--out", default=None, help="directory for batched.md / batched.json / batched.png")
    r.add_argument("--no-progress", action="store_true", help="no progress bars while loading / capturing")


def resolve_shape(args) -> dict:
    npps, ntgs, npls = int_list(args.npp, "npp"), int_list(args.ntg, "ntg"), int_list(args.npl, "npl")
    max_seqs = args.max_num_seqs or max(npls)
    if max_seqs < max(npls):
        raise ValueError(f"--max-num-seqs {max_seqs} is smaller than the largest --npl {max(npls)}")
    mnbt = args.max_num_batched_tokens or min(16384, max(2048, max(npls) * (max(npps) + 1)))
    if mnbt <= max_seqs:
        raise ValueError(f"--max-num-batched-tokens {mnbt} must exceed --max-num-seqs {max_seqs} (every running "
                         f"sequence decodes each step, the rest of the budget prefills)")
    profile = int_list(args.profile, "profile") if args.profile else []
    if any(b > max_seqs for b in profile):
        raise ValueError(f"--profile {args.profile}: batch sizes must be <= max_num_seqs={max_seqs}")
    extra = max(args.warmup_steps, args.profile_steps + 2 if profile else 0)
    need = max(npp + max(ntg, extra) + 1 + prefill_steps_bound(npp, npl, mnbt)
               for npp in npps for ntg in ntgs for npl in npls + profile)
    need = -(-(need + 8) // 16) * 16
    if args.max_model_len is not None and args.max_model_len < need:
        raise ValueError(f"--max-model-len {args.max_model_len} is too small: the rows need {need} tokens per "
                         f"sequence (npp + ntg + the tokens decoded while other prompts prefill)")
    if args.graph_sizes == "all":
        sizes = None
    elif args.graph_sizes == "npl":
        sizes = sorted(set(npls + profile))
    else:
        sizes = int_list(args.graph_sizes, "graph-sizes")
    return {"npp": npps, "ntg": ntgs, "npl": npls, "max_num_seqs": max_seqs, "max_num_batched_tokens": mnbt,
            "max_model_len": args.max_model_len or need, "graph_sizes": sizes, "profile": profile}


def run(args) -> int:
    try:
        shape = resolve_shape(args)
        configs = build_configs(args)
        labels = [c.label for c in configs]
        if args.baseline is not None and args.baseline not in labels and not (
                args.baseline.isdigit() and int(args.baseline) < len(configs)):
            raise ValueError(f"--baseline {args.baseline!r} is neither a configuration label ({labels}) nor an index")
    except ValueError as e:
        raise SystemExit(f"bench batched: {e}") from None
    from linrnn_serve.models.loading import resolve_device

    device = resolve_device("auto")
    log(f"{len(configs)} configuration(s): {', '.join(c.label for c in configs)}; rows: npp {shape['npp']} x ntg "
        f"{shape['ntg']} x npl {shape['npl']}; max_num_seqs {shape['max_num_seqs']}, max_num_batched_tokens "
        f"{shape['max_num_batched_tokens']}, max_model_len {shape['max_model_len']}")
    bw = copy_bandwidth(device)
    env = environment(device)
    log(f"{env['gpu'] or device}: copy bandwidth {bw / 1e9:.0f} GB/s (read + write)")
    if args.vllm_ref:
        if "H200" not in (env["gpu"] or ""):
            log(f"NOTE: the vLLM reference was measured on an H200; this is {env['gpu'] or device}")
        if (VLLM_PP, VLLM_TG) not in {(p, t) for p in shape["npp"] for t in shape["ntg"]}:
            log(f"NOTE: the vLLM reference is for PP={VLLM_PP}, TG={VLLM_TG}: no row matches")
    report = {"env": env, "copy_bandwidth_Bps": bw, "shape": shape, "args": vars(args), "configs": [],
              "baseline": 0}
    model, ok = None, True
    for i, c in enumerate(configs):
        try:
            res, model = run_config(c, args, shape, bw, model, profile=i + 1 == len(configs))
        except Exception as e:  # report and go on with the next configuration
            log(f"config '{c.label}' FAILED: {type(e).__name__}: {e}")
            res = {"label": c.label, "config": asdict(c), "error": f"{type(e).__name__}: {e}", "rows": [],
                   "expert_format": None, "peer_row": None}
            model, ok = None, False
        report["configs"].append(res)
        if res.get("profile"):  # earlier configurations of the same weights: the same kernels per step
            for j, prev in enumerate(report["configs"][:-1]):
                if prev.get("rows") and configs[j].weights_key == c.weights_key and \
                        configs[j].enforce_eager == c.enforce_eager and configs[j].ssm_bf16_tau == c.ssm_bf16_tau:
                    add_host_gap(prev, res["profile"])
        keep = model is not None and i + 1 < len(configs) and configs[i + 1].weights_key == c.weights_key
        if not keep:
            model = None  # other weights next: free these before loading them
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the budget of the next engine counts cached blocks as used
            log(f"after '{c.label}': {torch.cuda.memory_allocated(device) / 2**30:.1f} GiB allocated, "
                f"{torch.cuda.mem_get_info(device)[0] / 2**30:.1f} GiB free"
                + (" (weights kept for the next configuration)" if keep else ""))
        good = [r for r in report["configs"] if r.get("rows")]
        if good:
            report["baseline"] = baseline_index(good, args.baseline) if len(good) > 1 else 0
        if args.out:  # after every configuration: a timeout still leaves the finished ones
            write_outputs(args.out, _printable(report), args.vllm_ref)
    final = _printable(report)
    print()
    print(markdown(final, args.vllm_ref))
    if args.out:
        log(f"wrote {os.path.join(args.out, 'batched')}.md / .json / .png")
    return 0 if ok and all(r.get("complete", True) for c in final["configs"] for r in c["rows"]) else 1


def _printable(report: dict) -> dict:
    """The report with failed configurations listed apart (tables show the ones with rows)."""
    out = dict(report)
    out["configs"] = [c for c in report["configs"] if c.get("rows")]
    out["failed"] = [{"label": c["label"], "error": c["error"]} for c in report["configs"] if c.get("error")]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="linrnn-serve bench batched")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
