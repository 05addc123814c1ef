"""`linrnn-serve bench {batched,serve,kernels,launches}`."""
from __future__ import annotations

import argparse
import importlib

COMMANDS = {
    "batched": ("linrnn_bench.batched", "in-process batched decode benchmark (llama-batched-bench style)"),
    "serve": ("linrnn_bench.serve", "streaming load generator against an OpenAI-compatible server"),
    "kernels": ("linrnn_bench.kernels.registry", "run the kernel benchmark registry (tests first)"),
    "launches": ("linrnn_bench.launch_count", "count the kernel launches of one decode step (CPU, meta weights)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="bench", required=True)
    for name, (mod, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        try:
            importlib.import_module(mod).add_arguments(p)
        except ModuleNotFoundError as e:  # a benchmark whose module is not written yet
            p.set_defaults(_missing=str(e))


def run(args) -> int:
    if getattr(args, "_missing", None):
        raise SystemExit(f"bench {args.bench} is not available: {args._missing}")
    return importlib.import_module(COMMANDS[args.bench][0]).run(args)
