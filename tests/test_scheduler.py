"""Scheduler tests without a model: a fake runner keeps a simulated KV cache and recurrent state
and checks, at every step, that each sequence's state slot holds exactly the tokens it has
consumed and that its block table reads back its own tokens (catches wrong slots, block tables,
copy-on-write, preemption and fork bugs). Its "model" picks the next token as a hash of the whole
history, so any corruption changes the output."""
from __future__ import annotations

import random

import pytest

from linrnn_serve.cache.allocator import BlockAllocator, SlotAllocator
from linrnn_serve.runner.plan import StepResult, uniform_for
from linrnn_serve.sampling_params import SamplingParams
from linrnn_serve.scheduler import Request, Scheduler, SchedulerConfig

VOCAB = 50
EOS = 3


class FakeRunner:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, max_blocks: int):
        self.bs = block_size
        self.tables = [[0] * max_blocks for _ in range(num_slots)]
        self.kv: dict[tuple[int, int], int] = {}
        self.state: dict[int, tuple[int, ...]] = {}
        self.num_blocks = num_blocks

    def _write(self, table, pos, tok):
        b = table[pos // self.bs]
        assert b != 0, "wrote into the dummy block"
        self.kv[(b, pos % self.bs)] = tok

    def _check_kv(self, table, history):
        for p, t in enumerate(history):
            assert self.kv.get((table[p // self.bs], p % self.bs)) == t, f"KV of position {p} corrupted"

    @staticmethod
    def next_token(history, row) -> int:
        h = hash((tuple(history), None if row.is_greedy else round(uniform_for(row.seed, row.out_index), 12))) % VOCAB
        if h in row.banned_token_ids:
            h = (h + 1) % VOCAB
        return h

    def execute(self, plan) -> StepResult:
        for slot, start, blocks in plan.block_table_updates:
            assert slot != 0
            self.tables[slot][start:start + len(blocks)] = blocks
        for s in plan.reset_slots:
            self.state[s] = ()
        for src, dst in plan.block_copies:
            for o in range(self.bs):
                if (src, o) in self.kv:
                    self.kv[(dst, o)] = self.kv[(src, o)]
        res = StepResult()
        seen_slots = set()
        for row in plan.decode:
            assert row.slot not in seen_slots
            seen_slots.add(row.slot)
            st = self.state[row.slot]
            assert len(st) == row.position
            table = self.tables[row.slot]
            self._check_kv(table, st)
            self._write(table, row.position, row.token_id)
            st = st + (row.token_id,)
            self.state[row.slot] = st
            res.sampled[row.sampling.seq_id] = self.next_token(st, row.sampling)
        for row in plan.prefill:
            assert row.slot not in seen_slots
            seen_slots.add(row.slot)
            st = self.state[row.slot]
            assert len(st) == row.start_pos
            assert self.tables[row.slot][:len(row.block_table)] == row.block_table
            self._check_kv(row.block_table, st)
            for j, t in enumerate(row.token_ids):
                self._write(row.block_table, row.start_pos + j, t)
            st = st + tuple(row.token_ids)
            self.state[row.slot] = st
            for s in row.samples:
                res.sampled[s.seq_id] = self.next_token(st, s)
            if row.prompt_logprobs is not None:
                res.prompt_logprobs[row.seq_id] = [{t: -1.0} for t in row.next_token_ids if t is not None]
        for src, dst in plan.slot_copies:
            self.state[dst] = self.state[src]
        return res


class CharDetok:
    """Token t -> one character chr(ord('a') + t % 26)."""

    def update(self, t):
        return chr(ord("a") + t % 26)

    def flush(self):
        return ""


def make(max_num_seqs=8, budget=32, max_model_len=128, block_size=4, num_blocks=None, detok=True):
    blocks_needed = max_num_seqs * -(-max_model_len // block_size) + 1
    nb = num_blocks or blocks_needed
    sch = Scheduler(SchedulerConfig(max_num_seqs, budget, max_model_len, block_size, watermark=0.0),
                    SlotAllocator(max_num_seqs + 1), BlockAllocator(nb), eos_token_ids={EOS},
                    detokenizer_factory=(lambda ids, p: CharDetok()) if detok else None)
    runner = FakeRunner(max_num_seqs + 1, nb, block_size, -(-max_model_len // block_size))
    return sch, runner


def run(sch, runner, arrivals: dict[int, list[Request]] | None = None, max_steps=10_000, abort_at=None):
    """Step until idle; arrivals[step] are added before that step. Returns {request_id: Request}."""
    arrivals = dict(arrivals or {})
    done = {}
    step = 0
    while sch.has_unfinished() or arrivals:
        for r in arrivals.pop(step, []):
            sch.add_request(r)
        for rid in (abort_at or {}).get(step, []):
            req = sch.abort_request(rid)
            if req is not None:
                done[rid] = req
        plan = sch.schedule()
        assert plan.num_tokens <= sch.cfg.max_num_batched_tokens
        assert len(plan.decode) + len(plan.prefill) <= sch.cfg.max_num_seqs
        if not plan.empty:
            for req in sch.postprocess(plan, runner.execute(plan)):
                if req.finished:
                    done[req.request_id] = req
        step += 1
        assert step < max_steps, "no progress"
    sch.check_idle_integrity()
    return done


def req(rid, prompt_len, seed=0, **kw):
    rng = random.Random(hash(rid) & 0xFFFF)
    kw.setdefault("max_tokens", 8)
    kw.setdefault("temperature", 0.0)
    return Request(rid, [4 + rng.randrange(VOCAB - 4) for _ in range(prompt_len)], SamplingParams(**kw), seed)


def outputs(done):
    return {rid: [s.output_token_ids for s in r.seqs] for rid, r in done.items()}


def workload(n=16, seed=0):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(n):
        arrivals.setdefault(rng.randrange(10), []).append(
            req(f"r{i}", rng.randint(1, 40), max_tokens=rng.randint(1, 20), ignore_eos=True))
    return arrivals


def solo(arrivals, **kw):
    out = {}
    for reqs in arrivals.values():
        for r in reqs:
            sch, runner = make(**kw)
            fresh = Request(r.request_id, r.prompt_token_ids, r.params, r.seed)
            out.update(outputs(run(sch, runner, {0: [fresh]})))
    return out


def test_batched_equals_solo():
    ref = solo(workload())
    sch, runner = make(max_num_seqs=16, budget=24)
    assert outputs(run(sch, runner, workload())) == ref


def test_preemption_keeps_outputs():
    ref = solo(workload())
    # 24 blocks of 4 tokens: far less than 16 sequences of up to 60 tokens need
    sch, runner = make(max_num_seqs=16, budget=24, num_blocks=24)
    assert outputs(run(sch, runner, workload())) == ref
    assert sch.stats.num_preemptions > 0


def test_chunked_prefill_respects_budget_and_decodes_continue():
    sch, runner = make(max_num_seqs=4, budget=8)
    sch.add_request(req("a", 3, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        sch.postprocess(p := sch.schedule(), runner.execute(p))
    sch.add_request(req("b", 50, max_tokens=2, ignore_eos=True))
    plan = sch.schedule()
    assert len(plan.decode) == 1 and plan.prefill and len(plan.prefill[0].token_ids) == 7
    sch.postprocess(plan, runner.execute(plan))
    plan = sch.schedule()  # b continues its prefill while a keeps decoding
    assert len(plan.decode) == 1 and plan.prefill[0].start_pos == 7
    sch.postprocess(plan, runner.execute(plan))
    run(sch, runner)


def test_n_samples_fork_shares_prompt():
    sch, runner = make(max_num_seqs=8, budget=64, block_size=4)
    r = req("x", 10, n=3, max_tokens=6, ignore_eos=True)
    sch.add_request(r)
    plan = sch.schedule()
    assert len(plan.prefill) == 1 and len(plan.prefill[0].samples) == 3
    assert len(plan.slot_copies) == 2
    # prompt blocks are shared by all three samples
    assert all(sch.blocks.refcount(b) == 3 for b in r.seqs[0].blocks)
    sch.postprocess(plan, runner.execute(plan))
    plan = sch.schedule()
    assert len(plan.block_copies) == 2  # the partly filled last block is copied on first write
    sch.postprocess(plan, runner.execute(plan))
    done = run(sch, runner)
    outs = [s.output_token_ids for s in done["x"].seqs]
    assert outs[0] == outs[1] == outs[2]  # greedy: identical samples
    assert outs[0] == solo({0: [req("x", 10, max_tokens=6, ignore_eos=True)]})["x"][0]


def test_n_samples_seeded_are_distinct_and_reproducible():
    a = outputs(run(*make(), {0: [req("s", 5, seed=7, n=3, temperature=1.0, max_tokens=8, ignore_eos=True)]}))
    b = outputs(run(*make(max_num_seqs=4, budget=4, num_blocks=12),
                    {0: [req("s", 5, seed=7, n=3, temperature=1.0, max_tokens=8, ignore_eos=True),
                         req("t", 9, seed=1, temperature=1.0, max_tokens=12, ignore_eos=True)]}))
    assert a["s"] == b["s"]
    assert len({tuple(o) for o in a["s"]}) == 3


def test_preempt_parent_before_fork_and_abort():
    sch, runner = make(max_num_seqs=4, budget=4, num_blocks=8, block_size=4)
    sch.add_request(req("a", 6, max_tokens=20, ignore_eos=True))
    sch.add_request(req("b", 12, n=2, max_tokens=4, ignore_eos=True))
    done = run(sch, runner, abort_at={5: ["a"]})
    assert done["a"].seqs[0].finish_reason == "abort"
    assert [s.finish_reason for s in done["b"].seqs] == ["length", "length"]


def test_abort_waiting_running_and_unknown():
    sch, runner = make(max_num_seqs=2, budget=8)
    for i in range(4):
        sch.add_request(req(f"r{i}", 5, max_tokens=50, ignore_eos=True))
    assert sch.num_waiting_requests == 4
    sch.postprocess(p := sch.schedule(), runner.execute(p))
    assert sch.num_waiting_requests == 2  # budget 8: r0 (5 tokens) and the first 3 tokens of r1
    assert sch.abort_request("r3").seqs[0].finish_reason == "abort"
    assert sch.abort_request("r0") is not None
    assert sch.abort_request("nope") is None
    assert sch.abort_request("r0") is None
    done = run(sch, runner)
    assert set(done) == {"r1", "r2"}


def test_stop_conditions():
    sch, runner = make()
    # find what the fake model generates, then use its tokens as stop conditions
    base = outputs(run(sch, runner, {0: [req("p", 7, max_tokens=12, ignore_eos=True)]}))["p"][0]
    stop_id = base[4]
    first = base.index(stop_id)
    r = run(*make(), {0: [req("p", 7, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id])]})["p"].seqs[0]
    assert r.output_token_ids == base[:first + 1] and r.finish_reason == "stop" and r.stop_reason == stop_id
    # min_tokens masks the stop id (the fake model then picks another token)
    r = run(*make(), {0: [req("p", 7, max_tokens=12, ignore_eos=True, stop_token_ids=[stop_id],
                              min_tokens=first + 2)]})["p"].seqs[0]
    assert stop_id not in r.output_token_ids[:first + 2]
    # stop string across token boundaries (one char per token): cut before it, or keep it
    text = "".join(chr(ord("a") + t % 26) for t in base)
    stop = text[3:6]
    r = run(*make(), {0: [req("p", 7, max_tokens=12, ignore_eos=True, stop=[stop])]})["p"].seqs[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.text == text[:text.index(stop)]
    r = run(*make(), {0: [req("p", 7, max_tokens=12, ignore_eos=True, stop=[stop],
                              include_stop_str_in_output=True)]})["p"].seqs[0]
    assert r.text == text[:text.index(stop) + 3]
    # max_tokens and the context limit
    r = run(*make(), {0: [req("p", 7, max_tokens=5, ignore_eos=True)]})["p"].seqs[0]
    assert r.num_output == 5 and r.finish_reason == "length"
    r = run(*make(max_model_len=10), {0: [req("p", 7, max_tokens=None, ignore_eos=True)]})["p"].seqs[0]
    assert len(r.token_ids) == 10 and r.finish_reason == "length"


def test_eos_and_ignore_eos():
    # search a prompt whose greedy continuation hits EOS
    for k in range(200):
        r = req(f"e{k}", 5, max_tokens=30)
        out = run(*make(), {0: [r]})[r.request_id].seqs[0]
        if out.finish_reason == "stop":
            break
    else:
        pytest.skip("no EOS in 200 fake prompts")
    assert out.output_token_ids[-1] == EOS and out.stop_reason is None
    again = run(*make(), {0: [Request(r.request_id, r.prompt_token_ids, SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True), 0)]})[r.request_id].seqs[0]
    assert again.finish_reason == "length" and again.output_token_ids[:out.num_output] == out.output_token_ids


def test_visible_text_holds_back_stop_prefix():
    sch, runner = make()
    sch.add_request(req("h", 4, max_tokens=6, ignore_eos=True, stop=["zzzz"]))
    sch.postprocess(p := sch.schedule(), runner.execute(p))
    seq = sch.requests["h"].seqs[0]
    for _ in range(3):
        sch.postprocess(p := sch.schedule(), runner.execute(p))
    assert seq.visible_text() == seq.text[:-3]
    run(sch, runner)


@pytest.mark.parametrize("stop", [["zzzzzzzzzz"], ["q"], ["zzzzzzzzzz", "bc"]])
def test_visible_text_only_grows(stop):
    """Streamed text is never taken back: each step's visible text extends the previous one, also
    while the text is shorter than the held-back stop-string prefix (issue #18), and the final text
    extends the last visible one."""
    sch, runner = make()
    for i in range(4):
        sch.add_request(req(f"g{i}", 3 + i, max_tokens=12, ignore_eos=True, stop=stop))
    seqs = {}
    shown: dict[str, list[str]] = {}
    while sch.has_unfinished():
        plan = sch.schedule()
        for r in sch.postprocess(plan, runner.execute(plan)):
            for s in r.seqs:
                seqs[r.request_id] = s
                shown.setdefault(r.request_id, []).append(s.visible_text())
    for rid, texts in shown.items():
        for a, b in zip(texts, texts[1:]):
            assert b.startswith(a), (rid, texts)
        assert texts[-1] == seqs[rid].text


def test_prompt_logprobs_chunks_cover_prompt_once():
    sch, runner = make(max_num_seqs=2, budget=5, num_blocks=10)
    sch.add_request(req("a", 6, max_tokens=30, ignore_eos=True))
    sch.add_request(req("p", 13, max_tokens=3, ignore_eos=True, prompt_logprobs=1))
    done = run(sch, runner)
    plp = done["p"].prompt_logprobs
    assert plp[0] is None and len(plp) == 13
    assert [list(d)[0] for d in plp[1:]] == done["p"].prompt_token_ids[1:]


def test_uniform_for_is_a_pure_function():
    assert uniform_for(5, 3) == uniform_for(5, 3)
    us = [uniform_for(11, p) for p in range(2000)]
    assert 0 < min(us) and max(us) < 1 and abs(sum(us) / len(us) - 0.5) < 0.03


def test_rejects_bad_config():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        Scheduler(SchedulerConfig(8, 4, 64, 4), SlotAllocator(9), BlockAllocator(10))
