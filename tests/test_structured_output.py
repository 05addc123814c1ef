"""Engine-side structured output (engine/structured_output.py) on the CPU, without the server:

* the batched path (queued tokens fed by one batch_accept_string call, rows filled by xgrammar's
  multithreaded BatchGrammarMatcher) gives exactly the masks of one plain xgrammar matcher per sequence
  fed token by token, with free rows all ones, allowed_token_ids ANDed, EOS and special tokens handled;
* reasoning models: with `reasoning_end` the grammar waits for `</think>` (the rows are free while the
  model thinks) and constrains what follows; through the whole engine with a scripted model (logits
  that spell a fixed text) the thinking comes out as scripted and the answer after it is valid JSON.
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from linrnn_serve.engine.structured_output import StructuredOutputs
from linrnn_serve.engine.tokenizer import Tokenizer
from linrnn_serve.parsers.reasoning import gate_constraint
from linrnn_serve.sampling_params import SamplingParams, StructuredOutputsParams

xgr = pytest.importorskip("xgrammar")

TOKENIZER_DIR = __import__("linrnn_serve").__path__[0] + "/assets/tokenizer"
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                             "maximum": 99}},
          "required": ["ok", "n"]}


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(TOKENIZER_DIR)


def _bits(row: torch.Tensor, V: int) -> torch.Tensor:
    b = ((row.view(torch.uint8).unsqueeze(-1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)
    return b[:V].bool()


def _so(tok, V):
    return StructuredOutputs(tok, V, list(tok.eos_token_ids))


class _RefusingBatch:
    def batch_fill_next_token_bitmask(self, *a):
        raise RuntimeError("bitmask buffer refused")


@pytest.mark.parametrize("batch_fill", ["xgrammar", "fallback"])
def test_batched_fill_and_accept_match_one_matcher_per_sequence(tok, batch_fill):
    """Random walks through three grammars (+ free and allowed-only rows): every step's mask equals a plain
    xgrammar matcher's, fed by id; padded ids of the model vocabulary are never allowed. `fallback`: the
    batch fill refuses the buffer, the rows are filled one by one."""
    V = 8192 + 300  # the model's vocabulary padded beyond the tokenizer's, as real checkpoints are
    so = _so(tok, V)
    so._get_compiler()
    if batch_fill == "fallback":
        so._batch = _RefusingBatch()
    kinds = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=r"[a-c]{2,5}-[0-9]{1,3}"),
             StructuredOutputsParams(choice=["alpha", "beta", "gamma"]), None, None]
    allowed = list(range(30, 400))
    sids = list(range(len(kinds)))
    refs = {}
    for sid, k in zip(sids, kinds):
        if k is not None:
            so.add([sid], SamplingParams(structured_outputs=k))
            refs[sid] = xgr.GrammarMatcher(so.compile(k))
    so.add([sids[-1]], SamplingParams(allowed_token_ids=allowed))  # allowed ids only, no grammar
    rng = random.Random(0)
    words = (V + 31) // 32
    host = torch.full((len(sids), words), 7, dtype=torch.int32)  # garbage: fill must write every row
    ref = torch.empty(1, words, dtype=torch.int32)
    for step in range(40):
        so.fill(host, sids)
        for sid in sids:
            got = _bits(host[sid], V)
            m = refs.get(sid)
            if sid == sids[-1]:
                want = torch.zeros(V, dtype=torch.bool)
                want[allowed] = True
            elif m is None or m.is_terminated():
                want = torch.ones(V, dtype=torch.bool)
            else:
                m.fill_next_token_bitmask(ref, 0)
                want = _bits(ref[0], V)
            assert torch.equal(got, want), (step, sid)
            assert not got[8192:].any() or (m is None and sid != sids[-1]) or (m is not None and m.is_terminated())
            tid = rng.choice(got.nonzero().flatten().tolist())
            if m is not None and not m.is_terminated():
                assert m.accept_token(tid)
            so.accept(sid, tid)
    assert all(m.is_terminated() for m in refs.values())  # every walk ended in EOS within 40 steps


def test_tokens_outside_the_grammar_drop_the_constraint(tok):
    """A special token or an out-of-grammar token (forced around the mask, e.g. ignore_eos past the end)
    frees the row; EOS once complete too."""
    V = 8192
    so = _so(tok, V)
    so.add([1, 2, 3], SamplingParams(structured_outputs=StructuredOutputsParams(choice=["ab"])))
    eos = tok.eos_token_ids[0]
    special = next(i for i in sorted(tok.special_ids) if i != eos)
    so.accept(1, special)
    so.accept(2, tok.encode("zz")[0])
    for t in tok.encode("ab"):
        so.accept(3, t)
    so.flush()
    assert 1 not in so.constraints and 2 not in so.constraints
    host = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    so.fill(host, [3])
    assert _bits(host[0], V).nonzero().flatten().tolist() == [eos]  # complete: only EOS
    so.accept(3, eos)
    so.fill(host, [3])
    assert _bits(host[0], V).all()  # done: free (ignore_eos goes on unconstrained)


def test_grammar_waits_for_the_end_of_the_reasoning(tok):
    """reasoning_end: free rows while thinking (also for text the grammar forbids), `</think>` split over
    tokens ends it, then the rows are the grammar's from its start."""
    V = 8192
    so = _so(tok, V)
    p = StructuredOutputsParams(json=SCHEMA, reasoning_end="</think>")
    so.add([0], SamplingParams(structured_outputs=p))
    fresh = xgr.GrammarMatcher(so.compile(p))
    host = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    thinking = tok.encode("Let me think: </thi nk> is not it. </think")
    assert len(tok.encode("</think>")) > 1  # the end tag spans several tokens here
    for t in thinking:
        so.fill(host, [0])
        assert _bits(host[0], V).all()
        so.accept(0, t)
    so.fill(host, [0])
    assert _bits(host[0], V).all()  # "</think" is not the end yet
    so.accept(0, tok.encode(">")[0])
    so.fill(host, [0])
    ref = torch.zeros(1, (V + 31) // 32, dtype=torch.int32)
    fresh.fill_next_token_bitmask(ref, 0)
    assert torch.equal(host, ref)  # the grammar from its start


def test_gate_constraint_follows_the_reasoning_parser():
    so = StructuredOutputsParams(json=SCHEMA)
    thinking, plain = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert gate_constraint(so, "qwen3", thinking).reasoning_end == "</think>"
    assert gate_constraint(so, "qwen3", plain) is so  # enable_thinking false: the answer starts at once
    assert gate_constraint(so, None, thinking) is so  # no reasoning parser
    assert gate_constraint(so, "deepseek_r1", "") .reasoning_end == "</think>"
    assert gate_constraint(so, "qwen3", thinking, enable_in_reasoning=True) is so
    assert gate_constraint(None, "qwen3", thinking) is None


# ---- through the engine, with a scripted model --------------------------------------------------------
PROMPT = [1000, 2000, 3000, 4000]
SCRIPT_TEXT = "Hmm, yes.</think>nonsense that is not JSON at all"


class ScriptedModel(torch.nn.Module):
    """Logits that spell SCRIPT (output token k = SCRIPT[k], strongly preferred) with small fixed noise
    below it, so a mask that forbids the script still leaves a definite (masked) argmax."""

    script: list[int] = []

    def __init__(self, cfg, dtype, device):
        super().__init__()
        self.cfg, self.dtype = cfg, dtype
        self.anchor = torch.nn.Parameter(torch.zeros(1, dtype=dtype, device=device), requires_grad=False)
        g = torch.Generator().manual_seed(0)
        self.noise = torch.rand(self.cfg.vocab_size, generator=g).to(dtype)

    def forward(self, batch, caches, all_logits: bool = False):
        pos = batch.positions
        if getattr(batch, "logits_indices", None) is not None:
            pos = pos[batch.logits_indices]
        k = (pos - (len(PROMPT) - 1)).clamp(min=0, max=len(self.script) - 1).cpu()
        logits = self.noise.expand(len(k), -1).clone()
        logits[torch.arange(len(k)), torch.tensor(self.script)[k]] = 10.0
        return logits.to(self.anchor.device)


def _scripted_executor():
    from linrnn_serve.engine.executor import UniProcExecutor
    from linrnn_serve.runner.worker import Worker

    class ScriptedWorker(Worker):
        def load_model(self, calibration_tokens=None) -> None:
            self.model = ScriptedModel(self.model_config, self.dtype, self.device)
            self.head_map_description = "scripted (no model)"

    class ScriptedExecutor(UniProcExecutor):
        worker_cls = ScriptedWorker

    return ScriptedExecutor


ScriptedExecutor = _scripted_executor()


@pytest.fixture(scope="module")
def scripted_engine(tok):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    eng = LLMEngine(EngineConfig(model="tiny", executor=f"{__name__}:ScriptedExecutor", max_num_seqs=4,
                                 max_model_len=128), progress=False)
    ScriptedModel.script = eng.tokenizer.encode(SCRIPT_TEXT) + [eng.tokenizer.eos_token_ids[0]]
    return eng


def _run(eng, so, rid) -> str:
    eng.add_request(rid, PROMPT, SamplingParams(temperature=0, max_tokens=60, structured_outputs=so))
    text = None
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                text = out.outputs[0].text
    return text


def test_engine_thinking_is_free_and_the_answer_is_constrained(scripted_engine):
    eng = scripted_engine
    free = _run(eng, None, "free")
    assert free == SCRIPT_TEXT  # the script, unconstrained
    gated = _run(eng, StructuredOutputsParams(json=SCHEMA, reasoning_end="</think>"), "gated")
    thought, sep, answer = gated.partition("</think>")
    assert sep and thought == "Hmm, yes."  # the thinking as scripted: the grammar left it alone
    obj = json.loads(answer)  # the script's non-JSON answer was overruled by the grammar
    assert isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99
    ungated = _run(eng, StructuredOutputsParams(json=SCHEMA), "ungated")
    obj = json.loads(ungated)  # from the first token: no room for the thinking
    assert isinstance(obj["ok"], bool)
    eng.check_integrity()


def test_constraint_crosses_the_core_wire():
    """The API server sends the gated constraint to the engine core process (msgspec): nothing is lost."""
    from linrnn_serve.engine.protocol import AddRequest, client_decoder, encoder

    p = SamplingParams(temperature=0, allowed_token_ids=[5, 6], structured_outputs=StructuredOutputsParams(
        json=SCHEMA, reasoning_end="</think>"))
    got = client_decoder.decode(encoder.encode(AddRequest("r", [1, 2], p, 0.0)))
    assert got.params.structured_outputs == p.structured_outputs and got.params.allowed_token_ids == [5, 6]


# ---- overlapped steps (async scheduling) with grammars ------------------------------------------------
def _constrained_workload():
    J = StructuredOutputsParams(json=SCHEMA)
    kinds = [dict(structured_outputs=J, temperature=0), dict(structured_outputs=J, temperature=1.0, seed=3),
             dict(structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,6}-[0-9]{1,3}"), temperature=1.0, seed=4),
             dict(structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"]), temperature=0),
             dict(temperature=0), dict(temperature=1.0, seed=5)]
    arrivals = {}
    for i in range(12):  # two a step
        arrivals.setdefault(i // 2, []).append(
            (f"r{i}", [100 + i, 200, 300 + i], SamplingParams(max_tokens=40, **kinds[i % len(kinds)])))
    return arrivals


def test_overlapped_steps_keep_grammars_exact():
    """async_scheduling on (CPU) with constrained and free requests arriving over time: the same tokens
    as the synchronous loop, every constraint held, and the constrained steps really overlap (a step is
    in flight when step() returns)."""
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    outs, overlapped = {}, 0
    for mode in (False, True):
        eng = LLMEngine(EngineConfig(model="tiny", async_scheduling=mode, max_num_seqs=8, max_model_len=128),
                        progress=False)
        assert eng.async_scheduling is mode
        arrivals, final, step = _constrained_workload(), {}, 0
        while eng.has_unfinished_requests() or arrivals:
            for rid, prompt, p in arrivals.pop(step, []):
                eng.add_request(rid, prompt, p)
            for out in eng.step():
                if out.finished:
                    final[out.request_id] = out
            overlapped += mode and eng._inflight is not None and bool(eng.structured.constraints)
            step += 1
            assert step < 1000
        eng.check_integrity()
        outs[mode] = {rid: o.outputs[0] for rid, o in final.items()}
    assert {k: v.token_ids for k, v in outs[True].items()} == {k: v.token_ids for k, v in outs[False].items()}
    assert overlapped > 10
    for i in range(12):
        text = outs[True][f"r{i}"].text
        if i % 6 in (0, 1):
            obj = json.loads(text)
            assert isinstance(obj["ok"], bool) and 0 <= obj["n"] <= 99
        elif i % 6 == 2:
            assert __import__("re").fullmatch(r"[a-c]{2,6}-[0-9]{1,3}", text), text
        elif i % 6 == 3:
            assert text in ("alpha", "beta")
