"""What the engine hands back per request (cumulative: each yield carries everything so far)."""
from __future__ import annotations

from dataclasses import dataclass, field

# the typed errors live in engine/errors.py; re-exported for existing imports
from linrnn_serve.engine.errors import EngineDeadError, EngineFullError, PromptTooLongError  # noqa: F401


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str  # detokenized output so far (stop strings removed unless include_stop_str_in_output)
    token_ids: list[int]
    # per generated token: {token_id: logprob} holding the sampled token and the top-N alternatives
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # LLM.chat with a reasoning / tool-call parser: the text split into its parts (None: not parsed)
    reasoning_content: str | None = None
    content: str | None = None
    tool_calls: list[dict] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[dict[int, float] | None] | None = None  # first entry None (no context)
    metrics: dict = field(default_factory=dict)  # arrival_time, first_token_time, finished_time, ...
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (usage.prompt_tokens_details)

