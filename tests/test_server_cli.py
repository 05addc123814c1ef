"""`linrnn-serve serve` arguments: flags -> EngineConfig, and clear failures before any model loads."""
from __future__ import annotations

import argparse
import logging
import math
import socket

import pytest

from linrnn_server import cli


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def test_defaults_serve_the_default_model_on_any_device():
    args = parse()
    cfg = cli.engine_config(args)
    assert cfg.model == "default" and cfg.device == "auto" and cfg.dtype == "auto" and cfg.load_format == "auto"
    assert cfg.max_num_seqs == 64 and math.isinf(cfg.ssm_bf16_tau) and not cfg.enforce_eager
    assert args.host == "0.0.0.0" and args.port == 8000 and args.api_key is None


def test_flags_map_to_engine_config():
    args = parse("--model", "qwen35moe-nvfp4", "--load-format", "dummy", "--served-model-name", "a", "b",
                 "--max-model-len", "4096", "--max-num-seqs", "8", "--gpu-memory-utilization", "0.5",
                 "--enforce-eager", "--ssm-bf16-tau", "32", "--dtype", "bfloat16", "--device", "cuda",
                 "--max-queue-len", "7", "--api-key", "k")
    cfg = cli.engine_config(args)
    assert (cfg.model, cfg.load_format, cfg.served_model_name) == ("qwen35moe-nvfp4", "dummy", "a")
    assert (cfg.max_model_len, cfg.max_num_seqs, cfg.gpu_memory_utilization) == (4096, 8, 0.5)
    assert cfg.enforce_eager and cfg.ssm_bf16_tau == 32.0 and cfg.dtype == "bfloat16" and cfg.device == "cuda"
    assert cfg.max_queue_len == 7 and args.served_model_name == ["a", "b"] and args.api_key == "k"


@pytest.mark.parametrize("argv", [["--device", "tpu"], ["--load-format", "pt"], ["--max-num-seqs", "0"],
                                  ["--gpu-memory-utilization", "1.5"], ["--port", "70000"]])
def test_bad_flags_are_refused(argv):
    with pytest.raises(SystemExit):
        parse(*argv)


def test_unknown_model_fails_clearly(caplog):
    with caplog.at_level(logging.ERROR):
        rc = cli.run(parse("--model", "no-such-model-xyz", "--host", "127.0.0.1", "--port", "0"))
    assert rc == 1 and "no-such-model-xyz" in caplog.text and "preset" in caplog.text


def test_busy_port_fails_before_loading(caplog):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with caplog.at_level(logging.ERROR):
            rc = cli.run(parse("--model", "no-such-model-xyz", "--host", "127.0.0.1", "--port", str(port)))
    assert rc == 1 and f"cannot listen on 127.0.0.1:{port}" in caplog.text


def test_the_server_freezes_its_start_up_heap_before_serving(monkeypatch):
    """Every object alive at start-up leaves the collector's reach before uvicorn serves: a full collection over
    them stalled the event loop for 100-200 ms under a c = 64 wave (benchmarks/wave.py)."""
    import gc
    import threading

    import linrnn_serve.engine.core_client as core_client
    import linrnn_server.app as app_mod

    class Engine:
        def shutdown_sync(self, timeout):
            pass

    class Server:
        started = False

        def run(self, sockets):
            self.frozen = gc.get_freeze_count()

    server = Server()
    monkeypatch.setattr(core_client, "start_engine_client", lambda config, log_level: Engine())
    monkeypatch.setattr(app_mod, "build_app", lambda engine, **kw: argparse.Namespace(state=argparse.Namespace(
        server=None)))
    monkeypatch.setattr(cli, "draining_server", lambda config, state, timeout: server)
    monkeypatch.setattr(cli, "_watch_engine", lambda engine, srv: threading.Event())
    junk = [[i] for i in range(1000)]  # start-up objects
    gc.unfreeze()
    try:
        assert cli.run(parse("--host", "127.0.0.1", "--port", "0")) == 1  # (the fake server never started)
        assert server.frozen >= len(junk)
    finally:
        gc.unfreeze()
