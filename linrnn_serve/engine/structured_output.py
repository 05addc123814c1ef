"""Structured output on the engine side: grammars compiled by xgrammar (the engine vLLM uses), one
matcher per sequence, and the per-step token bitmask they fill.

    so = StructuredOutputs(tokenizer, vocab_size, eos_ids)
    so.check(params)                       # compile now (cached): StructuredOutputError -> HTTP 400
    so.add(seq_ids, params)                # a matcher per sample
    plan.fill_bitmask = so.filler(plan)    # the runner calls it while the forward runs (runner/)
    so.accept(seq_id, token)               # after each sampled token

Split of work (DESIGN.md): the compiler and matcher state live here (host, Python objects); the
runner owns the device bitmask buffer, calls `fill(host_rows, seq_ids)` after it has launched the
step's forward (so the host work overlaps the GPU), copies the pinned rows to a static device buffer
without blocking and applies them inside the decode CUDA graph (runner/sampler.py::apply_bitmask).
Unconstrained rows of a constrained batch are all ones: their logits, and so their greedy tokens,
are unchanged.

The bitmask is xgrammar's: int32 words, bit t % 32 of word t // 32 set = token t allowed. The
vocabulary handed to xgrammar is the model's (padded ids beyond the tokenizer are never allowed),
each token as its exact bytes; special tokens are empty (never allowed inside a grammar) except the
EOS ids, which the grammar allows once it is complete.

JSON schemas are compiled without free whitespace (compact separators, as vLLM with
`disable_any_whitespace`): small models otherwise loop on whitespace until max_tokens.
`allowed_token_ids` uses the same path (a fixed mask, ANDed with the grammar's when both are set).
"""
from __future__ import annotations

import json
import logging
import threading
from typing import Any

import torch

from linrnn_serve.engine.errors import StructuredOutputError
from linrnn_serve.sampling_params import SamplingParams, StructuredOutputsParams

log = logging.getLogger(__name__)


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


class _Constraint:
    """One sequence's state: an xgrammar matcher and/or a fixed allowed-token mask."""

    __slots__ = ("matcher", "allowed")

    def __init__(self, matcher, allowed: torch.Tensor | None):
        self.matcher, self.allowed = matcher, allowed

    def fill(self, host: torch.Tensor, row: int) -> None:
        if self.matcher is not None:
            if self.matcher.is_terminated():
                host[row].fill_(-1)
            else:
                self.matcher.fill_next_token_bitmask(host, row)
            if self.allowed is not None:
                host[row].bitwise_and_(self.allowed)
        else:
            host[row].copy_(self.allowed)


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer, self.vocab_size, self.eos_token_ids = tokenizer, vocab_size, list(eos_token_ids)
        self.words = bitmask_words(vocab_size)
        self._compiler = None
        self._lock = threading.Lock()
        self.constraints: dict[int, _Constraint] = {}

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
        for sid in seq_ids:
            matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
            self.constraints[sid] = _Constraint(matcher, allowed)

    def remove(self, seq_id: int) -> None:
        self.constraints.pop(seq_id, None)

    def accept(self, seq_id: int, token_id: int) -> None:
        c = self.constraints.get(seq_id)
        if c is None or c.matcher is None or c.matcher.is_terminated():
            return
        if not c.matcher.accept_token(token_id):  # e.g. EOS banned by min_tokens, or ignore_eos past the end
            log.debug("sequence %d: token %d is outside its grammar; constraint dropped", seq_id, token_id)
            c.matcher = None
            if c.allowed is None:
                self.constraints.pop(seq_id, None)

    def fill(self, host: torch.Tensor, seq_ids: list[int]) -> None:
        """Rows of `host` (int32 [len(seq_ids), words], pre-set to -1) for the constrained sequences."""
        for i, sid in enumerate(seq_ids):
            c = self.constraints.get(sid)
            if c is not None:
                c.fill(host, i)


def pack_bits(allowed: torch.Tensor) -> torch.Tensor:
    """bool [R, words*32] -> int32 [R, words] in xgrammar's layout (bit j of word w = token 32w + j)."""
    R, n = allowed.shape
    b = allowed.view(R, n // 8, 8).to(torch.uint8)
    byte = (b << torch.arange(8, dtype=torch.uint8)).sum(-1, dtype=torch.uint8)  # little-endian bytes
    return byte.view(torch.int32) if byte.is_contiguous() else byte.contiguous().view(torch.int32)
