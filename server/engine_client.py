"""The server's thin adapter over the engine's client API (AsyncMPClient, or the in-process
AsyncLLMEngine): generation streams that
abort their request however they end early, tokenizer helpers, model facts and a stats snapshot.

Routes never touch the engine directly; everything the server needs from it goes through here, so
a change in the engine's surface is absorbed in one file.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

import anyio

from linrnn_serve.engine.outputs import RequestOutput
from linrnn_serve.sampling_params import SamplingParams
from linrnn_server.errors import bad_request

log = logging.getLogger(__name__)


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    """First present attribute / key of `names` on an object or a dict."""
    for n in names:
        if isinstance(obj, dict):
            if n in obj and obj[n] is not None:
                return obj[n]
        elif getattr(obj, n, None) is not None:
            return getattr(obj, n)
    return default


class EngineClient:
    def __init__(self, engine: Any, served_model_names: list[str] | None = None):
        self.engine = engine
        self.tokenizer = engine.tokenizer  # None: the checkpoint has no tokenizer (token-id prompts only)
        cfg = _get(engine, "config", default=None)
        # AsyncLLMEngine does not expose the ModelConfig itself; its LLMEngine does
        model_cfg = _get(engine, "model_config", default=None) or _get(_get(engine, "engine"), "model_config")
        self.max_model_len: int = int(_get(engine, "max_model_len", default=None)
                                      or _get(cfg, "max_model_len", default=None) or 8192)
        # the model's vocabulary (/detokenize checks token ids against it; may exceed the tokenizer's)
        self.vocab_size: int = int(_get(model_cfg, "vocab_size", default=None)
                                   or _get(self.tokenizer, "vocab_size", default=0))
        name = _get(engine, "model_name", default=None) or _get(cfg, "served_model_name", "model", default="default")
        self.served_model_names: list[str] = list(served_model_names or [name])
        self.model_root: str | None = _get(cfg, "model", default=None)
        # request fields left unset take these (the checkpoint's generation_config.json, --generation-config)
        self.default_sampling_params: dict[str, Any] = dict(_get(engine, "default_sampling_params", default={}))
        self.config = cfg
        # --chat-template (a file or the text); None: the checkpoint's own template
        from linrnn_serve.engine.tokenizer import resolve_chat_template

        self.chat_template: str | None = resolve_chat_template(_get(cfg, "chat_template", default=None))
        self._token_bytes: list[bytes | None] | None = None
        if callable(getattr(self.tokenizer, "min_tokens", None)):
            self.tokenizer.min_tokens("")  # builds its token-length table now, not in the first long request

    # ---- tokenizer ----------------------------------------------------------------------
    def require_tokenizer(self, param: str):
        if self.tokenizer is None:
            raise bad_request("This model has no tokenizer: send prompts as token ids.", param, "no_tokenizer")
        return self.tokenizer

    def encode(self, text: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        return list(self.require_tokenizer(param).encode(text, add_special_tokens=add_special_tokens))

    async def encode_async(self, text: str, add_special_tokens: bool = True, param: str = "prompt",
                           reserve: int | None = None) -> list[int]:
        """`encode` in a worker thread, so that a long prompt never stalls the event loop (/health and
        every stream keep running). With `reserve` (the completion tokens the request needs), a text
        that cannot fit the context is refused first from its length (`check_fits`)."""
        tok = self.require_tokenizer(param)
        if reserve is not None:
            await self.check_fits([text], param, reserve)
        ids = await anyio.to_thread.run_sync(lambda: tok.encode(text, add_special_tokens=add_special_tokens))
        return list(ids)

    async def check_fits(self, texts: list[str], param: str, reserve: int) -> None:
        """Refuse (400 context_length_exceeded) a prompt that contains `texts` and cannot fit the context
        with `reserve` completion tokens, even at the tokenizer's longest token: a megabyte prompt costs
        a byte count, not seconds of tokenizing (or rendering)."""
        bound = getattr(self.tokenizer, "min_tokens", None)
        if bound is None or sum(map(len, texts)) <= self.max_model_len:  # short: no bound needed
            return
        at_least = await anyio.to_thread.run_sync(bound, texts)
        if at_least + reserve > self.max_model_len:
            raise bad_request(
                f"This model's maximum context length is {self.max_model_len} tokens. However, the {param} "
                f"alone has at least {at_least} tokens ({sum(map(len, texts))} characters). Please reduce the "
                f"length of the {param}.", param, "context_length_exceeded")

    async def run_blocking(self, fn, *args, **kwargs):
        """A CPU-heavy call (chat-template rendering) in a worker thread, off the event loop."""
        return await anyio.to_thread.run_sync(lambda: fn(*args, **kwargs))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, tid: int) -> bytes:
        """The exact bytes of one token (byte-level vocabularies); its decoded text otherwise."""
        if self._token_bytes is None:
            table = getattr(self.tokenizer, "token_bytes", None)
            self._token_bytes = table() if callable(table) else []
        if 0 <= tid < len(self._token_bytes) and self._token_bytes[tid] is not None:
            return self._token_bytes[tid]
        return self.decode([tid], skip_special_tokens=False).encode("utf-8")

    def token_str(self, tid: int) -> str:
        """A token as text for logprobs (partial UTF-8 bytes show as U+FFFD, as in vLLM)."""
        s = self.token_bytes(tid).decode("utf-8", errors="replace")
        return s if s or self.knows(tid) else f"<|unknown:{tid}|>"

    def is_special(self, tid: int) -> bool:
        """A special added token (left out of the text when skip_special_tokens)."""
        return tid in (getattr(self.tokenizer, "special_ids", None) or ())

    def knows(self, tid: int) -> bool:
        max_id = getattr(self.tokenizer, "max_id", None)
        return max_id is None or 0 <= tid <= max_id

    # ---- generation ---------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """The engine's cumulative outputs for one request. However the consumer stops early (it
        returns, raises, or is cancelled because the client went away) the request is aborted so
        its cache slots and blocks are freed."""
        finished = False
        agen = self.engine.generate(prompt_ids, params, request_id)
        try:
            async for out in agen:
                finished = out.finished
                yield out
                if finished:
                    break
        finally:
            with anyio.CancelScope(shield=True):  # cleanup must run even inside a cancelled scope
                if not finished:
                    try:
                        await self.engine.abort(request_id)
                    except Exception:  # pragma: no cover - abort of a request the engine forgot
                        log.exception("aborting %s failed", request_id)
                aclose = getattr(agen, "aclose", None)
                if aclose is not None:
                    try:
                        await aclose()
                    except Exception:  # pragma: no cover
                        log.exception("closing the stream of %s failed", request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    # ---- health / stats -----------------------------------------------------------------
    def healthy(self) -> tuple[bool, str]:
        if _get(self.engine, "is_running", default=True):
            return True, ""
        return False, "the engine core has stopped or is shutting down"

    def stats(self) -> dict[str, Any] | None:
        """The engine's stats() snapshot (a dict of numbers, per-label counts and histograms)."""
        fn = getattr(self.engine, "stats", None)
        if not callable(fn):
            return None
        try:
            return dict(fn())
        except Exception:  # pragma: no cover - metrics must not fail the scrape
            log.exception("engine.stats() failed")
            return None

    async def shutdown(self, mode: str = "abort", timeout: float = 30.0) -> None:
        fn = getattr(self.engine, "shutdown", None)
        if fn is not None:
            await fn(mode=mode, timeout=timeout)
