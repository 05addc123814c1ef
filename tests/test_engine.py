"""LLMEngine / LLM / AsyncLLMEngine on the CPU with the tiny f32 model (naive reference ops)."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from engine_fixtures import make_tiny_model_dir
from linrnn_serve.engine.outputs import EngineFullError, PromptTooLongError
from linrnn_serve.sampling_params import SamplingParamError, SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(autouse=True)
def one_thread():
    """Two shared cores: OpenMP threads spinning against other processes make tiny ops 100x slower."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture
def engines():
    """Engine factory; after the test every engine must be idle with all slots and blocks free."""
    made = []
    yield made
    for e in made:
        eng = getattr(e, "engine", e)
        if not eng.has_unfinished_requests():
            eng.check_integrity()


@pytest.fixture
def make_engine(model_dir, engines):
    from linrnn_serve.engine.llm_engine import LLMEngine
    from linrnn_serve.config import EngineConfig

    def make(**kw):
        kw.setdefault("max_num_seqs", 16)
        kw.setdefault("max_num_batched_tokens", 32)
        kw.setdefault("max_model_len", 256)
        kw.setdefault("block_size", 8)
        e = LLMEngine(EngineConfig(model=model_dir, **kw), progress=False)
        engines.append(e)
        return e

    return make


def drain(eng, arrivals: dict[int, list[tuple]] | None = None, max_steps=5000):
    """Step until idle, adding (request_id, prompt, params) tuples at their step. -> {id: output}."""
    arrivals = dict(arrivals or {})
    final, step = {}, 0
    while eng.has_unfinished_requests() or arrivals:
        for rid, prompt, params in arrivals.pop(step, []):
            eng.add_request(rid, prompt, params)
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
        step += 1
        assert step < max_steps
    return final


def tokens(final):
    return {rid: [c.token_ids for c in o.outputs] for rid, o in final.items()}


def mixed_workload(seed=0, n=16, sampled=False):
    rng = random.Random(seed)
    arrivals = {}
    for i in range(n):
        plen = rng.choice([1, 2, 5, 9, 17, 33, 60])
        prompt = [rng.randrange(300) for _ in range(plen)]
        kw = dict(max_tokens=rng.randint(3, 16), ignore_eos=True, temperature=0.0)
        if sampled:
            kw.update(temperature=rng.choice([0.0, 0.7, 1.0, 1.3]), top_k=rng.choice([0, 5, 40]),
                      top_p=rng.choice([1.0, 0.9]), min_p=rng.choice([0.0, 0.05]), seed=1000 + i)
        arrivals.setdefault(rng.randrange(12), []).append((f"r{i}", prompt, SamplingParams(**kw)))
    return arrivals


def solo_outputs(make_engine, arrivals, **kw):
    eng = make_engine(**kw)
    out = {}
    for reqs in arrivals.values():
        for r in reqs:
            out.update(tokens(drain(eng, {0: [r]})))
    return out


def test_greedy_matches_a_manual_decode_loop(make_engine, model_dir):
    """The engine (chunked prefill, bucketed decode, slot/block bookkeeping) == a hand-driven loop."""
    from linrnn_serve.runner.session import Session

    eng = make_engine(max_num_batched_tokens=16)
    prompt = [7, 100, 42, 3, 250, 11, 19, 64, 5, 77, 123, 200, 9, 8, 1, 2, 3, 4, 5, 6, 7]
    out = drain(eng, {0: [("a", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))]})["a"]
    s = Session(eng.model, 1, 64)
    sid = s.new_seq()
    logits = s.forward([sid], [prompt])
    ref = []
    for _ in range(12):
        t = int(logits[0].argmax())
        ref.append(t)
        logits = s.forward([sid], [[t]])
    assert out.outputs[0].token_ids == ref


def test_greedy_batch_invariance_and_preemption(make_engine):
    """Each request's greedy output alone == inside a continuous batch of 16 mixed-length requests
    arriving at different steps (chunked prefill) == with preemption forced by a tiny KV cache."""
    work = mixed_workload()
    ref = solo_outputs(make_engine, work)
    batched = make_engine()
    assert tokens(drain(batched, mixed_workload())) == ref
    tiny = make_engine(num_kv_blocks=12)  # 11 blocks x 8 tokens for 16 sequences of up to 76 tokens
    assert tokens(drain(tiny, mixed_workload())) == ref
    assert tiny.stats()["num_preemptions_total"] > 0


def test_seeded_sampling_is_batch_invariant(make_engine):
    work = mixed_workload(seed=3, sampled=True)
    ref = solo_outputs(make_engine, work)
    eng = make_engine(num_kv_blocks=16)
    got = tokens(drain(eng, mixed_workload(seed=3, sampled=True)))
    assert got == ref
    assert eng.stats()["num_preemptions_total"] > 0


def test_n_samples(make_engine):
    eng = make_engine()
    prompt = list(range(10, 30))
    one = drain(eng, {0: [("a", prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))]})
    three = drain(eng, {0: [("b", prompt, SamplingParams(n=3, temperature=0, max_tokens=8, ignore_eos=True))]})
    assert [c.token_ids for c in three["b"].outputs] == [one["a"].outputs[0].token_ids] * 3
    assert [c.index for c in three["b"].outputs] == [0, 1, 2]
    p = SamplingParams(n=4, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    s1 = tokens(drain(eng, {0: [("c", prompt, p)]}))["c"]
    s2 = tokens(drain(eng, {0: [("c", prompt, p), ("d", [1, 2, 3], SamplingParams(max_tokens=20))]}))["c"]
    assert s1 == s2 and len({tuple(x) for x in s1}) > 1


def test_logprobs_and_prompt_logprobs(make_engine):
    from helpers import run_prompt

    eng = make_engine()
    prompt = [5, 17, 200, 31, 99, 4, 250, 8, 60, 2, 7, 19, 300, 41, 13, 77, 91, 23, 45, 67]  # 20: 2 chunks
    out = drain(eng, {0: [("a", prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True,
                                                       logprobs=3, prompt_logprobs=2))]})["a"]
    full = prompt + out.outputs[0].token_ids
    ref = torch.log_softmax(run_prompt(eng.model, full).float(), -1)
    plp = out.prompt_logprobs
    assert plp[0] is None and len(plp) == len(prompt)
    for i in range(1, len(prompt)):
        d = plp[i]
        assert d[prompt[i]] == pytest.approx(ref[i - 1, prompt[i]].item(), abs=1e-4)
        top = ref[i - 1].topk(2).indices.tolist()
        assert set(top) <= set(d)
    for j, (t, d) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[len(prompt) - 1 + j]
        assert d[t] == pytest.approx(row[t].item(), abs=1e-4)
        assert t == int(row.argmax())
        assert set(row.topk(3).indices.tolist()) <= set(d)


def test_logits_exposed_match_model(make_engine):
    from helpers import run_prompt

    eng = make_engine()
    eng.capture_logits = True
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    out = drain(eng, {0: [("a", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))]})["a"]
    full = prompt + out.outputs[0].token_ids
    ref = run_prompt(eng.model, full)
    for j in range(5):
        got = eng.logits_log[("a", 0, j)]
        assert torch.allclose(got, ref[len(prompt) - 1 + j], atol=1e-4, rtol=1e-4)


def test_penalties_and_min_tokens(make_engine):
    eng = make_engine()
    prompt = [9, 9, 9, 9, 12, 12, 40]
    base = drain(eng, {0: [("a", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))]})
    base = base["a"].outputs[0].token_ids
    pen = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=2.0, presence_penalty=1.0,
                         repetition_penalty=1.5)
    # a penalised request next to plain ones: the plain ones are unaffected, the penalised one is stable
    got = drain(eng, {0: [("p", prompt, pen), ("a", prompt, SamplingParams(temperature=0, max_tokens=24,
                                                                             ignore_eos=True))]})
    assert got["a"].outputs[0].token_ids == base
    alone = drain(eng, {0: [("p", prompt, pen)]})
    assert alone["p"].outputs[0].token_ids == got["p"].outputs[0].token_ids
    assert max(map(got["p"].outputs[0].token_ids.count, set(got["p"].outputs[0].token_ids))) <= \
        max(map(base.count, set(base)))
    # min_tokens bans EOS / stop ids until reached
    stop_id = base[2]
    r = drain(eng, {0: [("m", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                      stop_token_ids=[stop_id], min_tokens=6))]})["m"].outputs[0]
    assert stop_id not in r.token_ids[:6]
    assert r.finish_reason == "length" or (r.token_ids[-1] == stop_id and r.stop_reason == stop_id)


def test_stop_strings_and_text(make_engine):
    eng = make_engine()
    tok = eng.tokenizer
    p = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    out = drain(eng, {0: [("a", "hello world", p)]})["a"].outputs[0]
    full = tok.decode(out.token_ids)
    assert out.text == full
    clean = [i for i in range(2, len(full) - 3) if "\ufffd" not in full[i:i + 3]]
    if not clean:
        pytest.skip("generated text has no clean 3-character span")
    i = clean[len(clean) // 2]
    stop = full[i:i + 3]
    first = full.index(stop)
    r = drain(eng, {0: [("b", "hello world", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                             stop=[stop]))]})["b"].outputs[0]
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.text == full[:first]


def test_errors(make_engine):
    eng = make_engine(max_model_len=64, max_queue_len=2)
    with pytest.raises(PromptTooLongError):
        eng.add_request("x", list(range(60)), SamplingParams(max_tokens=10))
    with pytest.raises(PromptTooLongError):
        eng.add_request("x", list(range(64)), SamplingParams(max_tokens=None))
    with pytest.raises(ValueError, match="vocabulary"):
        eng.add_request("x", [1, 2, 100000], SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("x", [], SamplingParams())
    with pytest.raises(SamplingParamError):
        eng.add_request("x", [1, 2], SamplingParams(top_p=0.0))
    eng.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [1, 2], SamplingParams(max_tokens=2))
    eng.add_request("b", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(EngineFullError):
        eng.add_request("c", [1, 2], SamplingParams(max_tokens=2))
    drain(eng)


def test_abort_mid_flight(make_engine):
    eng = make_engine()
    eng.add_request("a", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", [4, 5, 6], SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(3):
        eng.step()
    out = eng.abort("a")
    assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) >= 1
    assert eng.abort("a") is None
    final = drain(eng)
    assert final["b"].outputs[0].finish_reason == "length"


def test_llm_generate_api(model_dir, engines):
    from linrnn_serve.llm import LLM

    llm = LLM(model_dir, progress=False, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=128,
              max_queue_len=2)
    engines.append(llm.engine)
    outs = llm.generate(["hello", "café 你好", [1, 2, 3], "x"],
                        [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 4, 5, 6)])
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 4, 5, 6]
    assert outs[0].prompt == "hello" and outs[2].prompt is None and outs[2].prompt_token_ids == [1, 2, 3]
    one = llm.generate([1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    assert one[0].outputs[0].token_ids == outs[2].outputs[0].token_ids
    chat = llm.get_tokenizer().apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_stats_snapshot(make_engine):
    eng = make_engine()
    drain(eng, {0: [("a", [1, 2, 3, 4], SamplingParams(max_tokens=6, ignore_eos=True))]})
    s = eng.stats()
    assert s["prompt_tokens_total"] == 4 and s["generation_tokens_total"] == 6
    assert s["num_requests_running"] == 0 and s["kv_cache_usage"] == 0.0
    assert s["time_to_first_token_seconds"]["count"] == 1
    assert s["inter_token_latency_seconds"]["count"] == 1
    assert s["request_success_total"] == {"length": 1}


def test_async_engine(make_engine, engines):
    from linrnn_serve.engine.async_engine import AsyncLLMEngine, EngineDeadError

    eng = make_engine(max_queue_len=64)
    aeng = AsyncLLMEngine(eng)

    async def consume(rid, prompt, params, stop_after=None):
        outs = []
        async for o in aeng.generate(prompt, params, rid):
            outs.append(o)
            if stop_after is not None and len(outs) >= stop_after:
                break
        return outs

    async def main():
        p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        res = await asyncio.gather(*(consume(f"r{i}", [i + 1, 2, 3], p) for i in range(6)))
        for outs in res:
            assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 8
            lens = [len(o.outputs[0].token_ids) for o in outs]
            assert lens == sorted(lens)  # cumulative
        # leaving the loop early aborts the request
        early = await consume("e", [5, 6], SamplingParams(max_tokens=200, ignore_eos=True), stop_after=2)
        assert not early[-1].finished
        # explicit abort ends the stream with finish_reason abort
        gen = aeng.generate([7, 8], SamplingParams(max_tokens=200, ignore_eos=True), "ab")
        first = await gen.__anext__()
        assert not first.finished
        await aeng.abort("ab")
        last = first
        async for o in gen:
            last = o
        assert last.finished and last.outputs[0].finish_reason == "abort"
        with pytest.raises(PromptTooLongError):
            await consume("long", list(range(300)), SamplingParams(max_tokens=4))
        text = await consume("t", "hello world", SamplingParams(temperature=0, max_tokens=4))
        assert text[-1].prompt == "hello world"
        for _ in range(100):  # the aborted requests leave the engine between steps
            if not eng.has_unfinished_requests():
                break
            await asyncio.sleep(0.02)
        s = aeng.stats()
        assert s["num_requests_running"] == 0
        # graceful shutdown: in-flight requests finish, new ones are refused
        task = asyncio.ensure_future(consume("f", [1], SamplingParams(max_tokens=10, ignore_eos=True)))
        await asyncio.sleep(0.05)
        await aeng.shutdown(mode="finish", timeout=30)
        outs = await task
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
        with pytest.raises(EngineDeadError):
            await consume("late", [1], SamplingParams(max_tokens=2))

    asyncio.run(main())
    assert not aeng._thread.is_alive()


def test_async_engine_full_queue(make_engine):
    from linrnn_serve.engine.async_engine import AsyncLLMEngine

    eng = make_engine(max_queue_len=1, max_num_seqs=1, max_num_batched_tokens=4)
    aeng = AsyncLLMEngine(eng)

    async def main():
        p = SamplingParams(max_tokens=30, ignore_eos=True)
        g1 = aeng.generate([1, 2, 3, 4, 5, 6, 7, 8], p, "a")
        await g1.__anext__()  # a is running
        g2 = aeng.generate([1, 2], p, "b")
        t2 = asyncio.ensure_future(g2.__anext__())  # b waits in the queue (slot held by a)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineFullError):
            await aeng.generate([3], p, "c").__anext__()
        await aeng.shutdown(mode="abort")
        await t2
        for g in (g1, g2):
            async for _ in g:
                pass

    asyncio.run(main())


def test_cache_budget(model_dir):
    from linrnn_serve.cache.budget import CacheBudgetError, compute_budget, state_bytes_per_seq
    from linrnn_serve.cache.state_pool import HybridStateCache
    from linrnn_serve.config import ModelConfig
    from linrnn_serve.runner.cuda_graphs import decode_buckets

    cfg = ModelConfig.from_pretrained(model_dir)
    kw = dict(act_dtype=torch.bfloat16, kv_dtype=torch.bfloat16, max_num_seqs=8, max_model_len=256, block_size=16,
              gpu_memory_utilization=0.5)
    heads = [[h % 2 == 0 for h in range(cfg.linear_num_value_heads)] for _ in cfg.gdn_layers]
    assert state_bytes_per_seq(cfg, torch.bfloat16, heads) == \
        HybridStateCache(cfg, 2, torch.bfloat16, "cpu", heads).bytes_per_seq()
    cpu = compute_budget(cfg, device=torch.device("cpu"), **kw)
    assert cpu.num_state_slots == 9 and cpu.num_kv_blocks == 8 * 16 + 1  # capped at what 8 x 256 tokens use
    assert compute_budget(cfg, device=torch.device("cpu"), num_kv_blocks=5, **kw).num_kv_blocks == 5
    gib = 1 << 30
    # GPU arithmetic with a given (free, total): 0.5 x 80 GiB - 30 GiB in use leaves ~10 GiB minus reserves
    big = dict(kw, max_model_len=1 << 24)  # no cap from max_num_seqs x max_model_len
    g = compute_budget(cfg, device=torch.device("cuda"), mem_info=(50 * gib, 80 * gib), activation_peak=gib, **big)
    left = 40 * gib - 30 * gib - g.state_bytes - gib - g.graph_reserve
    assert g.num_kv_blocks == left // g.kv_bytes_per_block + 1
    with pytest.raises(CacheBudgetError, match="max_model_len"):
        compute_budget(cfg, device=torch.device("cuda"), mem_info=(1 * gib, 80 * gib), **big)
    assert decode_buckets(1) == [1] and decode_buckets(20) == [1, 2, 4, 8, 16, 24]
    assert decode_buckets(64)[-3:] == [48, 56, 64]
