"""The reference model (naive ops) against transformers' implementation, f32 on CPU (issue #2)."""
import pytest
import torch

from helpers import make_hf_checkpoint, rel_err, rewrite_as_release_layout, run_prompt
from linrnn_serve.config import ModelConfig
from linrnn_serve.models.loading import load_model
from linrnn_serve.runner.session import Session

TOL = 1e-4


def _ours(path):
    return load_model(ModelConfig.from_pretrained(path), str(path), torch.float32, "cpu", progress=False)


def _theirs(path, family):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3NextForCausalLM

    cls = Qwen3_5MoeForCausalLM if family == "qwen3_5_moe" else Qwen3NextForCausalLM
    return cls.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("family,kw", [
    ("qwen3_5_moe", {}),
    ("qwen3_next", {"norm_topk_prob": True}),
    ("qwen3_next", {"norm_topk_prob": False}),
    ("qwen3_next", {"mlp_only_layers": [1], "intermediate_size": 48}),
])
def test_prefill_logits_match_transformers(tmp_path, family, kw):
    path = make_hf_checkpoint(tmp_path, family, **kw)
    ids = torch.randint(0, 128, (1, 90))
    with torch.no_grad():
        ref = _theirs(path, family)(ids).logits[0]
    assert rel_err(run_prompt(_ours(path), ids[0].tolist()), ref) <= TOL


def test_release_layout_loads(tmp_path):
    """Nested text_config, model.language_model.* names, fused 3-D experts, mtp/visual skipped."""
    path = make_hf_checkpoint(tmp_path)
    ids = torch.randint(0, 128, (1, 40))
    with torch.no_grad():
        ref = _theirs(path, "qwen3_5_moe")(ids).logits[0]
    rewrite_as_release_layout(path)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.architecture == "Qwen3_5MoeForConditionalGeneration"
    assert rel_err(run_prompt(_ours(path), ids[0].tolist()), ref) <= TOL


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return _ours(make_hf_checkpoint(tmp_path_factory.mktemp("tiny")))


@pytest.mark.parametrize("n", [1, 5, 64, 200])
def test_prefill_then_decode_equals_one_prefill(tiny_model, n):
    """Decode from carried conv / recurrent / KV state, crossing chunk (64) and block (16) boundaries."""
    m = 6
    ids = torch.randint(0, 128, (n + m,)).tolist()
    full = run_prompt(tiny_model, ids)
    s = Session(tiny_model, 1, n + m + 16)
    sid = s.new_seq()
    first = s.forward([sid], [ids[:n]])
    steps = [s.forward([sid], [[t]]) for t in ids[n:]]
    got = torch.cat([first] + steps)
    assert rel_err(got, full[n - 1:]) <= TOL


def test_batched_varlen_equals_separate(tiny_model):
    """Three sequences in one flattened varlen batch give the same logits as each alone."""
    prompts = [torch.randint(0, 128, (L,)).tolist() for L in (3, 70, 17)]
    s = Session(tiny_model, 3, 128)
    sids = [s.new_seq() for _ in prompts]
    batched = s.forward(sids, prompts)
    nxt = [[1], [2], [3]]
    dec = s.forward(sids, nxt)
    for i, p in enumerate(prompts):
        alone = run_prompt(tiny_model, p + nxt[i])
        assert rel_err(batched[i], alone[-2]) <= TOL
        assert rel_err(dec[i], alone[-1]) <= TOL
