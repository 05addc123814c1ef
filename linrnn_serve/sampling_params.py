"""Per-request sampling parameters (vLLM semantics). Plain dataclass: bottom of the import graph."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from linrnn_serve.engine.errors import SamplingParamError


@dataclass
class StructuredOutputsParams:
    """vLLM's `structured_outputs`: exactly one constraint on the output text (compiled by xgrammar in
    the engine, engine/structured_output.py)."""

    json: dict | str | None = None  # a JSON schema (object or its JSON text)
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (GBNF-style: root ::= ...)
    json_object: bool = False  # any JSON object (response_format json_object)
    # reasoning models: the constraint starts once the output contains this text (`</think>`); the
    # thinking before it is free (vLLM's default, enable_in_reasoning=False). None: from the first token.
    reasoning_end: str | None = None

    def kind(self) -> str:
        kinds = [k for k in ("json", "regex", "choice", "grammar") if getattr(self, k) is not None]
        kinds += ["json_object"] if self.json_object else []
        if len(kinds) != 1:
            raise SamplingParamError("structured_outputs", "structured_outputs needs exactly one of json, regex, "
                                                           f"choice, grammar, json_object (got {kinds or 'none'})")
        return kinds[0]


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same tokens whatever the batch
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    max_tokens: int | None = 16  # None: up to the context limit
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the sampled token's logprob and this many top alternatives
    prompt_logprobs: int | None = None  # logprobs of the prompt tokens (completions `echo` + `logprobs`)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None  # output constrained by a grammar
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] = field(default_factory=list)  # never generate these words
    truncate_prompt_tokens: int | None = None  # keep only the last N prompt tokens
    bad_words_token_ids: list[list[int]] | None = None  # set by the engine from bad_words
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (OpenAI's logit_bias)
    extra_args: dict[str, Any] | None = None

    MAX_LOGPROBS = 20

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, max_logprobs: int | None = None) -> None:
        """Raise ValueError(param, message) style errors for out-of-range values. `max_logprobs`: the
        engine's --max-logprobs (default MAX_LOGPROBS)."""
        max_lp = self.MAX_LOGPROBS if max_logprobs is None else max_logprobs
        def bad(param, msg):
            raise SamplingParamError(param, msg)

        if not isinstance(self.n, int) or self.n < 1 or self.n > 128:
            bad("n", f"n must be an integer in [1, 128], got {self.n!r}")
        if not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"temperature must be in [0, 100], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            bad("top_k", f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            bad("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            bad("presence_penalty", f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            bad("frequency_penalty", f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if not 0.0 < self.repetition_penalty <= 2.0:
            bad("repetition_penalty", f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            bad("max_tokens", f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.min_tokens < 0 or (self.max_tokens is not None and self.min_tokens > self.max_tokens):
            bad("min_tokens", f"min_tokens must be in [0, max_tokens], got {self.min_tokens}")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= max_lp:
                bad(name, f"{name} must be in [0, {max_lp}], got {v}")
        if len(self.stop) > 16 or any(not isinstance(s, str) or not s for s in self.stop):
            bad("stop", "stop must be up to 16 non-empty strings")
        if self.structured_outputs is not None:
            self.structured_outputs.kind()
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            bad("allowed_token_ids", "allowed_token_ids must not be empty")
        if self.truncate_prompt_tokens is not None and (not isinstance(self.truncate_prompt_tokens, int)
                                                        or self.truncate_prompt_tokens < 1):
            bad("truncate_prompt_tokens", f"truncate_prompt_tokens must be a positive integer, got "
                                          f"{self.truncate_prompt_tokens!r}")
        if any(not isinstance(w, str) or not w for w in self.bad_words):
            bad("bad_words", "bad_words must be non-empty strings")
        if self.logit_bias and any(not -100.0 <= v <= 100.0 for v in self.logit_bias.values()):
            bad("logit_bias", "logit_bias values must be in [-100, 100]")
