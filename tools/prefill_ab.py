"""Prefill before / after in one process, on one loaded engine (35B-A3B NVFP4 dummy, one GPU): the code of a
base commit against the working tree, alternating, so both sides see the same GPU, weights and clocks.

--before DIR holds the base commit's copies of the files the change touched, at their repository paths
(kernels/gdn/prefill.py, linrnn_serve/layers/attention.py, ...). "before" loads each copy as its own module
and swaps its functions into every loaded linrnn module that holds the live one (and its classes' methods
into the live classes); "after" restores the live code. Per side and repetition:
  probe  tools/prefill_probe.probe_shape for each --shapes item (kernel ms per component against its floor)
  S_PP   bench batched's own row (linrnn_bench.batched.measure) for each --npl: npl prompts of --npp tokens
         added at once, T_PP until all have their first token, S_PP = npl * npp / T_PP (and S_TG over --ntg)
The first round of both sides is a warm-up (compilation); the tables give the median of the rounds so far,
printed after each round.

    python3 tools/prefill_ab.py --before DIR [--shapes 64x128,16x129@3072] [--npl 64,128] [--json out.json]
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import prefill_probe  # noqa: E402

PACKAGES = {"kernels": "linrnn_kernels", "linrnn_serve": "linrnn_serve", "server": "linrnn_server",
            "benchmarks": "linrnn_bench"}


def module_name(rel: str) -> str:
    parts = rel[:-3].split("/")
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join([PACKAGES[parts[0]]] + parts[1:])


_OLD_MODULES: dict[str, object] = {}


def load_old(name: str, path: str):
    """The base commit's module from `path`, loaded once: its Triton kernels keep their compiled variants across
    rounds (a module loaded afresh each round recompiled, or reloaded from the disk cache, every kernel
    specialization inside the timed rows: in the second GPU call of round 3 that made the before side's
    npl 128 T_PP 0.1 s slower than the kernels explain)."""
    if path not in _OLD_MODULES:
        spec = importlib.util.spec_from_file_location(f"_before_{name.replace('.', '_')}", path)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # (dataclasses look their module up)
        spec.loader.exec_module(old)
        _OLD_MODULES[path] = old
    return _OLD_MODULES[path]


def swap_in(before_dir: str):
    """Swap the base commit's functions / methods in; returns a function that restores the live ones."""
    undo = []
    loaded = [m for n, m in list(sys.modules.items()) if n.startswith("linrnn_") and m is not None]
    for root, _, files in os.walk(before_dir):
        for f in sorted(files):
            if not f.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(root, f), before_dir)
            name = module_name(rel)
            live = importlib.import_module(name)
            old = load_old(name, os.path.join(root, f))
            for attr, obj in vars(old).items():
                cur = vars(live).get(attr)
                if inspect.isfunction(obj) and obj.__module__ == old.__name__ and inspect.isfunction(cur):
                    for m in loaded:
                        for k, v in list(vars(m).items()):
                            if v is cur:
                                undo.append((m, k, v))
                                setattr(m, k, obj)
                elif inspect.isclass(obj) and obj.__module__ == old.__name__ and inspect.isclass(cur):
                    for k, v in vars(obj).items():
                        if inspect.isfunction(v) and not k.startswith("__") and k in vars(cur):
                            undo.append((cur, k, vars(cur)[k]))
                            setattr(cur, k, v)

    def restore():
        for obj, k, v in reversed(undo):
            setattr(obj, k, v)
    return restore


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", required=True)
    ap.add_argument("--model", default="qwen35moe-nvfp4")
    ap.add_argument("--shapes", default="64x128,16x129@3072")
    ap.add_argument("--npl", default="64,128")
    ap.add_argument("--npp", type=int, default=128)
    ap.add_argument("--ntg", type=int, default=32)
    ap.add_argument("--budget", type=int, default=8192, help="--max-num-batched-tokens (the H200 default)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from linrnn_bench import batched
    from linrnn_bench.floor import copy_bandwidth
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    shapes = prefill_probe.parse_shapes(args.shapes) if args.shapes else []
    npls = [int(x) for x in args.npl.split(",")] if args.npl else []
    max_len = max([args.npp + args.ntg + 8] + [L + c for _, L, c in shapes])
    with batched.engine_overrides(None, npls or [1], prefill_graphs=False):  # prefill steps of 8192 tokens run eager
        eng = LLMEngine(EngineConfig(model=args.model, load_format="dummy", dtype="bfloat16", device="cuda",
                                     max_num_seqs=max(npls + [n for n, _, _ in shapes] + [64]),
                                     max_num_batched_tokens=args.budget, max_model_len=max(2048, max_len)),
                        progress=False)
    dev = torch.cuda.get_device_name(0)
    bw = copy_bandwidth("cuda")
    peak = next((v for k, v in prefill_probe.PEAK_BF16_FLOPS.items() if k in dev), 989e12)
    print(f"device {dev}, copy bandwidth {bw / 1e9:.0f} GB/s; before = {args.before}", flush=True)
    res = {"device": dev, "copy_GBps": bw / 1e9, "args": vars(args), "rounds": []}
    for rnd in range(args.reps + 1):
        for side in ("before", "after"):
            restore = swap_in(args.before) if side == "before" else (lambda: None)
            try:
                r = {"round": rnd, "side": side, "probe": {}, "batched": {}}
                for shape in shapes:
                    r["probe"][prefill_probe.shape_key(*shape)] = prefill_probe.probe_shape(
                        eng.model, eng.caches, shape, bw, peak, graph=rnd > 0)
                for npl in npls:
                    r["batched"][npl] = batched.measure(eng, args.npp, args.ntg, npl, 0, f"ab{rnd}{side}{npl}")
            finally:
                restore()
            torch.cuda.empty_cache()
            print(f"round {rnd} {side}: " + ", ".join(
                [f"{k} {v['kernel_ms']:.2f} kernel ms" for k, v in r["probe"].items()]
                + [f"npl {n} T_PP {v['T_PP']:.4f} s" for n, v in r["batched"].items()]), flush=True)
            if rnd:
                res["rounds"].append(r)
        if rnd:  # after every round, so a run cut short by its time limit still leaves its tables
            report(res, shapes, npls)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(res, f, indent=1, default=str)


def report(res, shapes, npls):
    med = statistics.median

    def rows(side):
        return [r for r in res["rounds"] if r["side"] == side]

    for shape in shapes:
        key = prefill_probe.shape_key(*shape)
        b = [r["probe"][key] for r in rows("before")]
        a = [r["probe"][key] for r in rows("after")]
        comps = sorted({c for r in b + a for c in r["components"]},
                       key=lambda c: -med([r["components"].get(c, {}).get("ms", 0.0) for r in b]))
        print(f"\n| {key} component | before ms | after ms | after / before | floor ms | before x floor | "
              "after x floor | calls before / after |")
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for c in comps + ["total", "graph replay", "eager wall"]:
            if c == "total":
                mb, ma, fl = med([r["kernel_ms"] for r in b]), med([r["kernel_ms"] for r in a]), a[0]["floor_ms"]
                calls = f"{b[0]['kernels']} / {a[0]['kernels']}"
            elif c == "graph replay":
                if "graph_ms" not in a[0] or "graph_ms" not in b[0]:
                    continue
                mb, ma, fl, calls = med([r["graph_ms"] for r in b]), med([r["graph_ms"] for r in a]), None, ""
            elif c == "eager wall":
                mb, ma, fl, calls = med([r["wall_ms"] for r in b]), med([r["wall_ms"] for r in a]), None, ""
            else:
                mb = med([r["components"].get(c, {}).get("ms", 0.0) for r in b])
                ma = med([r["components"].get(c, {}).get("ms", 0.0) for r in a])
                fl = a[0]["components"].get(c, b[0]["components"].get(c, {})).get("floor_ms")
                calls = (f"{b[0]['components'].get(c, {}).get('calls', 0)} / "
                         f"{a[0]['components'].get(c, {}).get('calls', 0)}")
            xf = (f"{mb / fl:.2f} | {ma / fl:.2f}" if fl else "- | -")
            print(f"| {c} | {mb:.3f} | {ma:.3f} | {ma / mb if mb else float('nan'):.3f} | "
                  f"{f'{fl:.3f}' if fl else '-'} | {xf} | {calls} |")
        print(f"\n| {key} top kernels (after) | calls | ms | before ms |")
        print("|---|---:|---:|---:|")
        before_k = {k: ms for k, _, ms in b[-1]["top_kernels"]}
        for k, n, ms in a[-1]["top_kernels"][:16]:
            print(f"| {k[:64]} | {n} | {ms:.3f} | {before_k.get(k, float('nan')):.3f} |")
    if npls:
        print("\n| npl | PP | side | T_PP s (median) | S_PP tok/s | T_PP s per round | S_TG tok/s | prefill steps |")
        print("|---:|---:|---|---:|---:|---|---:|---:|")
        for npl in npls:
            for side in ("before", "after"):
                rs = [r["batched"][npl] for r in rows(side)]
                t = med([x["T_PP"] for x in rs])
                per_round = ", ".join(f"{x['T_PP']:.4f}" for x in rs)
                print(f"| {npl} | {rs[0]['PP']} | {side} | {t:.4f} | {npl * rs[0]['PP'] / t:,.0f} | {per_round} | "
                      f"{med([x['S_TG'] for x in rs]):,.0f} | {rs[0]['prefill_steps']} |")


if __name__ == "__main__":
    main()
