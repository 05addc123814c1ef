"""Build the default model's data (run on the CPU machine; the GPU run only consumes its output):

    python -m tools.build_data [--train-tokenizer] [--out tools/out]

1. the corpus of tools/corpus.py from this interpreter's standard library;
2. the tokenizer (tools/tokenizer.py): trained on the training split when --train-tokenizer is given
   or none exists yet, else the one in linrnn_serve/assets/tokenizer/ is reused (the shipped model
   and its tokenizer must stay paired);
3. tokenised train/val arrays (uint16) in OUT/data.npz with a JSON `meta` entry (tokenizer sha256,
   manifest sha256, interpreter version, counts); the validation tokens are exactly the tokens of
   the held-out text;
4. tools/corpus_manifest.json (file list + sha256, committed) and the held-out text + its licence
   beside the default model (linrnn_serve/assets/default-model/heldout.txt, LICENSE-Python.txt).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time

import numpy as np

from tools import corpus as corpus_mod
from tools import tokenizer as tk

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(REPO, "tools", "out")
MODEL_ASSETS = os.path.join(REPO, "linrnn_serve", "assets", "default-model")
MANIFEST = os.path.join(REPO, "tools", "corpus_manifest.json")
HELDOUT_NAME = "heldout.txt"
LICENCE_NAME = "LICENSE-Python.txt"


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def tokenize_docs(tok, docs: list[str]) -> np.ndarray:
    """One stream: each document's tokens followed by <|endoftext|>."""
    ids = tk.encode_batch(tok, docs)
    n = sum(len(x) + 1 for x in ids)
    out = np.empty(n, dtype=np.uint16)
    pos = 0
    for x in ids:
        out[pos:pos + len(x)] = x
        out[pos + len(x)] = tk.EOT_ID
        pos += len(x) + 1
    return out


def build(out_dir: str = DEFAULT_OUT, stdlib: str | None = None, train_tokenizer: bool = False,
          tok_dir: str | None = None, model_assets: str = MODEL_ASSETS, manifest_path: str = MANIFEST,
          vocab_size: int = tk.VOCAB_SIZE, log=print) -> dict:
    t0 = time.time()
    tok_dir = tok_dir or tk.assets_dir()
    c = corpus_mod.build_corpus(stdlib)
    log(f"corpus: {c.manifest['stats']} ({time.time() - t0:.0f} s)")
    if train_tokenizer or not os.path.isfile(os.path.join(tok_dir, "tokenizer.json")):
        tok = tk.train_tokenizer(c.tokenizer_texts, vocab_size)
        tk.save_hf(tok, tok_dir)
        log(f"tokenizer: trained, vocab {tok.get_vocab_size()} -> {tok_dir} ({time.time() - t0:.0f} s)")
    tok = tk.load(tok_dir)
    train = tokenize_docs(tok, c.train_docs)
    val = np.asarray(tok.encode(c.heldout, add_special_tokens=False).ids, dtype=np.uint16)
    log(f"tokens: train {train.size:,}, val {val.size:,} ({time.time() - t0:.0f} s)")

    os.makedirs(model_assets, exist_ok=True)
    with open(os.path.join(model_assets, HELDOUT_NAME), "w", encoding="utf-8", newline="\n") as f:
        f.write(c.heldout)
    licence = os.path.join(c.manifest["stdlib_root"], "LICENSE.txt")
    if os.path.isfile(licence):
        shutil.copyfile(licence, os.path.join(model_assets, LICENCE_NAME))
    manifest = dict(c.manifest)
    manifest.pop("stdlib_root")  # machine-specific path; kept in data.npz meta only
    with open(manifest_path, "w") as f:
        json.dump(manifest, f, indent=1)
        f.write("\n")

    meta = {
        "recipe_version": corpus_mod.RECIPE_VERSION,
        "python": c.manifest["python"],
        "stdlib_root": c.manifest["stdlib_root"],
        "tokenizer_sha256": sha256_file(os.path.join(tok_dir, "tokenizer.json")),
        "manifest_sha256": sha256_file(manifest_path),
        "heldout_sha256": c.manifest["heldout_sha256"],
        "vocab_size": tok.get_vocab_size(),
        "eot_id": tk.EOT_ID,
        "train_tokens": int(train.size),
        "val_tokens": int(val.size),
        "stats": c.manifest["stats"],
    }
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "data.npz")
    np.savez_compressed(path, train=train, val=val, meta=np.array(json.dumps(meta)))
    meta["path"] = path
    meta["bytes"] = os.path.getsize(path)
    log(f"wrote {path} ({meta['bytes'] / 1e6:.1f} MB), {model_assets}/{HELDOUT_NAME}, {manifest_path} "
        f"({time.time() - t0:.0f} s)")
    return meta


def load_data(path: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """(train uint16, val uint16, meta) from a data.npz written by build()."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no token file (build it with `python -m tools.build_data`)")
    with np.load(path) as z:
        return z["train"], z["val"], json.loads(str(z["meta"]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=DEFAULT_OUT, help="folder for data.npz (default tools/out)")
    p.add_argument("--stdlib", default=None, help="stdlib folder (default: this interpreter's)")
    p.add_argument("--train-tokenizer", action="store_true", help="(re)train the tokenizer asset")
    p.add_argument("--vocab-size", type=int, default=tk.VOCAB_SIZE)
    args = p.parse_args(argv)
    build(args.out, args.stdlib, args.train_tokenizer, vocab_size=args.vocab_size)
    return 0


if __name__ == "__main__":
    sys.exit(main())
