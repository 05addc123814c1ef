"""Shared fixtures of the engine tests: a tiny model directory with a tiny HF-format tokenizer.

The tokenizer is a byte-level BPE trained here on a few sentences (ASCII, accents, CJK, emoji), so
multi-byte characters span several tokens; it is smaller than the model's vocab, so random
weights also sample ids the tokenizer does not know (as padded real vocabs do).
"""
from __future__ import annotations

import json
import os

import torch

from helpers import make_hf_checkpoint

MODEL_VOCAB = 320
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog.",
    "héllo wörld, café crème brûlée naïve résumé",
    "你好，世界。今天天气很好。",
    "emoji 😀🎉 and symbols € £ ¥",
    "The capital of France is Paris. The capital of Japan is Tokyo.",
]


def write_tiny_tokenizer(path: str, vocab_size: int = 300) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(CORPUS * 4, trainer)
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    added = {str(i): {"content": t.content, "special": True, "lstrip": False, "rstrip": False,
                      "normalized": False, "single_word": False}
             for i, t in tok.get_added_tokens_decoder().items()}
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": added, "bos_token": None,
           "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
           "clean_up_tokenization_spaces": False}
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, ensure_ascii=False)
    return path


def make_tiny_model_dir(path, seed: int = 0, **overrides) -> str:
    """Tiny f32 qwen3_5_moe checkpoint (tests/helpers.py::TINY, vocab 320) + tiny tokenizer."""
    overrides.setdefault("vocab_size", MODEL_VOCAB)
    make_hf_checkpoint(path, dtype=torch.float32, seed=seed, **overrides)
    write_tiny_tokenizer(str(path))
    return str(path)
