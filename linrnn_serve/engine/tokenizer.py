"""The engine's tokenizer: `tokenizers`-library encode/decode, HF chat templates, EOS ids, and an
incremental detokenizer for streaming.

Files read from a model (or tokenizer) directory, as transformers writes them:
  tokenizer.json                      the `tokenizers` pipeline (required)
  tokenizer_config.json               special tokens (bos/eos/pad), added tokens, chat_template
  chat_template.jinja | chat_template.json   chat template saved separately (takes precedence)
  generation_config.json, config.json       more EOS ids (eos_token_id: int or list)

Chat templates are rendered like transformers' `apply_chat_template`: a sandboxed jinja2
environment with trim_blocks / lstrip_blocks, loop controls, `raise_exception`, `strftime_now`,
a `tojson` filter (ensure_ascii=False) and the `{% generation %}` tag, with the special tokens
(bos_token, eos_token, ...) and any extra kwargs (e.g. enable_thinking) in scope.

The incremental detokenizer never emits half a multi-byte character (its `flush()` at the end of
a sequence reports a still-incomplete one as U+FFFD, as vLLM and OpenAI do) and ignores ids the
tokenizer does not know (random-weight models with a padded vocab sample those). It is `tokenizers`'
DecodeStream (StreamDetokenizer); a tokenizer whose config asks for transformers' clean-up of
tokenization spaces (not part of the `tokenizers` decoder) uses the prefix/read-offset re-decoding
scheme of HF TGI / vLLM instead (IncrementalDetokenizer).
"""
from __future__ import annotations

import json
import os
import unicodedata
from datetime import datetime
from typing import Any

from linrnn_serve.byte_level import bytes_to_unicode
from linrnn_serve.sampling_params import SamplingParams


class TokenizerError(ValueError):
    """A tokenizer directory we cannot use; the message names the file."""


def _token_content(v) -> str | None:
    if v is None:
        return None
    if isinstance(v, dict):
        return v.get("content")
    return str(v)


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from e


def _ids(v) -> list[int]:
    if v is None:
        return []
    return [v] if isinstance(v, int) else [int(x) for x in v]


class Tokenizer:
    def __init__(self, tok, config: dict | None = None, chat_template: str | dict[str, str] | None = None,
                 extra_eos_ids: list[int] | None = None, path: str | None = None):
        self.tok, self.config, self.path = tok, dict(config or {}), path
        self.chat_template = chat_template
        self.added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self.special_ids = {i for i, t in self.added.items() if t.special}
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self.max_id = max([tok.get_vocab_size(with_added_tokens=False) - 1] + list(self.added))
        for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
            setattr(self, name, _token_content(self.config.get(name)))
        eos = []
        if self.eos_token is not None:
            tid = tok.token_to_id(self.eos_token)
            if tid is not None:
                eos.append(tid)
        for t in extra_eos_ids or []:
            if t not in eos:
                eos.append(t)
        self.eos_token_ids = eos
        self.clean_up_spaces = bool(self.config.get("clean_up_tokenization_spaces", False))
        self._byte_level = _is_byte_level(tok)
        self._token_bytes: list[bytes | None] | None = None
        self._max_token_bytes: int | None = None
        self._nfc = False
        self._jinja = None

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str, eos_token_ids: list[int] | None = None) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise TokenizerError(f"{path}: no tokenizer.json (the engine reads HF fast-tokenizer files)")
        try:
            tok = HFTokenizer.from_file(tj)
        except Exception as e:
            raise TokenizerError(f"{tj}: cannot load ({e})") from e
        config = _read_json(os.path.join(path, "tokenizer_config.json"))
        template = config.get("chat_template")
        jinja_file = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja_file):
            with open(jinja_file, encoding="utf-8") as f:
                template = f.read()
        elif os.path.isfile(os.path.join(path, "chat_template.json")):
            template = _read_json(os.path.join(path, "chat_template.json")).get("chat_template", template)
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}
        extra = []
        for fn in ("generation_config.json", "config.json"):
            raw = _read_json(os.path.join(path, fn))
            extra += _ids(raw.get("eos_token_id"))
            extra += _ids((raw.get("text_config") or {}).get("eos_token_id"))
        extra += list(eos_token_ids or [])
        return cls(tok, config, template, extra, path)

    # ---- encode / decode -------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode does not): a long prompt tokenized in a
        # worker thread then leaves the server's event loop running
        return self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def min_tokens(self, text: str | list[str]) -> int:
        """A lower bound on len(encode(text)) from the text's length alone, for refusing prompts that
        cannot fit the context without tokenizing them (0 when no cheap bound holds). A token covers at
        most `max_token_bytes` bytes of (NFC-normalized) text, so the tokens are at least
        bytes / max_token_bytes. A list bounds any text that contains all its parts."""
        if self._max_token_bytes is None:
            self._max_token_bytes = self._longest_token_bytes()
        if not self._max_token_bytes:
            return 0
        n = 0
        for part in [text] if isinstance(text, str) else text:
            if self._nfc:
                part = unicodedata.normalize("NFC", part)
            n += len(part.encode("utf-8", errors="surrogatepass"))
        return -(-n // self._max_token_bytes)

    def _longest_token_bytes(self) -> int:
        """Bytes of text the longest token stands for; 0 when a normalizer may shrink text in ways
        the bound cannot see (anything but none / NFC) or the tokenizer is not byte-level."""
        try:
            norm = json.loads(self.tok.to_str()).get("normalizer")
        except Exception:
            return 0
        if not self._byte_level or (norm is not None and norm.get("type") != "NFC"):
            return 0
        self._nfc = norm is not None
        longest = max((len(b) for b in self.token_bytes() if b is not None), default=0)
        added = max((len(t.content.encode("utf-8")) for t in self.added.values()), default=0)
        return max(longest, added, 1)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i <= self.max_id]
        text = self.tok.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.clean_up_spaces else text

    def token_to_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def id_to_token(self, tid: int) -> str | None:
        return self.tok.id_to_token(tid) if 0 <= tid <= self.max_id else None

    # ---- chat templates --------------------------------------------------------------------
    def get_chat_template(self, name: str | None = None) -> str:
        t = self.chat_template
        if isinstance(t, dict):
            name = name or "default"
            if name not in t:
                raise TokenizerError(f"chat template {name!r} not found (have {sorted(t)})")
            return t[name]
        if t is None:
            raise TokenizerError(f"{self.path or 'tokenizer'}: no chat template (tokenizer_config.json "
                                 f"'chat_template' or chat_template.jinja)")
        return t

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, documents: list[dict] | None = None,
                            chat_template: str | None = None, tokenize: bool = False,
                            continue_final_message: bool = False, **kwargs) -> str | list[int]:
        template = chat_template if chat_template is not None else self.get_chat_template(
            "tool_use" if tools and isinstance(self.chat_template, dict) and "tool_use" in self.chat_template
            else None)
        specials = {k: getattr(self, k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        ctx = dict(specials)
        ctx.update(kwargs)
        ctx.update(messages=messages, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt)
        text = self._compile(template).render(**ctx)
        if continue_final_message and messages:
            last = messages[-1].get("content")
            if isinstance(last, str) and last.strip() and last.strip() in text:
                text = text[: text.rindex(last.strip()) + len(last.strip())]
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def _compile(self, template: str):
        if self._jinja is None:
            self._jinja = _jinja_env()
        return self._jinja.from_string(template)

    # ---- streaming ---------------------------------------------------------------------------
    def detokenizer(self, prompt_token_ids: list[int] | None = None,
                    params: SamplingParams | None = None) -> "StreamDetokenizer | IncrementalDetokenizer":
        skip = params.skip_special_tokens if params is not None else True
        if self.clean_up_spaces:  # transformers' clean-up is not part of the tokenizers decoder
            return IncrementalDetokenizer(self, prompt_token_ids or [], skip)
        return StreamDetokenizer(self, prompt_token_ids or [], skip)

    def token_bytes(self) -> list[bytes | None]:
        """Per id: the token's bytes (byte-level vocab) or None for added tokens / holes. Built once."""
        if self._token_bytes is None:
            dec = {c: b for b, c in bytes_to_unicode().items()}
            table: list[bytes | None] = [None] * (self.max_id + 1)
            for s, i in self.tok.get_vocab(with_added_tokens=False).items():
                if i in self.added:
                    continue
                try:
                    table[i] = bytes(dec[c] for c in s)
                except KeyError:
                    table[i] = s.encode("utf-8")
            self._token_bytes = table
        return self._token_bytes


class IncrementalDetokenizer:
    """Generic incremental decoding (prefix / read offsets, as HF TGI and vLLM do): re-decode a short
    window and emit only text that no longer ends in an incomplete character."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.t, self.skip = tokenizer, skip_special_tokens
        self.ids = [i for i in prompt_token_ids[-6:] if 0 <= i <= tokenizer.max_id]
        self.prefix, self.read = max(0, len(self.ids) - 5), len(self.ids)

    def update(self, token_id: int) -> str:
        if not 0 <= token_id <= self.t.max_id:
            return ""
        self.ids.append(token_id)
        prefix_text = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        new_text = self.t.decode(self.ids[self.prefix:], self.skip)
        if len(new_text) > len(prefix_text) and not new_text.endswith("\ufffd"):
            delta = new_text[len(prefix_text):]
            self.prefix, self.read = self.read, len(self.ids)
            if self.prefix > 64:  # keep the window short
                drop = self.prefix - 8
                self.ids = self.ids[drop:]
                self.prefix -= drop
                self.read -= drop
            return delta
        return ""

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); call once at the end."""
        prefix_text = self.t.decode(self.ids[self.prefix:self.read], self.skip)
        new_text = self.t.decode(self.ids[self.prefix:], self.skip)
        self.prefix = self.read = len(self.ids)
        return new_text[len(prefix_text):] if new_text.startswith(prefix_text) else ""


class StreamDetokenizer:
    """`tokenizers`' DecodeStream (Rust: re-decodes a short window per token and holds back text that
    ends in an incomplete character), plus what it lacks: unknown ids are skipped, and `flush()`
    reports a character still incomplete at the end as U+FFFD."""

    CONTEXT = 4  # prompt ids the stream starts from (a decoder's leading-space rules see them)

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        from tokenizers.decoders import DecodeStream

        self.t, self.skip = tokenizer, skip_special_tokens
        ctx = [i for i in prompt_token_ids[-self.CONTEXT:] if 0 <= i <= tokenizer.max_id]
        try:
            self.stream = DecodeStream(ids=ctx, skip_special_tokens=skip_special_tokens)
        except TypeError:  # tokenizers < 0.22: no prefill ids
            self.stream, ctx = DecodeStream(skip_special_tokens=skip_special_tokens), []
        self.ctx = ctx  # the last ids already turned into text
        self.held: list[int] = []  # ids since then (their text is not complete yet)

    def update(self, token_id: int) -> str:
        if not 0 <= token_id <= self.t.max_id:
            return ""
        out = self.stream.step(self.t.tok, token_id)
        if out is None:
            self.held.append(token_id)
            return ""
        self.ctx = (self.ctx + self.held + [token_id])[-self.CONTEXT:]
        self.held = []
        return out

    def flush(self) -> str:
        """The text still held back (an incomplete character decodes to U+FFFD); call once at the end."""
        if not self.held:
            return ""
        before = self.t.tok.decode(self.ctx, skip_special_tokens=self.skip)
        after = self.t.tok.decode(self.ctx + self.held, skip_special_tokens=self.skip)
        self.ctx, self.held = [], []
        return after[len(before):] if after.startswith(before) else ""


def _is_byte_level(tok) -> bool:
    try:
        dec = json.loads(tok.to_str()).get("decoder") or {}
    except Exception:
        return False
    return dec.get("type") == "ByteLevel"


def _clean_up(text: str) -> str:
    """transformers' clean_up_tokenization (only when tokenizer_config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _jinja_env():
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """transformers' `{% generation %}...{% endgeneration %}` (marks assistant text): rendered as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def resolve_chat_template(value: str | None) -> str | None:
    """--chat-template / chat_template=: a file holding the template, or the template text itself."""
    if value is None:
        return None
    if os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if "{{" in value or "{%" in value:
        return value
    raise TokenizerError(f"chat template {value!r} is neither a file nor template text (jinja with {{ }} / {{% %}})")
