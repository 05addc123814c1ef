"""vLLM-compatible CLI (issue #17 item 5): one EngineArgs definition behind `linrnn-serve [serve] MODEL`,
`linrnn-serve bench batched` and `LLM(...)`; every vLLM flag we accept maps somewhere or says why not."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from linrnn_serve.engine_args import EngineArgs, human_int
from linrnn_serve.generation_config import default_sampling_params
from linrnn_server import cli


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    cli.add_arguments(p)
    return p.parse_args(list(argv))


def config(*argv: str):
    return cli.engine_config(parse(*argv))


def test_positional_model_is_the_model_flag():
    assert config("qwen35moe-nvfp4").model == config("--model", "qwen35moe-nvfp4").model == "qwen35moe-nvfp4"
    assert config().model == "default"
    with pytest.raises(ValueError, match="given twice"):
        config("tiny", "--model", "qwen35moe-nvfp4")


@pytest.mark.parametrize("text,want", [("4k", 4000), ("4K", 4096), ("1m", 10**6), ("1M", 2**20), ("25.6k", 25600),
                                       ("32768", 32768)])
def test_max_model_len_suffixes(text, want):
    assert human_int(text) == want
    assert config("--max-model-len", text).max_model_len == want


def test_max_model_len_auto_and_bad():
    assert config("--max-model-len", "auto").max_model_len is None
    assert config("--max-model-len", "-1").max_model_len is None
    for bad in ("4x", "1.5K", "1"):
        with pytest.raises(SystemExit):
            parse("--max-model-len", bad)


def test_tensor_parallel_size():
    assert config("--tensor-parallel-size", "1").tensor_parallel_size == 1
    assert config("-tp", "1").tensor_parallel_size == 1
    c = config("-tp", "2", "--enable-expert-parallel")
    assert c.tensor_parallel_size == 2 and c.enable_expert_parallel


def test_prefix_and_chunked_prefill_flags():
    assert config("--enable-prefix-caching").enable_prefix_caching is True
    assert config("--no-enable-prefix-caching").enable_prefix_caching is False
    assert config("--enable-chunked-prefill").max_num_batched_tokens is None  # the engine picks it per device
    assert config("--max-num-batched-tokens", "8k").max_num_batched_tokens == 8000
    with pytest.raises(ValueError, match="always chunked"):
        config("--no-enable-chunked-prefill")


@pytest.mark.parametrize("flag,want", [("half", "float16"), ("float16", "float16"), ("float", "float32"),
                                       ("bfloat16", "bfloat16"), ("auto", "auto")])
def test_dtype_aliases(flag, want):
    assert config("--dtype", flag).dtype == want


def test_kv_cache_dtype():
    assert config("--kv-cache-dtype", "auto").model == "default"
    assert config("--dtype", "bfloat16", "--kv-cache-dtype", "bfloat16").dtype == "bfloat16"
    with pytest.raises(ValueError, match="fp8 KV cache is not implemented"):
        config("--kv-cache-dtype", "fp8")
    with pytest.raises(SystemExit):
        parse("--kv-cache-dtype", "int3")


def test_frontend_and_misc_flags(tmp_path):
    t = tmp_path / "t.jinja"
    t.write_text("{{ messages[0]['content'] }}")
    c = config("--chat-template", str(t), "--reasoning-parser", "qwen3", "--enable-auto-tool-choice",
               "--tool-call-parser", "qwen3_coder", "--max-logprobs", "5", "--trust-remote-code",
               "--generation-config", "vllm", "--override-generation-config", '{"temperature": 0.5}')
    assert (c.chat_template, c.reasoning_parser, c.tool_call_parser) == (str(t), "qwen3", "qwen3_coder")
    assert c.enable_auto_tool_choice and c.max_logprobs == 5 and c.generation_config == "vllm"
    assert c.override_generation_config == {"temperature": 0.5}
    with pytest.raises(ValueError, match="needs --tool-call-parser"):
        config("--enable-auto-tool-choice")
    a = parse("--disable-log-requests", "--disable-log-stats", "--uvicorn-log-level", "warning")
    assert a.disable_log_requests and a.disable_log_stats and a.uvicorn_log_level == "warning"
    with pytest.raises(SystemExit):
        parse("--uvicorn-log-level", "loud")


def test_unsupported_vllm_flag_says_why():
    with pytest.raises(ValueError, match=r"--speculative-config is not supported: speculative decoding"):
        config("--speculative-config", '{"method": "ngram"}')
    with pytest.raises(ValueError, match="--quantization is not supported: the quantization format is read"):
        config("--quantization", "modelopt")


def test_unsupported_flag_exits_with_one_line(capfd):
    rc = cli.run(parse("--pipeline-parallel-size", "2", "--host", "127.0.0.1", "--port", "0"))
    assert rc == 2


def test_llm_constructor_and_bench_share_engine_args():
    c = EngineArgs(model="tiny", max_model_len="4k", served_model_name="x").create_engine_config()
    assert c.max_model_len == 4000 and c.served_model_name == "x"
    from linrnn_bench import batched

    p = argparse.ArgumentParser()
    batched.add_arguments(p)
    a = p.parse_args(["--model", "tiny,default", "--ssm-bf16-tau", "inf,16", "-tp", "1", "--kv-cache-dtype", "auto",
                      "--max-model-len", "2k"])
    assert a.model == "tiny,default" and a.max_model_len == 2000 and a.tensor_parallel_size == 1


def test_serve_bench_and_llm_take_every_engine_arg():
    """One definition (EngineArgs): every engine flag is a `serve` flag and a `bench batched` flag (but the
    few bench leaves out on purpose), and LLM / LLMEngine.from_engine_args build their config through it."""
    import dataclasses
    import inspect

    from linrnn_bench import batched
    from linrnn_serve.engine.async_engine import AsyncLLMEngine
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.llm import LLM

    names = {f.name for f in dataclasses.fields(EngineArgs) if f.metadata.get("cli") is not False}
    serve = argparse.ArgumentParser()
    cli.add_arguments(serve)
    bench = argparse.ArgumentParser()
    batched.add_arguments(bench)
    assert names <= {a.dest for a in serve._actions}
    assert names - set(batched.BENCH_SKIPPED_ENGINE_ARGS) <= {a.dest for a in bench._actions}
    for ctor in (LLM.__init__, LLMEngine.from_engine_args, AsyncLLMEngine.from_engine_args):
        assert "EngineArgs(model=model, **" in inspect.getsource(ctor), ctor


def test_generation_config_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_new_tokens": 77, "eos_token_id": [1]}))
    d = default_sampling_params("auto", str(tmp_path))
    assert d == {"temperature": 0.6, "top_p": 0.95, "top_k": 20, "max_tokens": 77}
    assert default_sampling_params("vllm", str(tmp_path)) == {}
    assert default_sampling_params(str(tmp_path), None)["top_k"] == 20
    assert default_sampling_params("auto", str(tmp_path), {"temperature": 0.1})["temperature"] == 0.1
    with pytest.raises(ValueError):
        default_sampling_params("/no/such/dir", None)


def test_generation_config_fills_unset_request_fields():
    from linrnn_server.protocol import ChatCompletionRequest
    from linrnn_server.serving import sampling_params

    class Eng:
        default_sampling_params = {"temperature": 0.6, "top_k": 20, "max_tokens": 50}
        max_logprobs = 20

    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], "top_k": 5})
    p = sampling_params(req, None, None, engine=Eng())
    assert (p.temperature, p.top_k, p.max_tokens) == (0.6, 5, 50)


def test_max_logprobs_is_enforced():
    from linrnn_serve.sampling_params import SamplingParamError, SamplingParams

    SamplingParams(logprobs=20).validate()
    with pytest.raises(SamplingParamError):
        SamplingParams(logprobs=6).validate(max_logprobs=5)


def test_help_shows_serve_options():
    out = subprocess.run([sys.executable, "-m", "linrnn_serve", "--help"], capture_output=True, text=True)
    assert out.returncode == 0
    for flag in ("--tensor-parallel-size", "--enable-prefix-caching", "--chat-template", "--generation-config",
                 "--reasoning-parser", "--max-model-len", "MODEL"):
        assert flag in out.stdout


def test_max_model_len_above_the_model_limit_is_refused(monkeypatch):
    from linrnn_serve.engine.llm_engine import LLMEngine

    monkeypatch.delenv("LINRNN_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    with pytest.raises(ValueError, match="exceeds the model's limit.*LINRNN_ALLOW_LONG_MAX_MODEL_LEN=1"):
        LLMEngine(EngineArgs(model="tiny", max_model_len="1M", device="cpu").create_engine_config(), progress=False)


def test_every_way_of_naming_the_model_serves_the_same(monkeypatch):
    """`linrnn-serve X`, `linrnn-serve --model X`, `linrnn-serve serve X`, `linrnn-serve serve --model X`
    (through the console script's dispatch) give the same engine and server settings."""
    from linrnn_serve import cli as top

    got = []
    monkeypatch.setattr(cli, "run", lambda args: got.append((cli.engine_config(args), vars(args))) or 0)
    flags = ["--max-model-len", "4k", "-tp", "1", "--dtype", "half", "--disable-log-stats"]
    for argv in (["tiny"], ["--model", "tiny"], ["serve", "tiny"], ["serve", "--model", "tiny"]):
        assert top.main(argv + flags) == 0
    configs = [c for c, _ in got]
    assert len(configs) == 4 and all(c == configs[0] for c in configs)
    assert configs[0].model == "tiny" and configs[0].max_model_len == 4000 and configs[0].dtype == "float16"
    # the server's own flags too; the model arrives as the positional MODEL or as --model
    ns = [{k: v for k, v in a.items() if k not in ("model", "model_tag")} for _, a in got]
    assert all(n == ns[0] for n in ns) and [a["model_tag"] or a["model"] for _, a in got] == ["tiny"] * 4


def test_structured_outputs_config():
    assert config().structured_outputs_enable_in_reasoning is False
    c = config("--structured-outputs-config", '{"backend": "xgrammar", "enable_in_reasoning": true}')
    assert c.structured_outputs_enable_in_reasoning is True
    with pytest.raises(ValueError, match="backend 'outlines' is not available"):
        config("--structured-outputs-config", '{"backend": "outlines"}')
    with pytest.raises(ValueError, match=r"keys \['disable_fallback'\] are not supported"):
        config("--structured-outputs-config", '{"disable_fallback": true}')
    with pytest.raises(SystemExit):
        parse("--structured-outputs-config", "[1]")
