"""Prefix caching in the engine (CPU, tiny f32 model): lossless snapshot restore at any depth,
caching on vs off, prefill granularity, usage / metrics, and a leak-free stress run."""
from __future__ import annotations

import math
import random

import pytest
import torch

from engine_fixtures import make_tiny_model_dir
from linrnn_serve.sampling_params import SamplingParams

VOCAB = 300
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def make_engine(model_dir):
    from linrnn_serve.config import EngineConfig
    from linrnn_serve.engine.llm_engine import LLMEngine

    made = []

    def make(**kw):
        kw.setdefault("max_num_seqs", 8)
        kw.setdefault("max_num_batched_tokens", 32)
        kw.setdefault("max_model_len", 256)
        kw.setdefault("block_size", 16)
        e = LLMEngine(EngineConfig(model=model_dir, **kw), progress=False)
        e.capture_logits = True
        made.append(e)
        return e

    yield make
    for e in made:  # every slot, block and snapshot accounted for
        if not e.has_unfinished_requests():
            e.check_integrity()


def run(eng, reqs, max_steps=5000):
    """reqs: {step: [(id, prompt, params)]} -> {id: RequestOutput}"""
    reqs, final, step = dict(reqs), {}, 0
    while eng.has_unfinished_requests() or reqs:
        for rid, prompt, p in reqs.pop(step, []):
            eng.add_request(rid, prompt, p)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < max_steps
    return final


def one(eng, rid, prompt, **kw):
    return run(eng, {0: [(rid, prompt, SamplingParams(**{**GREEDY, **kw}))]})[rid]


def logits_of(eng, rid):
    return {k[1:]: v for k, v in eng.logits_log.items() if k[0] == rid}


def rand_tokens(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


# ---- lossless restore -----------------------------------------------------------------------------
@pytest.mark.parametrize("tau", [math.inf, 16.0])
def test_restore_is_lossless_at_any_depth(make_engine, tau):
    """A request served from a snapshot at p == an uncached request whose prefill is split at p:
    byte-identical logits at every output position and identical greedy tokens."""
    big = dict(max_num_batched_tokens=1100, max_model_len=1100, ssm_bf16_tau=tau)
    check_lossless(make_engine(enable_prefix_caching=True, **big), make_engine(**big), hybrid=tau != math.inf)


def check_lossless(cached, plain, hybrid: bool, depths=(1, 15, 16, 17, 63, 64, 65, 1000), vocab=VOCAB):
    """(also run by tests/test_prefix_gpu.py on the GPU)"""
    if hybrid:
        assert 0.0 < cached.caches.state.f32_fraction() < 1.0  # a real f32 / bf16 split
    budget = plain.scheduler.cfg.max_num_batched_tokens
    rng = random.Random(7)
    for p in depths:
        prompt = [rng.randrange(vocab) for _ in range(p + min(p, 16))]
        one(cached, f"a{p}", prompt[:p], max_tokens=1)  # snapshot at the end of its prompt: depth p
        got = one(cached, f"b{p}", prompt, max_tokens=5)
        assert got.num_cached_tokens == p and got.metrics["num_prefill_tokens"] == len(prompt) - p
        # the reference: the same prompt, uncached, its prefill split at p (a step budget of p)
        plain.add_request(f"r{p}", prompt, SamplingParams(**GREEDY, max_tokens=5))
        plain.scheduler.cfg.max_num_batched_tokens = p
        plain.step()
        plain.scheduler.cfg.max_num_batched_tokens = budget
        ref = run(plain, {})[f"r{p}"]
        assert ref.num_cached_tokens == 0
        assert got.outputs[0].token_ids == ref.outputs[0].token_ids
        a, b = logits_of(cached, f"b{p}"), logits_of(plain, f"r{p}")
        assert a.keys() == b.keys() and len(a) == 5
        for k in a:
            assert torch.equal(a[k].view(torch.int16 if a[k].dtype == torch.bfloat16 else torch.int32),
                               b[k].view(torch.int16 if b[k].dtype == torch.bfloat16 else torch.int32)), (p, k)


# ---- caching on vs off ------------------------------------------------------------------------------
def assert_agree(on, off, ids):
    for rid in ids:
        a, b = on[0][rid], off[0][rid]
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs], rid
        la, lb = logits_of(on[1], rid), logits_of(off[1], rid)
        assert la.keys() == lb.keys()
        for k in la:
            err = (la[k] - lb[k]).abs().max() / lb[k].abs().max()
            assert err <= 1e-4, (rid, k, float(err))


def both(make_engine, reqs_fn, **kw):
    out = []
    for on in (True, False):
        eng = make_engine(enable_prefix_caching=on, **kw)
        out.append((reqs_fn(eng), eng))
    return out


def multi_turn(eng, users=3, turns=4, system=40, user_toks=7, out_toks=6, seed=0):
    """Conversations re-sent each turn: shared system prompt + per user turns + the replies."""
    rng = random.Random(seed)
    sys_prompt = rand_tokens(rng, system)
    convs = {u: list(sys_prompt) for u in range(users)}
    final = {}
    for t in range(turns):
        reqs = {}
        for u in range(users):
            convs[u] += rand_tokens(rng, user_toks)
            reqs.setdefault(u % 2, []).append((f"u{u}t{t}", list(convs[u]), SamplingParams(**GREEDY,
                                                                                              max_tokens=out_toks)))
        done = run(eng, reqs)
        for u in range(users):
            convs[u] += done[f"u{u}t{t}"].outputs[0].token_ids
        final.update(done)
    return final


def test_on_off_multi_turn_and_shared_system_prompt(make_engine):
    (on, eng_on), off = both(make_engine, multi_turn)
    assert_agree((on, eng_on), off, on.keys())
    s = eng_on.stats()
    assert s["prefix_cache_hits_total"] > 0.6 * s["prefix_cache_queries_total"]
    for rid, o in on.items():
        if not rid.endswith("t0"):  # later turns hit the previous turn's finish snapshot
            assert o.num_cached_tokens >= len(o.prompt_token_ids) - 7 - 6
    assert sum(o.metrics["num_prefill_tokens"] for o in on.values()) < \
        0.4 * sum(o.metrics["num_prefill_tokens"] for o in off[0].values())


def test_on_off_same_step_sharing_and_system_prompt_users(make_engine):
    rng = random.Random(3)
    system = rand_tokens(rng, 37)
    prompts = {f"s{i}": system + rand_tokens(rng, rng.randint(1, 20)) for i in range(6)}
    prompts["dup"] = list(prompts["s0"])  # the very same prompt
    prompts["pre"] = system[:20]  # a prompt that is a prefix of the others

    def reqs(eng):
        arrivals = {0: [], 3: [], 9: []}
        for i, (rid, p) in enumerate(prompts.items()):
            step = 0 if i < 2 else (3 if i < 5 else 9)  # s0 and s1 share a prefix in the same step
            arrivals[step].append((rid, p, SamplingParams(**GREEDY, max_tokens=5, n=2 if rid == "s2" else 1)))
        return run(eng, arrivals)

    (on, eng_on), off = both(make_engine, reqs)
    assert_agree((on, eng_on), off, prompts)
    assert on["s0"].num_cached_tokens == 0 and on["s1"].num_cached_tokens == 0
    assert max(o.num_cached_tokens for o in on.values()) >= 37


def test_on_off_after_eviction_and_preemption(make_engine):
    # 13 KV blocks of 8 tokens: preemption; 4 snapshot slots: LRU eviction all the time
    kw = dict(num_kv_blocks=14, block_size=8, max_num_seqs=6, num_prefix_snapshots=4)

    def reqs(eng):
        return multi_turn(eng, users=4, turns=3, system=20, user_toks=5, out_toks=5, seed=5)

    (on, eng_on), off = both(make_engine, reqs, **kw)
    assert_agree((on, eng_on), off, on.keys())
    s = eng_on.stats()
    assert s["num_preemptions_total"] > 0 and eng_on.prefix_cache.stats.snapshots_evicted > 0
    assert s["prefix_cache_hits_total"] > 0


def test_prompt_logprobs_recompute_and_n_forks(make_engine):
    (on, eng_on), off = both(make_engine, lambda eng: run(eng, {
        0: [("a", list(range(1, 41)), SamplingParams(**GREEDY, max_tokens=4))],
        8: [("lp", list(range(1, 45)), SamplingParams(**GREEDY, max_tokens=2, prompt_logprobs=2)),
            ("n3", list(range(1, 50)), SamplingParams(**GREEDY, max_tokens=3, n=3))]}))
    assert_agree((on, eng_on), off, ["a", "lp", "n3"])
    assert on["lp"].num_cached_tokens == 0 and on["n3"].num_cached_tokens == 40
    for x, y in zip(on["lp"].prompt_logprobs[1:], off[0]["lp"].prompt_logprobs[1:]):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)


# ---- granularity ------------------------------------------------------------------------------------
def test_granularity_any_depth(make_engine):
    """After P ran, a request sharing p tokens of P (or of P + its output) prefills at most
    16 + (its tokens after p) once a divergence snapshot at p exists, for every p >= 1."""
    eng = make_engine(enable_prefix_caching=True, max_num_batched_tokens=64, num_prefix_snapshots=400)
    rng = random.Random(11)
    P = rand_tokens(rng, 33)  # crosses two block boundaries (16, 32), then 6 output tokens
    out = one(eng, "P", P, max_tokens=6).outputs[0].token_ids
    full = P + out
    for p in range(1, len(full) + 1):
        other = [t for t in range(VOCAB) if p >= len(full) or t != full[p]]
        for k in range(4):  # the first ones create the divergence snapshot at p (if not there yet)
            # k = 3: the prompt ends exactly at p (its first token comes from the snapshot's logits)
            tail = [rng.choice(other)] + rand_tokens(rng, rng.randint(0, 5)) if k < 3 else []
            o = one(eng, f"g{p}.{k}", full[:p] + tail, max_tokens=1)
            n = o.metrics["num_prefill_tokens"]
            if k >= 1:  # the acceptance bound
                assert n <= 16 + len(tail), (p, k, n)
            if k >= 2:  # what we do: only the new part
                assert n == len(tail) and o.num_cached_tokens == p, (p, k, n)


def test_full_prompt_hit_samples_from_stored_logits(make_engine):
    """A prompt that is exactly a cached prompt runs no prefill: its first token comes from the
    snapshot's stored logits, and the whole output (greedy, seeded, n > 1) and every logits row are
    bit-identical to the first run's."""
    eng = make_engine(enable_prefix_caching=True)
    prompt = rand_tokens(random.Random(5), 37)
    for kw in (dict(max_tokens=6), dict(max_tokens=6, temperature=0.9, seed=3, n=3, ignore_eos=True)):
        a = one(eng, "x" + str(len(kw)), prompt, **kw)
        b = one(eng, "y" + str(len(kw)), prompt, **kw)
        assert b.metrics["num_prefill_tokens"] == 0 and b.num_cached_tokens == len(prompt)
        assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
        la, lb = logits_of(eng, "x" + str(len(kw))), logits_of(eng, "y" + str(len(kw)))
        assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


# ---- no leaks -----------------------------------------------------------------------------------------
def test_stress_aborts_preemption_eviction_no_leaks(make_engine):
    eng = make_engine(enable_prefix_caching=True, num_prefix_snapshots=12, max_num_seqs=8,
                      max_num_batched_tokens=40, max_model_len=96, block_size=4, num_kv_blocks=26,
                      max_queue_len=1000)
    rng = random.Random(99)
    bases = [rand_tokens(rng, n) for n in (5, 17, 30)]
    arrivals, aborts = {}, {}
    for i in range(90):
        b = rng.choice(bases)
        prompt = b[:rng.randint(0, len(b))] + rand_tokens(rng, rng.randint(1, 12))
        kw = dict(max_tokens=rng.randint(1, 10), n=rng.choice([1, 1, 2]), ignore_eos=rng.random() < 0.5)
        if rng.random() < 0.5:
            kw.update(temperature=1.0, seed=i)
        if rng.random() < 0.1:
            kw["prompt_logprobs"] = 1
        arrivals.setdefault(rng.randrange(110), []).append((f"q{i}", prompt, SamplingParams(**kw)))
        if rng.random() < 0.25:
            aborts.setdefault(rng.randrange(150), []).append(f"q{i}")
        if rng.random() < 0.3:
            bases[rng.randrange(3)] = prompt
    step, seen = 0, set()
    while eng.has_unfinished_requests() or arrivals or any(k >= step for k in aborts):
        for rid, prompt, p in arrivals.pop(step, []):
            eng.add_request(rid, prompt, p)
            seen.add(rid)
        for rid in aborts.get(step, []):
            if rid in seen:
                eng.abort(rid)
        eng.step()
        step += 1
        assert step < 20_000
    eng.check_integrity()
    s = eng.stats()
    st = eng.prefix_cache.stats
    assert s["num_preemptions_total"] > 0 and st.snapshots_evicted > 0 and st.nodes_evicted > 0
    assert s["prefix_cache_hits_total"] > 0
    eng.prefix_cache.clear()
    eng.scheduler.blocks.check_all_free()
    assert eng.prefix_cache.snapshots.num_used == 0


def test_usage_reports_cached_tokens(make_engine):
    """usage.prompt_tokens_details.cached_tokens (OpenAI's field; omitted when nothing was cached,
    as vLLM) and the hit / query counters behind vLLM's prefix_cache_{hits,queries} metrics."""
    pytest.importorskip("pydantic")
    from linrnn_server.serving import usage_info

    eng = make_engine(enable_prefix_caching=True)
    a = one(eng, "a", list(range(1, 30)), max_tokens=3)
    b = one(eng, "b", list(range(1, 30)) + [5, 6], max_tokens=2)
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 29
    assert usage_info([a]).model_dump() == {"prompt_tokens": 29, "completion_tokens": 3, "total_tokens": 32}
    assert usage_info([b]).model_dump() == {"prompt_tokens": 31, "completion_tokens": 2, "total_tokens": 33,
                                            "prompt_tokens_details": {"cached_tokens": 29}}
    s = eng.stats()
    assert (s["prefix_cache_queries_total"], s["prefix_cache_hits_total"]) == (60, 29)
    assert s["kv_cache_usage"] == 0.0 and s["prefix_cache_blocks"] > 0 and s["prefix_cache_snapshots"] >= 2
