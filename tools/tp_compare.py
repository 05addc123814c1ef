"""Greedy streams and logits of one model at several parallel configurations, against the first.

    python -m tools.tp_compare --model qwen35moe-nvfp4 --load-format dummy --configs tp1,tp2,ep2 --out /tmp/tp
    python -m tools.tp_compare --model tiny --device cpu --configs tp1,tp2,ep2        # CPU smoke run

Each configuration (tpN: tensor parallel over N ranks, epN: N ranks with expert parallel MoE) runs
in its own process (so the GPUs are free for the next), with a fixed prompt set (random token ids
of a fixed seed, different lengths) decoded greedily for --max-tokens tokens, logging every step's
logits. Prints per configuration: streams identical to the baseline (of how many), the first
position where one differs, and the logits' relative error ||a - b|| / ||b|| per sequence (max and
median over the positions where the streams still agree). Writes <out>/<config>.pt and
<out>/tp_compare.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

import torch


def parse_config(name: str) -> tuple[int, bool]:
    kind, n = name[:2], int(name[2:])
    if kind not in ("tp", "ep") or n < 1:
        raise ValueError(f"configuration {name!r}: tpN or epN")
    return n, kind == "ep"


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(8 + 13 * i)] for i in range(n)]


def run_one(args) -> None:
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.sampling_params import SamplingParams

    tp, ep = parse_config(args.one)
    eng = LLMEngine.from_engine_args(args.model, load_format=args.load_format, device=args.device,
                                     tensor_parallel_size=tp, enable_expert_parallel=ep, max_num_seqs=args.num_prompts,
                                     max_model_len=512, seed=args.seed, progress=False)
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
    torch.save({"tokens": [toks[i] for i in range(len(ps))], "logits": logits, "describe": eng.executor.describe()},
               os.path.join(args.out, f"{args.one}.pt"))
    eng.shutdown()


def compare(base: dict, other: dict) -> dict:
    same, first_diff, errs = 0, [], []
    for i, (a, b) in enumerate(zip(other["tokens"], base["tokens"])):
        n = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), len(b))
        same += n == len(b)
        first_diff.append(None if n == len(b) else n)
        for j in range(n):  # logits of positions whose inputs still agree
            la, lb = other["logits"][i][j], base["logits"][i][j]
            errs.append(((la - lb).norm() / lb.norm()).item())
    errs.sort()
    return {"streams_identical": same, "streams": len(base["tokens"]), "first_difference": first_diff,
            "logits_rel_max": max(errs) if errs else None, "logits_rel_median": errs[len(errs) // 2] if errs else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.tp_compare")
    p.add_argument("--model", default="qwen35moe-nvfp4")
    p.add_argument("--load-format", default="dummy")
    p.add_argument("--device", default="auto")
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
    for c in configs:
        parse_config(c)
        cmd = [sys.executable, "-m", "tools.tp_compare", *(argv if argv is not None else sys.argv[1:]), "--one", c]
        if subprocess.run(cmd).returncode != 0:
            print(f"{c}: FAILED (see above)")
            return 1
    runs = {c: torch.load(os.path.join(args.out, f"{c}.pt")) for c in configs}
    report = {c: compare(runs[configs[0]], runs[c]) for c in configs[1:]}
    print(f"| config vs {configs[0]} | streams identical | first difference | logits rel (max / median) |")
    print("|---|---:|---|---:|")
    for c, r in report.items():
        rel = "-" if r["logits_rel_max"] is None else f"{r['logits_rel_max']:.2e} / {r['logits_rel_median']:.2e}"
        print(f"| {c} | {r['streams_identical']}/{r['streams']} | {r['first_difference']} | {rel} |")
    with open(os.path.join(args.out, "tp_compare.json"), "w") as f:
        json.dump({"model": args.model, "load_format": args.load_format, "configs": configs, "report": report,
                   "describe": {c: runs[c]["describe"] for c in configs}}, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
