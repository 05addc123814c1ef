"""Short prefill padded to token buckets (runner/prefill_graphs.py; the layout its CUDA graphs capture).

CPU: the padded forward against the plain unpadded one on a tiny model, with the reference ops and with
every Triton kernel (the interpreter; compiled kernels on a CUDA machine): same sampled tokens, logits
and states of the real sequences, and nothing outside the dummy slot 0 / block 0 touched. The dummy
slot, the dummy block and every unused slot / block are NaN-poisoned, so a real row that read padding
(or padding that wrote a live slot) fails. GPU (`-m gpu`): captured prefill graphs equal the same
padded forward run eagerly, bit for bit, on the engine (tests/test_engine_gpu.py covers the greedy
streams graphs on vs off).
"""
from __future__ import annotations

import math

import pytest
import torch

from helpers import make_hf_checkpoint, rel_err
from test_engine_gpu import a3b_dir, tiny_dir  # noqa: F401 (fixtures)
from linrnn_kernels.dispatch import reference_ops, triton_on
from linrnn_serve.cache import HybridStateCache, ModelCaches, PagedKVCache
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model
from linrnn_serve.runner.model_runner import ModelRunner
from linrnn_serve.runner.plan import DecodeRow, PrefillRow, SamplingRow, StepPlan
from linrnn_serve.runner.prefill_graphs import (
    MAX_TOKENS_ENV, PREFILL_GRAPH_MAX_TOKENS, PrefillGraphs, prefill_buckets,
)

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
SLOTS, BLOCKS, BS = 7, 24, 16


def test_prefill_buckets(monkeypatch):
    # powers of two to 128, then four per octave: at most 25 % padding above 128 tokens
    assert prefill_buckets(2048) == [16, 32, 64, 128, 160, 192, 224, 256, 320, 384, 448, 512, 640, 768, 896, 1024,
                                     1280, 1536, 1792, 2048]
    assert all(b / a <= 1.25 for a, b in zip(prefill_buckets(2048)[3:], prefill_buckets(2048)[4:]))
    assert prefill_buckets(300) == [16, 32, 64, 128, 160, 192, 224, 256, 320]
    assert prefill_buckets(2048, per_octave=1) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    monkeypatch.setenv("LINRNN_PREFILL_BUCKETS", "pow2")
    assert prefill_buckets(2048) == [16, 32, 64, 128, 256, 512, 1024, 2048]
    monkeypatch.delenv("LINRNN_PREFILL_BUCKETS")
    assert prefill_buckets(100) == [16, 32, 64, 128]
    assert prefill_buckets(1) == [16]
    assert prefill_buckets(10 ** 6)[-1] == PREFILL_GRAPH_MAX_TOKENS
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        prefill_buckets(0)


def test_full_budget_step_is_graphed(monkeypatch):
    """The default 8192-token budget is captured whole: a c = 64 wave (64 prompts of 128 tokens, one step) replays
    the 8192-token graph instead of running eagerly (it did with the buckets capped at 4096)."""
    assert PREFILL_GRAPH_MAX_TOKENS == 8192
    assert prefill_buckets(8192)[-5:] == [4096, 5120, 6144, 7168, 8192]
    g = _graphs(max_num_seqs=64, max_tokens=8192, max_model_len=8192)
    assert g.buckets[-1] == 8192 and g.rows(8192) == 65
    assert g.bucket_for(64 * 128, 64, 64) == 8192
    assert g.bucket_for(4097, 2, 2) == 5120 and g.bucket_for(8192, 1, 1) == 8192  # a full chunk of a long prompt
    assert g.bucket_for(8193, 1, 1) is None
    monkeypatch.setenv(MAX_TOKENS_ENV, "4096")  # the A/B control: the old cap
    assert prefill_buckets(8192)[-1] == 4096
    assert _graphs(max_num_seqs=64, max_tokens=8192, max_model_len=8192).bucket_for(64 * 128, 64, 64) is None
    for bad in ("8", "many"):
        monkeypatch.setenv(MAX_TOKENS_ENV, bad)
        with pytest.raises(ValueError, match=MAX_TOKENS_ENV):
            prefill_buckets(8192)


class _Cfg:
    vocab_size = 8


class _Model:
    cfg, dtype = _Cfg(), torch.float32


def _graphs(max_num_seqs=4, max_tokens=64, max_model_len=40):
    return PrefillGraphs(_Model(), None, max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                         max_model_len=max_model_len, block_size=BS, device=torch.device("cpu"))


def test_bucket_choice():
    g = _graphs()
    assert g.buckets == [16, 32, 64]
    assert [g.rows(b) for b in g.buckets] == [5, 5, 5]
    assert g.bucket_for(2, 1, 1) == 16 and g.bucket_for(16, 2, 2) == 16 and g.bucket_for(17, 1, 1) == 32
    assert g.bucket_for(1, 1, 1) is None and g.bucket_for(3, 3, 3) is None  # one token per row: decode kernels
    assert g.bucket_for(64, 4, 5) == 64
    assert g.bucket_for(65, 1, 1) is None  # above the largest bucket: plain eager
    assert g.bucket_for(20, 2, 6) is None  # more logits rows than the bucket has
    # rows never equal tokens (the attention would take T == B for one token per sequence)
    assert _graphs(max_num_seqs=15).rows(16) == 17
    assert all(g2.rows(b) != b for g2 in (_graphs(n) for n in (1, 7, 15, 31, 64)) for b in g2.buckets)


def test_staged_layout():
    """Real sequences first, then the padding sequence (dummy slot 0, every position in dummy block 0),
    then empty sequences; logits rows padded with the last real token."""
    g = _graphs()
    g.stage(32, [([5, 6, 7], 0, 3, [4]), (list(range(10, 30)), 14, 2, [1, 2, 5])], [2, 22])
    ids, pos, slots, sel = (t.tolist() for t in g._views(g._i64, 32))
    cu, lens, state, tables = g._views(g._i32, 32)
    assert ids == [5, 6, 7] + list(range(10, 30)) + [0] * 9
    assert pos == [0, 1, 2] + list(range(14, 34)) + list(range(9))
    assert slots[:3] == [64, 65, 66]
    assert slots[3:23] == [16 + p for p in range(14, 16)] + [32 + p - 16 for p in range(16, 32)] + [80, 81]
    assert slots[23:] == list(range(9))  # block 0
    assert cu.tolist() == [0, 3, 23, 32, 32, 32] and lens.tolist() == [3, 34, 9, 0, 0]
    assert state.tolist() == [3, 2, 0, 0, 0] and sel == [2, 22, 22, 22, 22]
    assert tables[0, :1].tolist() == [4] and tables[1, :3].tolist() == [1, 2, 5]
    assert tables[0, 1:].eq(0).all() and tables[2:].eq(0).all()
    with pytest.raises(ValueError, match="cannot hold"):
        g.stage(32, [([1] * 20, 0, 1, [1])], [19])


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    path = make_hf_checkpoint(tmp_path_factory.mktemp("tiny"))
    return load_model(ModelConfig.from_pretrained(path), str(path), torch.float32, DEVICE, progress=False)


def _runner(model, pad: bool, dummy_nan: bool) -> ModelRunner:
    """Every slot and block NaN-poisoned (fresh slots are reset by the plans); the dummy slot 0 and block 0
    too, or (dummy_nan False: the interpreter's argmax refuses all-NaN padding rows) with large finite
    garbage that a real row reading it would show."""
    cfg = model.cfg
    caches = ModelCaches(HybridStateCache(cfg, SLOTS, model.dtype, DEVICE),
                         PagedKVCache(cfg, BLOCKS, BS, model.dtype, DEVICE))
    g = torch.Generator(device=DEVICE).manual_seed(5)
    for t in caches.state.ssm_f32 + caches.state.ssm_bf16 + [caches.state.conv]:
        t.fill_(math.nan)
        dummy = t[:, 0] if t is caches.state.conv else t[0]
        if not dummy_nan:
            dummy.copy_(100 * torch.randn(dummy.shape, generator=g, device=DEVICE))
    caches.kv.kv.fill_(math.nan)
    if not dummy_nan:
        caches.kv.kv[:, :, 0] = 100 * torch.randn(caches.kv.kv[:, :, 0].shape, generator=g, device=DEVICE)
    return ModelRunner(model, caches, max_num_seqs=4, max_model_len=128, block_size=BS,
                       max_num_batched_tokens=64, pad_prefill=pad, progress=False)


def _greedy(seq_id):
    return [SamplingRow(seq_id)]


def _plans():
    """Fresh prompts with a middle chunk, a mixed decode + prefill step, one above the largest bucket."""
    g = torch.Generator().manual_seed(3)

    def toks(n):
        return torch.randint(0, 128, (n,), generator=g).tolist()

    b_prompt = toks(50)
    return [
        StepPlan(prefill=[PrefillRow(1, toks(5), 0, 1, [1], samples=_greedy(1)),
                          PrefillRow(2, b_prompt[:20], 0, 2, [2, 3])],  # a middle chunk: no sample
                 reset_slots=[1, 2], block_table_updates=[(1, 0, [1])]),
        StepPlan(decode=[DecodeRow(9, 5, 1, SamplingRow(1))],
                 prefill=[PrefillRow(2, b_prompt[20:], 20, 2, [2, 3, 4, 5], samples=_greedy(2)),
                          PrefillRow(3, toks(9), 0, 3, [6], samples=_greedy(3) + _greedy(4))],  # n = 2 fork
                 reset_slots=[3]),
        StepPlan(prefill=[PrefillRow(5, toks(70), 0, 4, [7, 8, 9, 10, 11], samples=_greedy(5))],  # > 64: eager
                 reset_slots=[4]),
    ]


def _run(model, pad: bool, kernels: bool, capture: bool = False):
    r = _runner(model, pad, dummy_nan=not kernels)
    if capture:
        r.capture_graphs()
        assert r.use_graphs and r.prefill_graphs.use_graphs and (32, "prefill") in r.prefill_graphs.graphs
    out = []
    for plan in _plans()[:2] if kernels and not CUDA else _plans():  # (the interpreter: the padded steps only)
        if kernels:
            with triton_on("cpu"):
                res = r.execute(plan)
        else:
            with reference_ops():
                res = r.execute(plan)
        out.append((dict(res.sampled),
                    {k: v.clone() for k, v in r.last_logits().items()}))
    return out, r


@pytest.mark.parametrize("kernels", [False, True], ids=["reference", "triton"])
def test_padded_prefill_matches_unpadded(tiny_model, kernels):
    padded, rp = _run(tiny_model, True, kernels)
    plain, rq = _run(tiny_model, False, kernels)
    assert rp.prefill_graphs is not None and rq.prefill_graphs is None
    for (ids_a, lg_a), (ids_b, lg_b) in zip(padded, plain):
        assert ids_a == ids_b
        assert lg_a.keys() == lg_b.keys()
        for k in lg_a:
            assert not torch.isnan(lg_a[k]).any()
            assert rel_err(lg_a[k], lg_b[k]) <= 1e-5, k
    short = kernels and not CUDA
    live, used = ([1, 2, 3], list(range(1, 7))) if short else ([1, 2, 3, 4], list(range(1, 12)))
    sa, sb = rp.caches.state, rq.caches.state
    for a, b in zip(sa.ssm_f32 + sa.ssm_bf16 + [sa.conv], sb.ssm_f32 + sb.ssm_bf16 + [sb.conv]):
        if a.numel() == 0:  # an empty partition (all heads f32)
            continue
        dim = 1 if a is sa.conv else 0
        a_live, b_live = a.index_select(dim, torch.tensor(live, device=a.device)), \
            b.index_select(dim, torch.tensor(live, device=b.device))
        assert not torch.isnan(a_live).any() and rel_err(a_live, b_live) <= 1e-5
        dead = torch.tensor([s for s in range(1, SLOTS) if s not in live], device=a.device)
        assert torch.isnan(a.index_select(dim, dead).float()).all(), "padding wrote a slot it does not own"
    ka, kb = rp.caches.kv.kv, rq.caches.kv.kv
    a, b = ka[:, :, used], kb[:, :, used]  # written positions equal, unwritten ones still poisoned in both
    tokens = 5 + 50 + 9 + 1 + (0 if short else 70)
    written = a.shape[0] * 2 * tokens * a[0, 0, 0, 0].numel()  # layers x K/V x tokens x heads x dim
    assert torch.equal(a.isnan(), b.isnan()) and (~a.isnan()).sum() == written
    assert rel_err(torch.nan_to_num(a), torch.nan_to_num(b)) <= 1e-5
    dead = [b for b in range(1, BLOCKS) if b not in used]
    assert torch.isnan(ka[:, :, dead]).all(), "padding wrote a KV block it does not own"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32 if t.element_size() == 4 else torch.int16)


@pytest.mark.gpu
def test_gpu_captured_prefill_equals_eager(tiny_model):
    """Prefill graphs replayed (and decode graphs) vs the same padded steps run eagerly: identical tokens,
    logits bits, recurrent / conv state bits of every slot but the dummy and KV bits of every block but 0."""
    (graphed, rg), (eager, re) = _run(tiny_model, True, True, capture=True), _run(tiny_model, True, True)
    for (ids_a, lg_a), (ids_b, lg_b) in zip(graphed, eager):
        assert ids_a == ids_b and lg_a.keys() == lg_b.keys()
        for k in lg_a:
            assert torch.equal(_bits(lg_a[k]), _bits(lg_b[k])), k
    sa, sb = rg.caches.state, re.caches.state
    for a, b in zip(sa.ssm_f32 + sa.ssm_bf16 + [sa.conv.transpose(0, 1)], sb.ssm_f32 + sb.ssm_bf16
                    + [sb.conv.transpose(0, 1)]):
        assert torch.equal(_bits(a[1:]), _bits(b[1:]))
    assert torch.equal(_bits(rg.caches.kv.kv[:, :, 1:]), _bits(re.caches.kv.kv[:, :, 1:]))


@pytest.mark.gpu
def test_gpu_staggered_arrivals_graphs_vs_eager(tiny_dir):  # noqa: F811
    """Requests arriving while others decode (mixed decode + prefill steps, several prompts per step, one
    longer than a bucket boundary): graphs on vs enforce_eager give identical streams and logits bits."""
    import random

    from linrnn_serve.sampling_params import SamplingParams
    from test_engine_gpu import make

    g, e = make(tiny_dir, eager=False), make(tiny_dir, eager=True)
    assert g.runner.prefill_graphs.use_graphs and not e.runner.prefill_graphs.use_graphs
    rng = random.Random(11)
    steps, n = 0, 0
    while steps < 80 or g.has_unfinished_requests():
        if steps < 60 and steps % 4 == 0:
            for _ in range(rng.randint(1, 3)):
                prompt = [rng.randrange(g.model_config.vocab_size) for _ in range(rng.choice([1, 7, 16, 17, 100, 300]))]
                p = SamplingParams(max_tokens=rng.randint(3, 20), ignore_eos=True, temperature=0.0)
                for eng in (g, e):
                    eng.add_request(f"s{n}", prompt, p)
                n += 1
        outs_g = {o.request_id: [c.token_ids for c in o.outputs] for o in g.step()}
        outs_e = {o.request_id: [c.token_ids for c in o.outputs] for o in e.step()}
        assert outs_g == outs_e, f"token streams differ at step {steps}"
        lg, le = g.runner.last_logits(), e.runner.last_logits()
        assert lg.keys() == le.keys()
        for sid in lg:
            assert torch.equal(_bits(lg[sid]), _bits(le[sid])), f"logits bits differ at step {steps}"
        steps += 1
        assert steps < 400
    g.check_integrity()
    e.check_integrity()


@pytest.mark.gpu
def test_gpu_a3b_padded_prefill_matches_unpadded(a3b_dir):  # noqa: F811
    """The Qwen3.5-35B-A3B-shaped engine (NVFP4 experts: the MMA kernel takes padded tokens beside real ones
    in its 8-token tiles) with captured prefill graphs against an unpadded eager forward of the same model
    (runner.session, which never pads). bf16 GEMMs round differently at another row count, so the yardstick
    is that rounding noise, measured here: the same prompt forwarded unpadded beside another prompt. Padding
    that leaked into a real row would be O(1) off."""
    from linrnn_serve.runner.session import Session
    from linrnn_serve.sampling_params import SamplingParams
    from test_engine_gpu import make

    g = make(a3b_dir, eager=False, load_format="dummy")
    assert g.runner.prefill_graphs.use_graphs
    g.capture_logits = True
    rng = torch.Generator().manual_seed(2)
    V = g.model_config.vocab_size

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    for L in (5, 100, 128, 400):
        prompt = torch.randint(0, V, (L,), generator=rng).tolist()
        other = torch.randint(0, V, (37,), generator=rng).tolist()
        g.add_request(f"p{L}", prompt, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0))
        while g.has_unfinished_requests():
            g.step()
        got = g.logits_log[(f"p{L}", 0, 0)].float()
        s = Session(g.model, 3, L + 64)
        ref = s.forward([s.new_seq()], [prompt])[0].float().cpu()
        beside = s.forward([s.new_seq(), s.new_seq()], [other, prompt])[1].float().cpu()
        noise = rel(beside, ref)
        assert not torch.isnan(got).any()
        assert rel(got, ref) <= max(4 * noise, 2e-2), (L, rel(got, ref), noise)
    g.check_integrity()


@pytest.mark.skipif(CUDA, reason="counts on meta / CPU tensors; the GPU profile counts there")
def test_launch_counter_35b_prefill():
    """`bench launches --prefill-tokens`: one 128-token prefill forward of the 35B-A3B NVFP4 preset, counted on
    meta tensors (the ~750 launches a prefill graph replays at once; ~1600 before the GDN layers shared one varlen
    plan per forward and the attention output gate moved into the attention kernel): every GDN layer's three chunk
    kernels and conv, every attention layer's varlen kernel, one lm_head row."""
    from linrnn_bench.launch_count import count_prefill_launches
    from linrnn_serve.presets import resolve_model

    c = count_prefill_launches(resolve_model("qwen35moe-nvfp4", "dummy").cfg, 128)
    for k in ("_chunk_wy_kernel", "_chunk_state_kernel", "_chunk_output_kernel", "_conv1d_varlen_kernel"):
        assert c[f"triton:{k}"] == 30, k
    assert c["triton:_prefill_kernel"] == 10 and "torch:item" not in c
    assert c["torch:searchsorted"] <= 2 and "torch:sigmoid" not in c  # the plan once per forward; the gate fused
    assert 600 < sum(c.values()) < 1000
