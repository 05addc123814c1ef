"""Structured output on the engine side: grammars compiled by xgrammar (the engine vLLM uses), one
matcher per sequence, and the per-step token bitmask they fill.

    so = StructuredOutputs(tokenizer, vocab_size, eos_ids)
    so.check(params)                       # compile now (cached): StructuredOutputError -> HTTP 400
    so.add(seq_ids, params)                # a matcher per sample
    plan.fill_bitmask = so.fill            # the runner calls it while the forward runs (runner/)
    so.accept(seq_id, token)               # after each sampled token (queued; fed by the next fill)

Split of work (DESIGN.md): the compiler and matcher state live here (host, Python objects); the
runner owns the device bitmask buffer, calls `fill(host_rows, seq_ids)` after it has launched the
step's forward (so the host work overlaps the GPU), copies the pinned rows to a static device buffer
without blocking and applies them inside the decode CUDA graph (runner/sampler.py::apply_bitmask).
Unconstrained rows of a constrained batch are all ones: their logits, and so their greedy tokens,
are unchanged.

Host cost per step (what the GPU could wait for), kept off the critical path the way vLLM and
xgrammar do it:
- `accept` only queues the sampled token; `fill` first feeds the queued tokens to their matchers (one
  `batch_accept_string` call), then fills every constrained row with one multithreaded
  `BatchGrammarMatcher.batch_fill_next_token_bitmask` call. Both run inside the runner's overlap
  window (the forward is already queued on the GPU), not between steps.
- tokens are fed as their bytes (`accept_string`), not by id: xgrammar's `accept_token` scans the list
  of special token ids linearly on every call (23 us per token with a model vocabulary padded far
  beyond its tokenizer, as the dummy presets are); EOS and special tokens are handled here instead.
- free rows are set to all ones in one indexed fill; nothing is allocated per row.

The bitmask is xgrammar's: int32 words, bit t % 32 of word t // 32 set = token t allowed. The
vocabulary handed to xgrammar is the model's (padded ids beyond the tokenizer are never allowed),
each token as its exact bytes; special tokens are empty (never allowed inside a grammar) except the
EOS ids, which the grammar allows once it is complete. After EOS (or once the grammar is complete
and EOS was sampled anyway, e.g. `ignore_eos`) the row is free.

Reasoning models (`StructuredOutputsParams.reasoning_end`, set by the server when a reasoning parser
is on and the output starts inside a <think> block): the grammar waits until the output contains that
text (`</think>`), as vLLM does by default (`enable_in_reasoning=False`), so the thinking is not
constrained and the answer after it is.

JSON schemas are compiled without free whitespace (compact separators, as vLLM with
`disable_any_whitespace`): small models otherwise loop on whitespace until max_tokens.
`allowed_token_ids` uses the same path (a fixed mask, ANDed with the grammar's when both are set; it
also applies during the reasoning).
"""
from __future__ import annotations

import json
import logging
import os
import threading
from typing import Any

import torch

from linrnn_serve.engine.errors import StructuredOutputError
from linrnn_serve.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _Constraint:
    """One sequence's state: an xgrammar matcher (None: no grammar, or it is finished) and/or a fixed
    allowed-token mask; `reasoning_end` (bytes or None): the grammar waits until the output contains it."""

    __slots__ = ("matcher", "allowed", "reasoning_end", "tail")

    def __init__(self, matcher, allowed: torch.Tensor | None, reasoning_end: bytes | None = None):
        self.matcher, self.allowed, self.reasoning_end = matcher, allowed, reasoning_end
        self.tail = b""  # the last output bytes while waiting for reasoning_end

    @property
    def grammar_on(self) -> bool:
        return self.matcher is not None and self.reasoning_end is None


def _batch_threads() -> int:
    """xgrammar's fill threads: half the cores (its "auto"), at most 8 (rows are ~1-50 us each)."""
    return max(1, min(8, (os.cpu_count() or 2) // 2))


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self._eos = frozenset(self.eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self._compiler = None
        self._vocab: list[bytes] = []  # per id: the bytes the grammar sees (b"": special or padding)
        self._batch = None  # xgr.BatchGrammarMatcher: its thread pool fills the rows
        self._lock = threading.Lock()
        self.constraints: dict[int, _Constraint] = {}
        self._pending: list[tuple[int, int]] = []  # (seq id, sampled token) not yet fed to the matchers

    # ---- compile ----------------------------------------------------------------------------
    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                try:
                    import xgrammar as xgr
                except ImportError as e:  # a dependency in pyproject; guard a broken install
                    raise StructuredOutputError("structured_outputs", f"structured output needs the xgrammar "
                                                                      f"package ({e})") from None
                if self.tokenizer is None:
                    raise StructuredOutputError("structured_outputs", "structured output needs a tokenizer")
                table = self.tokenizer.token_bytes()
                special = set(getattr(self.tokenizer, "special_ids", ())) - set(self.eos_token_ids)
                vocab = [b"" if (i in special or i >= len(table) or table[i] is None) else table[i]
                         for i in range(self.vocab_size)]
                info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size,
                                         stop_token_ids=self.eos_token_ids or None)
                self._vocab = vocab
                self._batch = xgr.BatchGrammarMatcher(_batch_threads())
                self._compiler = xgr.GrammarCompiler(info, max_threads=2, cache_enabled=True)
            return self._compiler

    def compile(self, so: StructuredOutputsParams):
        kind = so.kind()
        comp = self._get_compiler()
        try:
            if kind == "json":
                schema = so.json if isinstance(so.json, str) else json.dumps(so.json)
                return comp.compile_json_schema(schema, any_whitespace=False)
            if kind == "json_object":  # OpenAI's JSON mode: any JSON object (not any JSON value)
                return comp.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            if kind == "regex":
                return comp.compile_regex(so.regex)
            if kind == "choice":
                if not so.choice or not all(isinstance(c, str) for c in so.choice):
                    raise StructuredOutputError("choice", "choice must be a non-empty list of strings")
                alts = " | ".join(json.dumps(c, ensure_ascii=False) for c in so.choice)
                return comp.compile_grammar(f"root ::= {alts}")
            return comp.compile_grammar(so.grammar)
        except StructuredOutputError:
            raise
        except Exception as e:  # xgrammar raises RuntimeError / ValueError / InvalidJSONError with its reason
            what = {"json": "JSON schema", "json_object": "JSON grammar", "regex": "regex", "choice": "choice",
                    "grammar": "grammar"}[kind]
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise StructuredOutputError(kind, f"the {what} cannot be compiled: {msg}") from None

    def _allowed_mask(self, ids: list[int]) -> torch.Tensor:
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
        if bad:
            raise StructuredOutputError("allowed_token_ids", f"allowed_token_ids {bad[:5]} are outside the "
                                                             f"vocabulary [0, {self.vocab_size})")
        bits = torch.zeros(self.words * 32, dtype=torch.bool)
        bits[torch.tensor(ids, dtype=torch.long)] = True
        return pack_bits(bits[None])[0]

    def check(self, params: SamplingParams) -> Any:
        """Compile (cached) and return the compiled grammar, or raise StructuredOutputError."""
        compiled = self.compile(params.structured_outputs) if params.structured_outputs is not None else None
        if params.allowed_token_ids is not None:
            self._allowed_mask(params.allowed_token_ids)
        return compiled

    # ---- per sequence -------------------------------------------------------------------------
    def needs(self, params: SamplingParams) -> bool:
        return params.structured_outputs is not None or params.allowed_token_ids is not None

    def add(self, seq_ids: list[int], params: SamplingParams) -> None:
        import xgrammar as xgr

        compiled = self.check(params)
        allowed = self._allowed_mask(params.allowed_token_ids) if params.allowed_token_ids is not None else None
        so = params.structured_outputs
        end = so.reasoning_end.encode() if so is not None and so.reasoning_end else None
        for sid in seq_ids:
            matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
            self.constraints[sid] = _Constraint(matcher, allowed, end if matcher is not None else None)

    def remove(self, seq_id: int) -> None:
        self.constraints.pop(seq_id, None)

    def accept(self, seq_id: int, token_id: int) -> None:
        """Queue a sampled token; the next `fill` (or `flush`) feeds it to the sequence's matcher."""
        if seq_id in self.constraints:
            self._pending.append((seq_id, token_id))

    def flush(self) -> None:
        """Feed the queued tokens to their matchers (one batched xgrammar call)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        matchers, strings, owners = [], [], []
        for sid, tok in pending:
            c = self.constraints.get(sid)
            if c is None or c.matcher is None:
                continue
            if c.reasoning_end is not None:  # still thinking: watch for the end of the reasoning
                c.tail = (c.tail + (self._vocab[tok] if 0 <= tok < len(self._vocab) else b""))
                if c.reasoning_end in c.tail:
                    c.reasoning_end, c.tail = None, b""  # the grammar starts with the next token
                else:
                    c.tail = c.tail[-len(c.reasoning_end):]
                continue
            if tok in self._eos:
                # EOS ends the grammar when it is complete (the row is free from now on, e.g. ignore_eos);
                # otherwise it is outside the grammar (e.g. min_tokens banned nothing, the model chose it)
                self._finish(sid, c, "EOS" if c.matcher.is_completed() else None)
                continue
            text = self._vocab[tok] if 0 <= tok < len(self._vocab) else b""
            if not text:  # a special or padding token: never inside a grammar
                self._finish(sid, c, None, tok)
                continue
            matchers.append(c.matcher)
            strings.append(text)
            owners.append((sid, c, tok))
        if matchers:
            import xgrammar as xgr

            ok = xgr.BatchGrammarMatcher.batch_accept_string(matchers, strings)
            for good, (sid, c, tok) in zip(ok, owners):
                if not good:
                    self._finish(sid, c, None, tok)

    def _finish(self, sid: int, c: _Constraint, why: str | None, tok: int | None = None) -> None:
        if why is None:  # e.g. ignore_eos past the grammar's end, or a token forced around the mask
            log.debug("sequence %d: token %s is outside its grammar; constraint dropped", sid, tok)
        c.matcher = None
        if c.allowed is None:
            self.constraints.pop(sid, None)

    def fill(self, host: torch.Tensor, seq_ids: list[int]) -> None:
        """Write every row of `host` (int32 [len(seq_ids), words], pinned or not): the token bitmask of
        the constrained sequences, all ones for the others. Feeds the queued tokens first."""
        self.flush()
        matchers, rows, free, masked = [], [], [], []
        for i, sid in enumerate(seq_ids):
            c = self.constraints.get(sid)
            if c is None:
                free.append(i)
                continue
            if c.grammar_on:
                matchers.append(c.matcher)
                rows.append(i)
            elif c.allowed is None:
                free.append(i)
            if c.allowed is not None:
                masked.append((i, c))
        if free:  # one numpy fancy-index store: no per-row dispatch, no OpenMP wake-ups (torch's fill_ on a
            host.numpy()[free] = -1  # loaded host spiked to ms)
        if matchers:
            self._fill_rows(matchers, host, rows)
        for i, c in masked:
            if c.grammar_on:
                host[i].bitwise_and_(c.allowed)
            else:
                host[i].copy_(c.allowed)

    def _fill_rows(self, matchers, host: torch.Tensor, rows: list[int]) -> None:
        if self._batch is not None:
            try:
                self._batch.batch_fill_next_token_bitmask(matchers, host, rows)
                return
            except (RuntimeError, ValueError, TypeError) as e:  # e.g. a bitmask buffer kind it refuses
                log.warning("xgrammar's batch fill failed (%s: %s); filling row by row from now on",
                            type(e).__name__, e)
                self._batch = None
        for m, i in zip(matchers, rows):
            m.fill_next_token_bitmask(host, i)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, words*32] -> int32 [R, words] in xgrammar's layout (bit j of word w = token 32w + j)."""
    R, n = allowed.shape
    b = allowed.view(R, n // 8, 8).to(torch.uint8)
    byte = (b << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # little-endian bytes
    return byte.view(torch.int32) if byte.is_contiguous() else byte.contiguous().view(torch.int32)
