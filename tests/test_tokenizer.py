"""engine/tokenizer.py: encode/decode, chat templates (vs transformers), EOS ids, incremental
detokenization (never half a character, unknown ids ignored)."""
from __future__ import annotations

import json
import os
import random

import pytest

from engine_fixtures import CORPUS, write_tiny_tokenizer
from linrnn_serve.engine.tokenizer import IncrementalDetokenizer, StreamDetokenizer, Tokenizer, TokenizerError

TEMPLATE = """{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n' }}{%- for t in tools %}{{- t | tojson }}{{- '\\n' }}{%- endfor %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- for m in messages %}
  {%- if m.role not in ['system', 'user', 'assistant'] %}{{- raise_exception('bad role ' + m.role) }}{%- endif %}
  {%- if loop.index0 > 8 %}{% break %}{% endif %}
  {{- '<|im_start|>' + m.role + '\\n' }}{% generation %}{{- m.content }}{% endgeneration %}{{- '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not enable_thinking %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"""


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tok"))
    write_tiny_tokenizer(d)
    return d


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


def hf_tokenizer(path):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(tokenizer_file=os.path.join(path, "tokenizer.json"),
                                                eos_token="<|im_end|>")


def test_encode_decode_roundtrip(tok, tok_dir):
    hf = hf_tokenizer(tok_dir)
    for text in CORPUS + ["unseen words ÅÆØ ✓ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢"]:
        ids = tok.encode(text)
        assert ids == hf.encode(text)
        assert tok.decode(ids) == text == hf.decode(ids)


def test_chat_template_matches_transformers(tok, tok_dir, tmp_path):
    hf = hf_tokenizer(tok_dir)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo 你好"},
            {"role": "assistant", "content": "hi"}, {"role": "user", "content": "again"}]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "ü"}}}]
    for kw in ({}, {"tools": tools}, {"enable_thinking": False}, {"add_generation_prompt": False}):
        kw.setdefault("add_generation_prompt", True)
        want = hf.apply_chat_template(msgs, chat_template=TEMPLATE, tokenize=False, **kw)
        assert tok.apply_chat_template(msgs, chat_template=TEMPLATE, **kw) == want
    # the default template comes from tokenizer_config.json; chat_template.jinja takes precedence
    assert tok.apply_chat_template(msgs[1:2]) == "<|im_start|>user\nhéllo 你好<|im_end|>\n<|im_start|>assistant\n"
    assert tok.apply_chat_template(msgs[1:2], tokenize=True) == tok.encode(
        "<|im_start|>user\nhéllo 你好<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    d = str(tmp_path / "j")
    write_tiny_tokenizer(d)
    with open(os.path.join(d, "chat_template.jinja"), "w") as f:
        f.write("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(d).apply_chat_template(msgs[:2]) == "[be brief][héllo 你好]"
    import jinja2

    with pytest.raises(jinja2.exceptions.TemplateError, match="bad role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], chat_template=TEMPLATE)


def test_eos_ids(tok_dir, tmp_path):
    t = Tokenizer.from_dir(tok_dir)
    assert t.eos_token == "<|im_end|>" and t.eos_token_ids == [t.token_to_id("<|im_end|>")]
    d = str(tmp_path / "e")
    write_tiny_tokenizer(d)
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [0, 2]}, f)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"text_config": {"eos_token_id": 1}}, f)
    assert sorted(Tokenizer.from_dir(d, eos_token_ids=[7]).eos_token_ids) == [0, 1, 2, 7]


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(str(tmp_path))


@pytest.mark.parametrize("kind", ["decode_stream", "generic"])
def test_incremental_detokenizer(tok, kind):
    def detok(prompt=()):
        return StreamDetokenizer(tok, list(prompt)) if kind == "decode_stream" else \
            IncrementalDetokenizer(tok, list(prompt))

    assert isinstance(tok.detokenizer(), StreamDetokenizer)
    # valid text: no delta ever holds half a character, and the deltas add up to the text
    for text in CORPUS:
        ids = tok.encode(text)
        d = detok([5, 6])
        deltas = [d.update(i) for i in ids]
        assert "".join(deltas) == text
        assert not any("\ufffd" in x for x in deltas)
    # random ids, including ones outside the tokenizer's vocab and special tokens
    rng = random.Random(0)
    V = tok.max_id + 1
    for trial in range(20):
        ids = [rng.randrange(V + 40) for _ in range(40)]
        d = detok()
        out = "".join(d.update(i) for i in ids)
        full = tok.decode([i for i in ids if i < V])
        assert full.startswith(out)
        if kind == "decode_stream":  # text ending in invalid bytes is held back; flush() gives all of it
            assert out + d.flush() == full
    # a multi-byte character split across byte tokens comes out whole, at its last byte
    b = "你".encode()
    table = tok.token_bytes()
    byte_ids = [table.index(bytes([x])) for x in b]
    d = detok()
    assert [d.update(i) for i in byte_ids] == ["", "", "你"]
    # a character cut off at the end is reported as U+FFFD by flush() (as vLLM / OpenAI), not dropped
    d = detok()
    assert "".join(d.update(i) for i in tok.encode("ab")) == "ab"
    assert [d.update(i) for i in byte_ids[:2]] == ["", ""]
    assert d.flush() == "\ufffd"
    assert d.flush() == ""


def test_decode_skips_unknown_and_special(tok):
    eos = tok.eos_token_ids[0]
    ids = tok.encode("hello") + [eos, 10_000]
    assert tok.decode(ids) == "hello"
    assert tok.decode(ids, skip_special_tokens=False) == "hello<|im_end|>"
    d = tok.detokenizer(params=None)
    assert "".join(d.update(i) for i in ids) == "hello"
