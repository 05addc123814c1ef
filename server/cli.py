"""`linrnn-serve [serve] [options]`: start the OpenAI-compatible server (flags follow `vllm serve`).

    linrnn-serve                                   # the embedded default model, GPU if present else CPU
    linrnn-serve --model qwen35moe-nvfp4 --api-key secret --port 8000
    linrnn-serve --model /path/to/checkpoint --served-model-name my-model --max-model-len 32768

The port is bound before the model loads, so a busy port fails at once; the model then loads (a
Hugging Face repo id is downloaded first, with progress) and the server starts answering.
"""
from __future__ import annotations

import argparse
import logging
import math
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("linrnn_server")

API_KEY_ENV = "LINRNN_API_KEY"


def _positive_int(s: str) -> int:
    v = int(s)
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {s}")
    return v


def _fraction(s: str) -> float:
    v = float(s)
    if not 0.0 < v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {s}")
    return v


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from linrnn_serve.presets import describe_presets

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = ("--model accepts a checkpoint directory, a Hugging Face repo id (owner/name, downloaded), or "
                     "a preset:\n" + describe_presets())
    m = parser.add_argument_group("model")
    m.add_argument("--model", default=None, metavar="NAME|PATH|HF_REPO_ID",
                   help="checkpoint directory, Hugging Face repo id, or preset name (default: the embedded "
                        "default model)")
    m.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                   help="name(s) clients use in the 'model' field (default: the model's name); the first is "
                        "reported in responses and metrics")
    m.add_argument("--load-format", choices=("auto", "dummy"), default="auto",
                   help="'dummy': random weights of the real shapes, no weight download")
    m.add_argument("--dtype", choices=("auto", "bfloat16", "float32"), default="auto",
                   help="activation / weight dtype ('auto': bfloat16 on GPU, float32 on CPU)")
    m.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="'auto': the GPU if there is one, else the CPU")
    m.add_argument("--seed", type=int, default=0, help="seed for dummy weights and unseeded requests")

    e = parser.add_argument_group("engine")
    e.add_argument("--max-model-len", type=_positive_int, default=None,
                   help="context length (prompt + output) per request (default: min(model's, 8192))")
    e.add_argument("--max-num-seqs", type=_positive_int, default=64, help="sequences in the running batch")
    e.add_argument("--max-num-batched-tokens", type=_positive_int, default=2048,
                   help="tokens per engine step (chunked-prefill budget)")
    e.add_argument("--max-queue-len", type=_positive_int, default=1024,
                   help="requests waiting for admission; beyond this the server answers 503")
    e.add_argument("--gpu-memory-utilization", type=_fraction, default=0.90,
                   help="fraction of GPU memory for weights, activations and caches")
    e.add_argument("--block-size", type=_positive_int, default=16, help="tokens per paged-KV block")
    e.add_argument("--num-kv-blocks", type=_positive_int, default=None,
                   help="fix the number of KV blocks instead of sizing from memory (testing)")
    e.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    e.add_argument("--tensor-parallel-size", "-tp", type=_positive_int, default=1,
                   help="shard the model over N GPUs (or N CPU processes with --device cpu): one worker process "
                        "per rank")
    e.add_argument("--enable-expert-parallel", action="store_true",
                   help="with -tp N: partition the routed experts over the ranks instead of splitting each one")
    e.add_argument("--ssm-bf16-tau", type=float, default=math.inf, metavar="TAU",
                   help="GDN heads with decay timescale <= TAU keep their recurrent state in bf16 "
                        "(default inf: all f32)")
    e.add_argument("--ssm-calibration", default=None, metavar="TEXT_FILE",
                   help="text for the tier-2 calibration of the f32/bf16 head split")

    s = parser.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces, as vLLM)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /tokenize, /detokenize (or set "
                        f"${API_KEY_ENV})")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM, let in-flight requests finish this long, then abort them")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"), default="info")


def engine_config(args: argparse.Namespace):
    from linrnn_serve.config import EngineConfig

    return EngineConfig(
        model=args.model or "default", load_format=args.load_format, dtype=args.dtype, device=args.device,
        max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=max(args.max_num_batched_tokens, args.max_num_seqs),
        gpu_memory_utilization=args.gpu_memory_utilization, block_size=args.block_size,
        enforce_eager=args.enforce_eager, ssm_bf16_tau=args.ssm_bf16_tau, ssm_calibration=args.ssm_calibration,
        seed=args.seed, max_queue_len=args.max_queue_len,
        served_model_name=args.served_model_name[0] if args.served_model_name else None,
        num_kv_blocks=args.num_kv_blocks, tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel)


def bind_socket(host: str, port: int) -> socket.socket:
    """Bind now (fail fast on a busy port); uvicorn listens on it once the model is loaded."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


class _Stop(Exception):
    """A stop signal after uvicorn's graceful shutdown."""


def _raise_stop(signum, frame):
    raise _Stop()


def run(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level.upper())
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        log.error("%s", e)
        return 1

    try:
        from linrnn_serve.engine.async_engine import AsyncLLMEngine

        engine = AsyncLLMEngine.from_config(engine_config(args))
    except KeyboardInterrupt:
        sock.close()
        return 130
    except (ValueError, RuntimeError, OSError, ImportError) as e:  # bad --model, offline, no GPU, bad config
        sock.close()
        log.debug("engine start failed", exc_info=True)
        log.error("cannot start the engine: %s", e)
        return 1

    import uvicorn

    from linrnn_server.app import build_app

    app = build_app(engine, served_model_names=args.served_model_name, api_key=api_key,
                    shutdown_mode="finish", shutdown_timeout=args.shutdown_timeout)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=max(args.shutdown_timeout, 0.1),
                            access_log=args.log_level == "debug")
    server = uvicorn.Server(config)
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("listening on http://%s:%d (OpenAI API under /v1)", host, sock.getsockname()[1])
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then re-raises the signal to the handler that
    # was installed before it: make that an exception here, so a requested stop exits with status 0
    previous = {sig: signal.signal(sig, _raise_stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    died = _watch_engine(engine, server)
    try:
        server.run(sockets=[sock])
    except _Stop:
        pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if getattr(engine, "is_running", False):  # the lifespan did not get to stop it
            engine.shutdown_sync(timeout=5.0)
        sock.close()
    if died.is_set():
        log.error("exiting: the engine stopped (see the error above)")
        return 1
    return 0 if server.started else 1


ENGINE_DEAD_GRACE_S = 1.0  # requests in flight get their 503 before the server stops


def _watch_engine(engine, server) -> threading.Event:
    """Stop the server when the engine dies on its own (e.g. a tensor-parallel worker was killed): it
    answers 503 meanwhile, then exits with status 1 instead of serving nothing forever."""
    died = threading.Event()

    def watch():
        while not server.should_exit:
            if getattr(engine, "dead", None) is not None:
                died.set()
                time.sleep(ENGINE_DEAD_GRACE_S)
                server.should_exit = True
                return
            time.sleep(0.2)

    threading.Thread(target=watch, name="linrnn-engine-watch", daemon=True).start()
    return died


def main(argv: list[str] | None = None) -> int:  # `python -m linrnn_server.cli`
    parser = argparse.ArgumentParser(prog="linrnn-serve serve")
    add_arguments(parser)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
