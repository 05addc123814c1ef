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
import os
import signal
import socket
import sys
import threading
import time

log = logging.getLogger("linrnn_server")

API_KEY_ENV = "LINRNN_API_KEY"


def _port(s: str) -> int:
    v = int(s)
    if not 0 <= v <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {s}")
    return v


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from linrnn_serve.engine_args import EngineArgs, _positive_int
    from linrnn_serve.presets import describe_presets
    from linrnn_server.serving import DEFAULT_MAX_REQUEST_BYTES

    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.usage = "%(prog)s [MODEL] [options]"
    parser.epilog = ("MODEL (positional, as `vllm serve MODEL`, or --model) is a checkpoint directory, a Hugging Face "
                     "repo id (owner/name, downloaded), or a preset:\n" + describe_presets())
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="the model to serve (same as --model)")
    EngineArgs.add_cli_args(parser)

    s = parser.add_argument_group("server")
    s.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces, as vLLM)")
    s.add_argument("--port", type=_port, default=8000)
    s.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on /v1 and /tokenize, /detokenize (or set "
                        f"${API_KEY_ENV})")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGINT/SIGTERM: new requests get 503, in-flight ones may finish, and those still "
                        "running 1.5 s before this timeout end with finish_reason 'abort' and [DONE]; the "
                        "process exits within it. A second signal exits at once")
    s.add_argument("--default-max-tokens", type=_positive_int, default=None, metavar="N",
                   help="requests that set no max_tokens (chat, or completions with max_tokens null) generate "
                        "at most N tokens (default: up to the context limit, max_model_len - prompt tokens, "
                        "as vLLM)")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES, metavar="BYTES",
                   help="larger request bodies get 413 (default 32 MiB; 0: no limit)")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="this server's log level")
    s.add_argument("--uvicorn-log-level", choices=LOG_LEVELS + ("trace",), default=None,
                   help="uvicorn's log level (default: --log-level)")
    s.add_argument("--disable-log-requests", action="store_true",
                   help="do not log one line per request (id, prompt length, sampling parameters)")
    s.add_argument("--enable-log-requests", action="store_true",
                   help="log one line per request (the default; vLLM's newer spelling)")
    s.add_argument("--disable-log-stats", action="store_true",
                   help="do not log engine throughput / queue / cache statistics every --stats-interval seconds")
    s.add_argument("--stats-interval", type=float, default=10.0, metavar="SECONDS",
                   help="seconds between statistics log lines")


def engine_args(args: argparse.Namespace):
    """EngineArgs of the parsed flags; the positional MODEL and --model are the same thing."""
    from linrnn_serve.engine_args import EngineArgs

    tag = getattr(args, "model_tag", None)
    if tag is not None:
        if args.model not in (None, "default", tag):
            raise ValueError(f"the model is given twice: positional {tag!r} and --model {args.model!r}")
        args.model = tag
    return EngineArgs.from_cli_args(args)


def engine_config(args: argparse.Namespace):
    return engine_args(args).create_engine_config()


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


def draining_server(config, state, drain_timeout: float):
    """A uvicorn.Server whose first SIGINT / SIGTERM drains the app (ServerState.drain: 503 for new
    requests, in-flight ones finish or are aborted with a final chunk) before uvicorn's own shutdown,
    and whose second signal exits the process at once."""
    import asyncio

    import uvicorn

    class DrainingServer(uvicorn.Server):
        _loop = None
        _signalled = False

        async def startup(self, sockets=None):
            self._loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        def handle_exit(self, sig, frame):
            if self._signalled:
                log.warning("second %s: exiting now", signal.Signals(sig).name)
                logging.shutdown()
                os._exit(1)
            self._signalled = True
            if self._loop is None or not self.started:  # still starting: nothing to drain
                self.should_exit = True
                return
            log.info("%s: draining (up to %.1f s; a second signal exits at once)", signal.Signals(sig).name,
                     drain_timeout)
            self._loop.call_soon_threadsafe(lambda: self._loop.create_task(self._drain()))

        async def _drain(self):
            try:
                await state.drain(drain_timeout)
            finally:
                self.should_exit = True

    return DrainingServer(config)


def run(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(args.log_level.upper())
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    try:
        config = engine_config(args)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if args.trust_remote_code:
        log.info("--trust-remote-code: no remote code is run here (the architectures are built in)")
    try:
        sock = bind_socket(args.host, args.port)
    except OSError as e:
        log.error("%s", e)
        return 1

    try:
        from linrnn_serve.engine.core_client import start_engine_client

        # the engine core in its own process (LINRNN_ENABLE_MULTIPROCESSING=0: in this one)
        engine = start_engine_client(config, log_level=logging.getLogger().getEffectiveLevel())
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
                    shutdown_mode="abort", shutdown_timeout=1.0, max_request_bytes=args.max_request_bytes,
                    default_max_tokens=args.default_max_tokens, log_requests=not args.disable_log_requests,
                    stats_interval=None if args.disable_log_stats else args.stats_interval)
    uv_level = args.uvicorn_log_level or args.log_level
    # the drain has ended every request before uvicorn's shutdown starts: its grace period only
    # covers the last bytes of each response
    uv_config = uvicorn.Config(app, log_level=uv_level, timeout_graceful_shutdown=1,
                               access_log=uv_level in ("debug", "trace"))
    server = draining_server(uv_config, app.state.server, max(args.shutdown_timeout, 0.0))
    host = f"[{args.host}]" if ":" in args.host else args.host
    log.info("listening on http://%s:%d (OpenAI API under /v1)", host, sock.getsockname()[1])
    died = _watch_engine(engine, server)
    freeze_startup_heap()
    try:
        server.run(sockets=[sock])
    finally:
        # stops the engine if the lifespan did not get to; else waits for its loop (and worker
        # processes) to finish, before the os._exit below
        engine.shutdown_sync(timeout=5.0)
        sock.close()
    if died.is_set():
        log.error("exiting: the engine stopped (see the error above)")
        return 1
    rc = 0 if server.started else 1
    if server.started:
        # every request has ended and the engine has stopped: skip the interpreter's teardown of torch
        # and the model (seconds on a busy CPU), so the process exits within --shutdown-timeout
        log.info("stopped")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc



def freeze_startup_heap() -> None:
    """Move every object alive after start-up (the tokenizer's Python tables, FastAPI, pydantic models, with
    the in-process engine also torch and the model) out of the collector's reach, as the engine core does:
    a full collection over them stalls the event loop for 100-200 ms (measured on the CPU under a c = 64
    wave, benchmarks/wave.py), which delays every stream and the next wave's requests."""
    import gc

    gc.collect()
    gc.freeze()

ENGINE_DEAD_GRACE_S = 1.0  # requests in flight get their 503 before the server stops


def _watch_engine(engine, server) -> threading.Event:
    """Stop the server when the engine dies on its own (e.g. a tensor-parallel worker was killed): it
    answers 503 meanwhile, then exits with status 1 instead of serving nothing forever."""
    died = threading.Event()

    def watch():
        while not server.should_exit:
            # the engine stopped without being asked to (a requested stop sets should_exit first)
            if not getattr(engine, "is_running", True) and not server.should_exit:
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
