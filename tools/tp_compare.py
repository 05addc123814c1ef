"""Greedy streams and logits of one model at several parallel configurations, against the first.

    python -m tools.tp_compare --model qwen35moe-nvfp4 --load-format dummy --configs tp1,tp2,ep2 --out /tmp/tp
    python -m tools.tp_compare --model tiny --device cpu --configs tp1,tp2,ep2        # CPU smoke run
    LINRNN_TP_SINGLE_DEVICE=1 python -m tools.tp_compare --model DIR --configs tp1,tp2,ep2  # 2 ranks on 1 GPU

Each configuration (tpN: tensor parallel over N ranks, epN: N ranks with expert parallel MoE; a
trailing e, as in tp2e, turns CUDA graphs off; tp1p perturbs the embedding by one ulp: the noise floor) runs
in its own process (so the GPUs are free for the next), with a fixed prompt set (random token ids
of a fixed seed, different lengths) decoded greedily for --max-tokens tokens, logging every step's
logits. Prints per configuration: streams identical to the baseline (of how many), the first
position where one differs, and the logits' relative error ||a - b|| / ||b|| per sequence (max and
median over the positions whose inputs agree: up to and including a stream's first difference). Writes <out>/<config>.pt and
<out>/tp_compare.json.

Where a stream differs from the baseline, the difference is "explained" when the baseline's margin
between its token and the other configuration's token at that position is within the logits
difference there (a near-tie flipped by the summation order); an unexplained difference is a bug.
`--check REL` exits 1 when a configuration failed, a difference is unexplained or the logits' relative
error exceeds REL; `--check-floor F` bounds it by F x the perturbed run's (tp1p) error instead: with
random dummy weights the bf16 model itself amplifies a one-ulp change, so a fixed bound says little. `--timeout S` ends a configuration after S seconds with SIGTERM to its process group
(every rank then writes its Python stacks into the dump directory, runner/rank_watch.py).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import torch

T_START = time.perf_counter()


def parse_config(name: str) -> tuple[int, bool, bool, bool]:
    """tpN | epN with optional suffixes: e = CUDA graphs off (tp2e), p = the embedding perturbed by one
    ulp (tp1p: the noise-floor run, one process only) -> (ranks, expert parallel, eager, perturbed)."""
    m = re.fullmatch(r"(tp|ep)(\d+)([ep]*)", name)
    if not m or int(m[2]) < 1:
        raise ValueError(f"configuration {name!r}: tpN or epN, optionally suffixed e (eager) and/or p (perturbed)")
    kind, n, flags = m[1], m[2], set(m[3])
    if "p" in flags and int(n) != 1:
        raise ValueError(f"configuration {name!r}: the perturbed noise-floor run is single-process (tp1p)")
    return int(n), kind == "ep", "e" in flags, "p" in flags


def perturb_one_ulp(w: torch.Tensor, seed: int) -> None:
    """Move every finite non-zero element of a bf16/f16 tensor by one ulp up or down at random (in place):
    the smallest change of the model's input that its own arithmetic cannot tell from rounding."""
    bits = w.data.view(torch.int16)
    g = torch.Generator(device=w.device).manual_seed(seed)
    step = torch.randint(0, 2, w.shape, generator=g, device=w.device, dtype=torch.int16) * 2 - 1
    ok = (w.data != 0) & w.data.isfinite() & (w.data.abs() < 1e30)
    bits.add_(torch.where(ok, step, torch.zeros_like(step)))


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(8 + 13 * i)] for i in range(n)]


def run_one(args) -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.sampling_params import SamplingParams

    tp, ep, eager, perturbed = parse_config(args.one)
    eng = LLMEngine.from_engine_args(args.model, load_format=args.load_format, device=args.device, dtype=args.dtype,
                                     tensor_parallel_size=tp, enable_expert_parallel=ep, max_num_seqs=args.num_prompts,
                                     max_model_len=512, seed=args.seed, progress=False, enforce_eager=eager)
    t_ready = time.perf_counter()
    if perturbed:  # the graphs read the parameter's memory, so an in-place edit reaches them too
        embed = next(p for n, p in eng.executor.worker.model.named_parameters() if n.endswith("embed_tokens"))
        if embed.element_size() != 2:
            raise SystemExit(f"{args.one}: the one-ulp perturbation needs 16-bit weights, got {embed.dtype}")
        perturb_one_ulp(embed, args.seed + 1)
    eng.capture_logits = True
    ps = prompts(args.num_prompts, eng.model_config.vocab_size, args.seed)
    for i, p in enumerate(ps):
        eng.add_request(str(i), p, SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True))
    toks = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                toks[int(o.request_id)] = o.outputs[0].token_ids
    logits = {int(r): torch.stack([eng.logits_log[(r, 0, j)].float() for j in range(args.max_tokens)])
              for r in map(str, range(len(ps)))}
    print(f"{args.one}: engine ready in {t_ready - T_START:.1f} s, {len(ps)} x {args.max_tokens} tokens decoded in "
          f"{time.perf_counter() - t_ready:.1f} s", flush=True)
    torch.save({"tokens": [toks[i] for i in range(len(ps))], "logits": logits, "describe": eng.executor.describe()},
               os.path.join(args.out, f"{args.one}.pt"))
    eng.shutdown()


def compare(base: dict, other: dict) -> dict:
    same, first_diff, errs, unexplained = 0, [], [], []
    for i, (a, b) in enumerate(zip(other["tokens"], base["tokens"])):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        same += n == len(b)
        first_diff.append(None if n == len(b) else n)
        for j in range(min(n + 1, len(b))):  # logits of positions whose inputs agree (up to the first difference)
            la, lb = other["logits"][i][j], base["logits"][i][j]
            errs.append(((la - lb).norm() / lb.norm()).item())
        if n < len(b):  # a near-tie that the perturbation may flip, or a bug?
            la, lb = other["logits"][i][n], base["logits"][i][n]
            margin = (lb[b[n]] - lb[a[n]]).item()
            delta = (la - lb).abs().max().item()
            if margin > 2 * delta:
                unexplained.append({"seq": i, "pos": n, "margin": margin, "max_logit_diff": delta})
    errs.sort()
    return {"streams_identical": same, "streams": len(base["tokens"]), "first_difference": first_diff,
            "unexplained": unexplained,
            "logits_rel_max": max(errs) if errs else None, "logits_rel_median": errs[len(errs) // 2] if errs else None}


def run_config(name: str, argv: list[str], timeout: float | None) -> int:
    """One configuration in its own process group; on timeout SIGTERM to the group (every rank dumps
    its stacks), then SIGKILL."""
    cmd = [sys.executable, "-m", "tools.tp_compare", *argv, "--one", name]
    p = subprocess.Popen(cmd, start_new_session=True)

    def forward(sig, frame):  # an outer `timeout` ends us: its ranks (another session) dump stacks and end too
        try:
            os.killpg(p.pid, signal.SIGTERM)
            p.wait(timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(p.pid, signal.SIGKILL)
        raise SystemExit(128 + sig)

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        return p.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: TIMEOUT after {timeout:.0f} s: SIGTERM to its processes (stacks in the TP dump directory)",
              flush=True)
        for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
            try:
                os.killpg(p.pid, sig)
            except OSError:
                pass
            try:
                p.wait(timeout=grace)
                break
            except subprocess.TimeoutExpired:
                continue
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tp_compare")
    p.add_argument("--model", default="qwen35moe-nvfp4")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--timeout", type=float, default=None, help="seconds per configuration")
    p.add_argument("--check", type=float, default=None, metavar="REL",
                   help="exit 1 on a failed configuration, an unexplained difference or logits rel error > REL")
    p.add_argument("--check-floor", type=float, default=None, metavar="FACTOR",
                   help="with a perturbed config (tp1p) among --configs: exit 1 when another config's logits rel "
                        "error exceeds FACTOR x the perturbed run's (the measured noise floor)")
    p.add_argument("--configs", default="tp1,tp2,ep2")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="/tmp/tp_compare")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    if args.one:
        run_one(args)
        return 0
    configs = args.configs.split(",")
    passed = [a for a in (argv if argv is not None else sys.argv[1:])]
    failed = []
    for c in configs:
        parse_config(c)
        t0 = time.perf_counter()
        rc = run_config(c, passed, args.timeout)
        print(f"{c}: exit status {rc} after {time.perf_counter() - t0:.1f} s", flush=True)
        if rc != 0:
            failed.append(c)
    ok = [c for c in configs if c not in failed]
    if configs[0] in failed:
        print(f"| {configs[0]} (baseline) | FAILED |")
        return 1
    runs = {c: torch.load(os.path.join(args.out, f"{c}.pt")) for c in ok}
    report = {c: compare(runs[configs[0]], runs[c]) for c in ok[1:]}
    print(f"| config vs {configs[0]} | streams identical | first difference | unexplained differences | "
          f"logits rel (max / median) |")
    print("|---|---:|---|---:|---:|")
    for c in configs[1:]:
        if c in failed:
            print(f"| {c} | FAILED | | | |")
            continue
        r = report[c]
        rel = "-" if r["logits_rel_max"] is None else f"{r['logits_rel_max']:.2e} / {r['logits_rel_median']:.2e}"
        print(f"| {c} | {r['streams_identical']}/{r['streams']} | {r['first_difference']} | "
              f"{len(r['unexplained'])} | {rel} |")
    with open(os.path.join(args.out, "tp_compare.json"), "w") as f:
        json.dump({"model": args.model, "load_format": args.load_format, "configs": configs, "failed": failed,
                   "report": report, "describe": {c: runs[c]["describe"] for c in ok}}, f, indent=2, default=str)
    floor_cfg = next((c for c in ok[1:] if parse_config(c)[3]), None)
    limit = args.check
    if args.check_floor is not None:
        if floor_cfg is None or not report[floor_cfg]["logits_rel_max"]:
            print("CHECK FAILED: --check-floor needs a perturbed configuration (tp1p) that moved the logits")
            return 1
        floor = report[floor_cfg]["logits_rel_max"]
        limit = min(limit, args.check_floor * floor) if limit is not None else args.check_floor * floor
        print(f"noise floor ({floor_cfg}): logits rel max {floor:.2e}; bound {limit:.2e}")
    if limit is not None or args.check_floor is not None:
        bad = failed + [c for c, r in report.items() if c != floor_cfg and (r["unexplained"] or (
            limit is not None and r["logits_rel_max"] is not None and r["logits_rel_max"] > limit))]
        if bad:
            print(f"CHECK FAILED: {', '.join(bad)}")
            return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
