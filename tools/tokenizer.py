"""The small byte-level BPE tokenizer of the default model (and of the project's tests).

Byte-level BPE trained with the `tokenizers` library on the training split of the data recipe
(tools/corpus.py). Pre-tokenisation is Qwen2/Qwen3's regex split (single digits, letters runs,
punctuation runs, newline runs, whitespace runs) followed by GPT-2's byte-to-unicode map, so
every byte string round-trips and the vocabulary looks like the real models'. No normaliser:
text is kept byte-exact (code and its indentation).

Vocabulary: 8192 entries = 3 special tokens + 256 byte symbols + 7933 merges. Why 8192: the
embedding and the untied lm_head stay bf16 in the NVFP4 checkpoint, 2 x V x H x 2 bytes, which
is 12.6 MB at V=8192, H=384 (a third of the ~38 MB budget); 16k would double that and leave too
little for the layers, while below ~8k code compresses noticeably worse (whole keywords and
common identifiers are single tokens at 8k). A power of two also keeps the lm_head GEMM tidy
and token ids fit uint16.

Special tokens (ids fixed, first in the vocabulary): 0 <|endoftext|> (document separator, pad),
1 <|im_start|>, 2 <|im_end|> (ChatML, as Qwen). The chat template is ChatML without a default
system prompt; generation stops at <|im_end|> or <|endoftext|>.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Iterator

EOT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [EOT, IM_START, IM_END]  # ids 0, 1, 2
EOT_ID, IM_START_ID, IM_END_ID = 0, 1, 2
VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 8192

# Qwen2/Qwen3 pre-tokenizer pattern (tokenizer.json of the Qwen releases).
SPLIT_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# ChatML. Content may be a string or a list of OpenAI-style parts ({"type": "text", "text": ...}).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['content'] is string -%}{%- set content = message['content'] -%}"
    "{%- else -%}{%- set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('') -%}{%- endif -%}"
    "{{- '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)

TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "model_max_length": MODEL_MAX_LENGTH,
    "bos_token": None,
    "eos_token": IM_END,
    "pad_token": EOT,
    "unk_token": None,
    "add_bos_token": False,
    "add_eos_token": False,
    "clean_up_tokenization_spaces": False,
    "chat_template": CHAT_TEMPLATE,
}

# tokenizer.json, tokenizer_config.json: the whole HF-format tokenizer
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def assets_dir() -> str:
    """linrnn_serve/assets/tokenizer/ of this checkout (found relative to this file, no import)."""
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "linrnn_serve", "assets",
                        "tokenizer")


def _new_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    return tok


def train_tokenizer(texts: Iterable[str], vocab_size: int = VOCAB_SIZE, min_frequency: int = 2):
    """Train the BPE on `texts` (deterministic for the same texts in the same order)."""
    from tokenizers import pre_tokenizers, trainers

    if vocab_size < len(SPECIAL_TOKENS) + 256 + 1:
        raise ValueError(f"vocab_size {vocab_size} is too small: needs > {len(SPECIAL_TOKENS) + 256} "
                         f"(special tokens + 256 byte symbols)")
    tok = _new_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_as_iter(texts), trainer)
    got = [tok.token_to_id(t) for t in SPECIAL_TOKENS]
    if got != [EOT_ID, IM_START_ID, IM_END_ID]:
        raise RuntimeError(f"special token ids came out as {got}, expected [0, 1, 2]")
    return tok


def _as_iter(texts: Iterable[str]) -> Iterator[str]:
    yield from texts


def save_hf(tok, out_dir: str) -> list[str]:
    """Write tokenizer.json + tokenizer_config.json (loadable by transformers' AutoTokenizer and by the
    `tokenizers` library + jinja2)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"), pretty=False)
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(TOKENIZER_CONFIG, f, indent=2)
        f.write("\n")
    return [os.path.join(out_dir, n) for n in TOKENIZER_FILES]


def load(tok_dir: str | None = None):
    """The `tokenizers.Tokenizer` saved in `tok_dir` (default: the package asset)."""
    from tokenizers import Tokenizer

    path = os.path.join(tok_dir or assets_dir(), "tokenizer.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no tokenizer.json (run `python -m tools.build_data` to build it)")
    return Tokenizer.from_file(path)


def render_chat(messages: list[dict], add_generation_prompt: bool = False) -> str:
    """Render CHAT_TEMPLATE the way transformers' apply_chat_template does (jinja2 sandbox,
    trim_blocks, lstrip_blocks)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt)


def encode_batch(tok, texts: list[str]) -> list[list[int]]:
    """Token ids of each text; special-token strings inside a text map to their ids."""
    return [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
