"""`linrnn-serve` console script. With no subcommand it serves (like `vllm serve`):
`linrnn-serve MODEL`, `linrnn-serve serve MODEL` and `linrnn-serve --model MODEL` are the same.

Each subcommand lives with the code it drives and exposes `add_arguments(parser)` and
`run(args) -> int`; they are imported lazily so `linrnn-serve synth` never imports the server.
User errors a subcommand raises (a missing or unsuitable input, an existing output directory, a
file it cannot read or write: the `USER_ERRORS` classes) print as one line,
`linrnn-serve CMD: error: ...`, with exit status 2, as argparse does for bad flags; anything else
is a bug and keeps its traceback.
This module is the top of the import graph (it may import server and benchmarks).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

SUBCOMMANDS = {
    "serve": ("linrnn_server.cli", "start the OpenAI-compatible server (default)"),
    "synth": ("linrnn_serve.checkpoint.synth", "write a synthetic HF-format checkpoint"),
    "quantize": ("linrnn_serve.checkpoint.quantize", "quantize a bf16 checkpoint to NVFP4"),
    "bench": ("linrnn_bench.cli", "benchmarks: batched decode, serving load, kernels"),
    "kl-gate": ("linrnn_bench.kl_gate", "KL-divergence fidelity gate between two configurations"),
}


def _usage() -> str:
    lines = ["usage: linrnn-serve [SUBCOMMAND] [options]", "", "subcommands:"]
    lines += [f"  {name:<10} {help_}" for name, (_, help_) in SUBCOMMANDS.items()]
    lines += ["", "With no subcommand, `serve` runs. `linrnn-serve SUBCOMMAND --help` for options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        print()
        _parser("serve").print_help()  # `linrnn-serve --help` shows the serve options, as `vllm serve --help`
        return 0
    if argv and argv[0] == "--version":
        from importlib.metadata import version

        print(version("linrnn-serve"))
        return 0
    cmd = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "serve"
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser, module = _parser(cmd, with_module=True)
    args = parser.parse_args(argv)
    try:
        return int(module.run(args) or 0)
    except user_errors() as e:
        print(f"linrnn-serve {cmd}: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2


def user_errors() -> tuple[type[BaseException], ...]:
    """Exceptions that mean "the user asked for something impossible", not "the program is broken"."""
    from linrnn_serve.checkpoint.errors import CheckpointError
    from linrnn_serve.config import ConfigError
    from linrnn_serve.engine.tokenizer import TokenizerError
    from linrnn_serve.presets import ModelResolutionError

    return (CheckpointError, ConfigError, TokenizerError, ModelResolutionError, FileNotFoundError,
            FileExistsError, NotADirectoryError, IsADirectoryError, PermissionError)


def _parser(cmd: str, with_module: bool = False):
    module = importlib.import_module(SUBCOMMANDS[cmd][0])
    parser = argparse.ArgumentParser(prog=f"linrnn-serve {cmd}", description=SUBCOMMANDS[cmd][1])
    module.add_arguments(parser)
    return (parser, module) if with_module else parser


if __name__ == "__main__":
    sys.exit(main())
