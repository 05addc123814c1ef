"""Offline batch inference, vLLM style:

    from linrnn_serve import LLM, SamplingParams
    llm = LLM("qwen35moe-nvfp4", load_format="dummy", max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

Prompts may be a string, a list of strings, one token-id list or a list of token-id lists.
`sampling_params` is one SamplingParams for all prompts or a list with one per prompt.

    outs = llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=64), tools=[...],
                    chat_template_kwargs={"enable_thinking": False})
    outs[0].outputs[0].text, .reasoning_content, .content, .tool_calls    # parsed as the server does

`chat` renders the messages with the chat template (LLM(chat_template=...) or the call's
`chat_template`, else the checkpoint's own), passes `tools` and `chat_template_kwargs` to it and, with
LLM(reasoning_parser=..., tool_call_parser=...), splits each output into reasoning / content / tool
calls like the HTTP server. `use_tqdm` shows a progress bar over requests (default on, as vLLM).
"""
from __future__ import annotations

import dataclasses
import itertools
import json
from typing import Sequence

from linrnn_serve.engine_args import EngineArgs
from linrnn_serve.engine.llm_engine import LLMEngine
from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
from linrnn_serve.engine.tokenizer import resolve_chat_template
from linrnn_serve.parsers import ChatOutputParser
from linrnn_serve.parsers.reasoning import gate_constraint
from linrnn_serve.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]


class LLM:
    def __init__(self, model: str = "default", progress: bool = True, **engine_args):
        """`engine_args`: any EngineArgs field (the serve CLI's flags, underscored: max_model_len="4k",
        tensor_parallel_size=1, chat_template=..., reasoning_parser="qwen3", ...)."""
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args).create_engine_config(), progress=progress)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the generation-config defaults (--generation-config), as vLLM."""
        return SamplingParams(**self.engine.default_sampling_params)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, use_tqdm: bool = True,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation (a list of messages) or several (a list of lists)."""
        tok = self.engine.tokenizer
        if tok is None:
            raise ValueError("this model has no tokenizer, so no chat template")
        convs = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        cfg = self.engine.config
        template = resolve_chat_template(chat_template if chat_template is not None else cfg.chat_template)
        kwargs = dict(chat_template_kwargs or {})
        texts = [tok.apply_chat_template(_template_messages(c), add_generation_prompt=add_generation_prompt,
                                         continue_final_message=continue_final_message, tools=tools or None,
                                         chat_template=template, **kwargs) for c in convs]
        prompts = [tok.encode(t, add_special_tokens=False) for t in texts]
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        # a constraint waits for the end of the reasoning, as in the server (parsers.reasoning.gate_constraint)
        per = [sampling_params] * len(texts) if isinstance(sampling_params, SamplingParams) else list(sampling_params)
        if len(per) == len(texts):  # else generate() says the counts differ
            sampling_params = [dataclasses.replace(p, structured_outputs=gate_constraint(
                p.structured_outputs, cfg.reasoning_parser, t, cfg.structured_outputs_enable_in_reasoning))
                if p.structured_outputs is not None else p for p, t in zip(per, texts)]
        outs = self.generate(prompts, sampling_params, use_tqdm=use_tqdm)
        tool_parser = cfg.tool_call_parser if tools and cfg.enable_auto_tool_choice else None
        if cfg.reasoning_parser or tool_parser:
            for text, ro in zip(texts, outs):
                ro.prompt = text
                for c in ro.outputs:
                    r, content, calls = ChatOutputParser(cfg.reasoning_parser, tool_parser, tools, text).parse(c.text)
                    c.reasoning_content, c.content, c.tool_calls = r, content, [x.to_openai() for x in calls]
        return outs

    def generate(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        prompts = _normalize_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} sampling params for {len(prompts)} prompts")
        eng = self.engine
        order, final = [], {}
        pending = list(zip(prompts, params))
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm

            bar = tqdm(total=len(prompts), desc="generating", unit="req")
        # feed the queue as it drains (max_queue_len bounds the waiting queue)
        while pending or eng.has_unfinished_requests():
            while pending and eng.scheduler.num_waiting_requests < eng.config.max_queue_len:
                prompt, p = pending.pop(0)
                rid = f"llm-{next(self._ids)}"
                order.append(rid)
                eng.add_request(rid, prompt, p)
            for req in eng.step_requests():  # cumulative outputs of the finished requests only
                if req.finished:
                    final[req.request_id] = eng.output(req)
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in order]


def _template_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style messages for a chat template: tool-call arguments (JSON strings) parsed to dicts."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            calls = []
            for tc in m["tool_calls"]:
                fn = tc.get("function") or {}
                if isinstance(fn.get("arguments"), str):
                    try:
                        tc = {**tc, "function": {**fn, "arguments": json.loads(fn["arguments"] or "{}")}}
                    except json.JSONDecodeError:
                        pass
                calls.append(tc)
            m["tool_calls"] = calls
        out.append(m)
    return out


def _normalize_prompts(prompts) -> list[str | list[int]]:
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and all(isinstance(t, int) for t in prompts):
        return [prompts]
    for p in prompts:
        if not isinstance(p, str) and not (isinstance(p, (list, tuple)) and all(isinstance(t, int) for t in p)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(p).__name__}")
    return [p if isinstance(p, str) else list(p) for p in prompts]
