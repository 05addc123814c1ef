"""Offline API: `from linrnn_serve import LLM, SamplingParams`; LLM.chat with the template, reasoning and
tool parsing of the server; use_tqdm."""
from __future__ import annotations

import json
from pathlib import Path

from linrnn_serve import LLM, SamplingParams, StructuredOutputsParams
from test_compat_e2e import CODER_CALL, WEATHER, literal

TEMPLATE = str(Path(__file__).parent / "qwen_like_template.jinja")


def test_llm_chat_reasoning_and_tools(capsys):
    llm = LLM("tiny", progress=False, device="cpu", chat_template=TEMPLATE, reasoning_parser="qwen3",
              enable_auto_tool_choice=True, tool_call_parser="qwen3_coder", max_model_len="2k",
              structured_outputs_config={"enable_in_reasoning": True})  # the script below forces the thinking too
    msgs = [{"role": "user", "content": "Weather in Paris?"}]
    forced = SamplingParams(temperature=0, max_tokens=128,
                            structured_outputs=StructuredOutputsParams(regex=literal(CODER_CALL)))
    (out,) = llm.chat(msgs, forced, tools=[WEATHER])
    c = out.outputs[0]
    assert c.text == CODER_CALL and c.reasoning_content == "I will look it up.\n" and c.content is None
    assert c.tool_calls[0]["function"]["name"] == "get_weather"
    assert json.loads(c.tool_calls[0]["function"]["arguments"]) == {"city": "Paris", "days": 3}
    assert out.prompt.endswith("<|im_start|>assistant\n<think>\n")  # the template, in thinking mode
    # a batch of conversations, enable_thinking off through chat_template_kwargs, with the progress bar
    two = llm.chat([msgs, msgs + [{"role": "assistant", "content": "Sunny."}, {"role": "user", "content": "Thanks"}]],
                   SamplingParams(temperature=0, max_tokens=4), chat_template_kwargs={"enable_thinking": False},
                   use_tqdm=True)
    assert len(two) == 2 and all(o.prompt.endswith("</think>\n\n") for o in two)
    assert "generating" in capsys.readouterr().err
