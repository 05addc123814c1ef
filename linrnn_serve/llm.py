"""Offline batch inference, vLLM style:

    from linrnn_serve.llm import LLM, SamplingParams
    llm = LLM("qwen35moe-nvfp4", load_format="dummy", max_num_seqs=64)
    outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

Prompts may be a string, a list of strings, one token-id list or a list of token-id lists.
`sampling_params` is one SamplingParams for all prompts or a list with one per prompt.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from linrnn_serve.engine_args import EngineArgs
from linrnn_serve.engine.llm_engine import LLMEngine
from linrnn_serve.engine.outputs import CompletionOutput, RequestOutput
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

    def generate(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
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
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[r] for r in order]


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
