"""Data recipe of the default model: a deterministic text corpus that every machine with Python has
and that may be redistributed.

Sources (all from the running interpreter's standard library, PSF License Agreement, the licence
text is the stdlib's LICENSE.txt, shipped beside the held-out text):
  * every UTF-8 `.py` file under `sysconfig.get_paths()["stdlib"]` (tests included: they are most
    of the Python code there), minus the exclusions below;
  * the documentation topics bundled for `help()` (`pydoc_data/topics.py`, the reference manual's
    topic texts), one document per topic, taken from the file's `topics` dict (parsed, not imported).
Exclusions (recorded with reasons in the manifest): site-packages/dist-packages, `__pycache__`,
`config-*` and `lib-dynload` folders, `_sysconfigdata*` (describes the build machine), the raw
`pydoc_data/topics.py` (used as topics instead), files that are not valid UTF-8, and files that
contain one of the tokenizer's special-token strings.

Split: whole documents. The validation set is a fixed ~300 KB of library modules and topics (not
tests, not the `encodings/` codec tables), chosen in the order of sha256("linrnn-val-v1/" + name)
among documents of at most 40,000 characters; everything else is training data. The held-out
text (the default KL-gate text) is the validation documents, each followed by <|endoftext|>.

Chat samples (train split only, to teach the ChatML turn format and <|im_end|>): questions about
public functions/classes of library modules answered with their docstring ("What does `m.f` do?")
or their source ("Write the function `f` from the `m` module."), and about the pydoc topics,
at most MAX_CHAT_SAMPLES, chosen by hash.

Same interpreter version + same stdlib files -> byte-identical corpus; the manifest records the
version and the sha256 of every file so a rebuild can be checked.
"""
from __future__ import annotations

import ast
import hashlib
import os
import sys
import sysconfig
import warnings
from dataclasses import dataclass

from tools.tokenizer import EOT, SPECIAL_TOKENS, render_chat

RECIPE_VERSION = 1
VAL_TARGET_CHARS = 300_000
VAL_MAX_DOC_CHARS = 40_000
MAX_CHAT_SAMPLES = 6000
CHAT_MIN_DOC_CHARS = 60
CHAT_MAX_SOURCE_CHARS = 2500
_SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__", "lib-dynload")
_TOPICS = "pydoc_data/topics.py"


@dataclass(frozen=True)
class Source:
    name: str  # "stdlib/<relpath>" or "pydoc/<topic>"
    text: str
    sha256: str  # of the file's bytes (the topics file's, for topics)

    @property
    def is_test(self) -> bool:
        parts = self.name.split("/")
        return any(p in ("test", "tests", "idle_test") or p.startswith("test_") for p in parts[1:])


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def _h(s: str) -> int:
    return int.from_bytes(hashlib.sha256(s.encode()).digest()[:8], "big")


def collect_sources(root: str | None = None) -> tuple[list[Source], list[dict]]:
    """All documents of the recipe, sorted by name, and the excluded files with their reasons."""
    root = os.path.abspath(root or stdlib_root())
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root}: stdlib folder not found")
    sources, excluded = [], []
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        dirnames[:] = sorted(d for d in dirnames
                             if d not in _SKIP_DIRS and not (rel_dir == "." and d.startswith("config-")))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            rel = os.path.normpath(os.path.join(rel_dir, fn)).replace(os.sep, "/")
            with open(os.path.join(dirpath, fn), "rb") as f:
                raw = f.read()
            digest = hashlib.sha256(raw).hexdigest()
            if fn.startswith("_sysconfigdata"):
                excluded.append({"path": rel, "sha256": digest, "reason": "describes the build machine"})
                continue
            if rel == _TOPICS:
                topics = _parse_topics(raw, rel)
                sources += [Source(f"pydoc/{k}", _clean(v), digest) for k, v in sorted(topics.items())]
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                excluded.append({"path": rel, "sha256": digest, "reason": "not UTF-8"})
                continue
            if any(s in text for s in SPECIAL_TOKENS):
                excluded.append({"path": rel, "sha256": digest, "reason": "contains a special-token string"})
                continue
            sources.append(Source(f"stdlib/{rel}", _clean(text), digest))
    sources.sort(key=lambda s: s.name)
    return sources, excluded


def _clean(text: str) -> str:
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _parse_topics(raw: bytes, rel: str) -> dict[str, str]:
    """The `topics = {...}` dict of pydoc_data/topics.py, by literal evaluation (no import)."""
    tree = ast.parse(raw)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
            return {k: v for k, v in topics.items() if not any(s in v for s in SPECIAL_TOKENS)}
    raise ValueError(f"{rel}: no `topics = {{...}}` assignment found")


def split_sources(sources: list[Source], target_chars: int = VAL_TARGET_CHARS) -> tuple[list[Source], list[Source]]:
    """(train, val): val is ~target_chars of non-test documents, chosen by hash order."""
    candidates = sorted((s for s in sources if not s.is_test and len(s.text) <= VAL_MAX_DOC_CHARS
                         and not s.name.startswith("stdlib/encodings/")),
                        key=lambda s: (_h("linrnn-val-v1/" + s.name), s.name))
    val, total = [], 0
    for s in candidates:
        if total >= target_chars:
            break
        val.append(s)
        total += len(s.text)
    val_names = {s.name for s in val}
    return [s for s in sources if s.name not in val_names], val


def heldout_text(val: list[Source]) -> str:
    """The default KL-gate text: validation documents, each followed by <|endoftext|>."""
    return "".join(s.text + EOT for s in val)


def _module_name(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod[: -len(".__init__")] if mod.endswith(".__init__") else mod


def chat_samples(train: list[Source], limit: int = MAX_CHAT_SAMPLES) -> list[str]:
    """Rendered ChatML conversations built from the training documents (see module docstring)."""
    pairs: list[tuple[int, str, str]] = []  # (hash, question, answer)
    for src in train:
        if src.name.startswith("pydoc/"):
            topic = src.name[len("pydoc/"):]
            q = f'Explain the Python topic "{topic}".'
            pairs.append((_h("chat/" + src.name), q, src.text.strip()))
            continue
        if src.is_test:
            continue
        mod = _module_name(src.name[len("stdlib/"):])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                tree = ast.parse(src.text)
            except (SyntaxError, ValueError):
                continue
        for qual, node in _public_defs(tree):
            doc = ast.get_docstring(node, clean=True)
            if not doc or len(doc) < CHAT_MIN_DOC_CHARS:
                continue
            key = f"chat/{mod}.{qual}"
            seg = ast.get_source_segment(src.text, node)
            if _h(key) % 2 and seg and len(seg) <= CHAT_MAX_SOURCE_CHARS and isinstance(
                    node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                kind = "method" if "." in qual else "function"
                pairs.append((_h(key), f"Write the {kind} `{qual}` from the `{mod}` module.",
                              "```python\n" + _dedent(seg, node.col_offset) + "\n```"))
            else:
                pairs.append((_h(key), f"What does `{mod}.{qual}` do?", doc))
    pairs.sort()
    return [render_chat([{"role": "user", "content": q}, {"role": "assistant", "content": a}])
            for _, q, a in pairs[:limit]]


def _public_defs(tree: ast.Module):
    """(qualified name, node) of public top-level functions/classes and their public methods."""
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
            yield node.name, node
            if isinstance(node, ast.ClassDef):
                for sub in node.body:
                    if isinstance(sub, (ast.FunctionDef, ast.AsyncFunctionDef)) and not sub.name.startswith("_"):
                        yield f"{node.name}.{sub.name}", sub


def _dedent(seg: str, col: int) -> str:
    """get_source_segment keeps the first line unindented and the rest at their file indentation."""
    lines = seg.split("\n")
    return "\n".join([lines[0]] + [ln[col:] if ln[:col].strip() == "" else ln for ln in lines[1:]])


@dataclass
class Corpus:
    train_docs: list[str]  # training documents (raw and chat), in training-stream order
    tokenizer_texts: list[str]  # raw training documents by name: what the tokenizer is trained on
    heldout: str
    manifest: dict


def build_corpus(root: str | None = None, val_target_chars: int = VAL_TARGET_CHARS,
                 max_chat_samples: int = MAX_CHAT_SAMPLES) -> Corpus:
    root = os.path.abspath(root or stdlib_root())
    sources, excluded = collect_sources(root)
    train, val = split_sources(sources, val_target_chars)
    chats = chat_samples(train, max_chat_samples)
    docs = [(_h("order/" + s.name), s.text) for s in train]
    docs += [(_h(f"order/chat/{i}"), c) for i, c in enumerate(chats)]
    docs.sort(key=lambda d: d[0])
    held = heldout_text(val)
    val_names = {s.name for s in val}
    files: dict[str, dict] = {}
    for s in sources:
        path = _TOPICS if s.name.startswith("pydoc/") else s.name[len("stdlib/"):]
        f = files.setdefault(path, {"path": path, "sha256": s.sha256, "chars": 0, "val_docs": 0, "docs": 0})
        f["chars"] += len(s.text)
        f["docs"] += 1
        f["val_docs"] += s.name in val_names
    manifest = {
        "recipe_version": RECIPE_VERSION,
        "python": sys.version.split()[0],
        "implementation": sys.implementation.name,
        "licence": "PSF License Agreement (Python-2.0); text: LICENSE.txt of the Python distribution",
        "stdlib_root": root,
        "sources": {"py_files": sum(1 for p in files if p != _TOPICS),
                    "pydoc_topics": sum(1 for s in sources if s.name.startswith("pydoc/"))},
        "val_docs": [s.name for s in val],
        "stats": {"train_docs": len(train), "val_docs": len(val), "chat_samples": len(chats),
                  "train_chars": sum(len(t) for _, t in docs), "heldout_chars": len(held)},
        "heldout_sha256": hashlib.sha256(held.encode()).hexdigest(),
        "files": sorted(files.values(), key=lambda f: f["path"]),
        "excluded": excluded,
    }
    return Corpus([t for _, t in docs], [s.text for s in train], held, manifest)
