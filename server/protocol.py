"""OpenAI-compatible request and response models (field names as in the OpenAI API reference and the
`openai` client's types; vLLM-style extras where noted).

Requests are strict about types (no string -> number coercion): a wrong type names the field. Unknown
top-level fields of the generation requests are accepted and named in a logged warning (vLLM's rule);
nested objects stay strict ("Unrecognized request argument supplied: <name>"). Documented OpenAI
fields that this server cannot honour are accepted only at their neutral value (see `_NEUTRAL`), so a
client that sends `best_of: 1` still works, while one that asks for audio gets a 400 instead of
silently different behaviour.
"""
from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer

from linrnn_server.errors import bad_request, unsupported


class RequestModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    def warn_unknown(self, log) -> None:
        """Top-level fields this server does not know are accepted and named in a warning (vLLM's rule)."""
        extra = sorted((self.model_extra or {}).keys())
        if extra:
            log.warning("ignoring unknown request field(s): %s", ", ".join(extra))

    # union-typed fields -> what they accept, for error messages (errors.from_validation_error)
    TYPE_HINTS: ClassVar[dict[str, str]] = {}


class StreamOptions(RequestModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False  # vLLM extra: usage on every chunk
    include_obfuscation: bool | None = None  # OpenAI field; no obfuscation padding is sent


_STOP_HINT = "a string, an array of up to 16 strings, or null"

# field -> values that mean "feature not used"; anything else is refused as unsupported
_NEUTRAL: dict[str, tuple] = {
    "best_of": (None, 1),
    "suffix": (None, ""),
    "functions": (None, []),
    "function_call": (None, "none", "auto"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None,),
}


class _SamplingFields(RequestModel):
    """Fields shared by /v1/completions and /v1/chat/completions. Unknown top-level fields are accepted
    with a logged warning (as vLLM); nested objects stay strict."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # optional (vLLM): the served model when omitted
    n: int | None = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, not used
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # structured output: OpenAI's response_format, vLLM's structured_outputs and the older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted: xgrammar is the one backend
    guided_whitespace_pattern: str | None = None  # accepted, not used (compact JSON)
    # more vLLM extras
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    return_tokens_as_token_ids: bool | None = None
    priority: int | None = None  # accepted; scheduling is first come, first served
    request_id: str | None = None
    cache_salt: str | None = None
    spaces_between_special_tokens: bool | None = None

    def check_neutral(self) -> None:
        for name, ok in _NEUTRAL.items():
            if name in type(self).model_fields:
                v = getattr(self, name)
                if name == "best_of" and v == self.num_samples:
                    continue
                if v not in ok:
                    raise unsupported(name, f"'{name}' = {v!r} is not supported by this server "
                                            f"(accepted: {', '.join(repr(x) for x in ok)})")
        if self.stream_options is not None and not self.stream:
            raise bad_request("'stream_options' is only allowed when 'stream' is true", "stream_options")

    @property
    def num_samples(self) -> int:
        return 1 if self.n is None else self.n

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_SamplingFields):
    # token ids before strings: pydantic's smart union stops at the first exact match, and a 4k-id prompt
    # tried as list[str] first collects an error per id (7x the validation time)
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    TYPE_HINTS = {"prompt": "a string, an array of strings, an array of token ids, or an array of "
                            "token-id arrays", "stop": _STOP_HINT, "guided_json": "an object or a string"}


class ContentPart(RequestModel):
    model_config = ConfigDict(extra="allow", strict=True)  # image_url etc. are refused by type below
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # what reasoning models return; templates may use it

    def text(self) -> str | None:
        if self.content is None or isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise unsupported("messages", f"content part type {part.type!r} is not supported "
                                              "(only text parts)")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # accepted and ignored (metadata of the request, no effect on generation)
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    reasoning_effort: str | None = None  # given to the chat template
    chat_template: str | None = None  # vLLM extra: this request's template
    documents: list[dict[str, Any]] | None = None
    # accepted only at their neutral value (_NEUTRAL)
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    web_search_options: dict[str, Any] | None = None
    verbosity: str | None = None
    # vLLM extras for the chat template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    TYPE_HINTS = {"stop": _STOP_HINT, "tool_choice": "a string or an object",
                  "function_call": "a string or an object", "guided_json": "an object or a string"}

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class TokenizeRequest(RequestModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(RequestModel):
    model: str | None = None
    tokens: list[int]


# ---- responses ---------------------------------------------------------------------------
class ResponseModel(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(ResponseModel):
    cached_tokens: int = 0  # prompt tokens served by the prefix cache


class UsageInfo(ResponseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None  # set when the prefix cache served some

    @model_serializer(mode="wrap")
    def _omit_empty_details(self, handler):
        out = handler(self)
        if out.get("prompt_tokens_details") is None:
            out.pop("prompt_tokens_details", None)
        return out


class CompletionLogprobs(ResponseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(ResponseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM extra: the stop string / token id that ended it


class CompletionResponse(ResponseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extra


class TopLogprob(ResponseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(ResponseModel):
    content: list[TokenLogprob] | None = None
    refusal: list[TokenLogprob] | None = None


class AssistantMessage(ResponseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)
    reasoning_content: str | None = None  # vLLM's field for the <think> part (--reasoning-parser)


class ChatChoice(ResponseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(ResponseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM extra


class DeltaMessage(ResponseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _omit_unused(self, handler):
        """Chunks carry `reasoning_content` / `tool_calls` only when they have some (as vLLM)."""
        d = handler(self)
        for k in ("reasoning_content", "tool_calls"):
            if d.get(k) is None:
                d.pop(k, None)
        return d


class ChatChunkChoice(ResponseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(ResponseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    system_fingerprint: str | None = None
    usage: UsageInfo | None = None


class ModelCard(ResponseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "linrnn-serve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(ResponseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(ResponseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(ResponseModel):
    prompt: str
